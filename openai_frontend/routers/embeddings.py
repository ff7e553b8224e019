"""POST /v1/embeddings: the route; the work is serve_embeddings (openai_frontend/serving_embeddings.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from openai_frontend.schemas import EmbeddingRequest, EmbeddingResponse, ErrorResponse
from openai_frontend.serving_embeddings import serve_embeddings

router = APIRouter()


@router.post("/v1/embeddings", response_model=EmbeddingResponse,
             responses={400: {"model": ErrorResponse}, 404: {"model": ErrorResponse}})
async def create_embeddings(body: EmbeddingRequest, raw_request: Request):
    return await serve_embeddings(raw_request.app.state.frontend, body, raw_request)
