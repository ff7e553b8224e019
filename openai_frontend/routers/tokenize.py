"""POST /tokenize and /detokenize (vLLM's): the routes; the work is in openai_frontend/serving_tokenize.py."""

from __future__ import annotations

from fastapi import APIRouter, Request

from openai_frontend.schemas import ErrorResponse
from openai_frontend.serving_tokenize import (DetokenizeRequest, DetokenizeResponse, TokenizeRequest,
                                              TokenizeResponse, detokenize, tokenize)

router = APIRouter()


@router.post("/tokenize", response_model=TokenizeResponse,
             responses={400: {"model": ErrorResponse}, 404: {"model": ErrorResponse}})
async def create_tokenize(body: TokenizeRequest, raw_request: Request):
    return tokenize(raw_request.app.state.frontend, body)


@router.post("/detokenize", response_model=DetokenizeResponse,
             responses={400: {"model": ErrorResponse}, 404: {"model": ErrorResponse}})
async def create_detokenize(body: DetokenizeRequest, raw_request: Request):
    return detokenize(raw_request.app.state.frontend, body)
