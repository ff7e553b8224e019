"""POST /v1/completions: the route; the work is serve_completion (openai_frontend/serving_completions.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from openai_frontend.schemas import CompletionRequest, CompletionResponse, ErrorResponse
from openai_frontend.serving_completions import serve_completion

router = APIRouter()


@router.post("/v1/completions", response_model=CompletionResponse,
             responses={400: {"model": ErrorResponse}, 404: {"model": ErrorResponse}})
async def create_completion(body: CompletionRequest, raw_request: Request):
    return await serve_completion(raw_request.app.state.frontend, body, raw_request)
