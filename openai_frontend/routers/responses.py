"""POST /v1/responses: the route; the work is serve_response (openai_frontend/serving_responses.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from openai_frontend.schemas import ErrorResponse
from openai_frontend.serving_responses import ResponsesRequest, serve_response

router = APIRouter()


@router.post("/v1/responses", responses={400: {"model": ErrorResponse}, 404: {"model": ErrorResponse}})
async def create_response(body: ResponsesRequest, raw_request: Request):
    return await serve_response(raw_request.app.state.frontend, body, raw_request)
