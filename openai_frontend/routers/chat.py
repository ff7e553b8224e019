"""POST /v1/chat/completions: the route; the work is serve_chat_completion (openai_frontend/serving_chat.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from openai_frontend.schemas import ChatCompletionRequest, ChatCompletionResponse, ErrorResponse
from openai_frontend.serving_chat import serve_chat_completion

router = APIRouter()


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse,
             responses={400: {"model": ErrorResponse}, 404: {"model": ErrorResponse}})
async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request):
    return await serve_chat_completion(raw_request.app.state.frontend, body, raw_request)
