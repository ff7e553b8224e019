"""POST /v1/embeddings: texts -> the `embeddings` Triton model (all-MiniLM-L6-v2)."""

from __future__ import annotations

import base64

from fastapi import APIRouter, Request

from openai_frontend.errors import invalid
from openai_frontend.prompts import valid_text
from openai_frontend.schemas import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage, ErrorResponse

router = APIRouter()
MAX_INPUTS = 2048  # OpenAI's limit per request


@router.post("/v1/embeddings", response_model=EmbeddingResponse,
             responses={400: {"model": ErrorResponse}, 404: {"model": ErrorResponse}})
async def create_embeddings(body: EmbeddingRequest, raw_request: Request):
    frontend = raw_request.app.state.frontend
    frontend.check_embeddings_model(body.model)
    texts: list = [body.input] if isinstance(body.input, str) else list(body.input)
    if not texts:
        raise invalid("input", "input: must not be empty")
    if len(texts) > MAX_INPUTS:
        raise invalid("input", f"input: at most {MAX_INPUTS} items per request, got {len(texts)}")
    if not all(isinstance(text, str) for text in texts):
        raise invalid("input", "input: token-id input is not supported for embeddings; send text")
    vectors, num_tokens = await frontend.triton.embed([valid_text(text, "input") for text in texts])
    if body.dimensions is not None and body.dimensions != vectors.shape[1]:
        raise invalid("dimensions", f"dimensions: this model only produces {vectors.shape[1]}")
    data = [EmbeddingData(index=i, embedding=(base64.b64encode(vector.astype("<f4").tobytes()).decode()
                                              if body.encoding_format == "base64" else vector.tolist()))
            for i, vector in enumerate(vectors)]
    tokens = int(num_tokens.sum())
    return EmbeddingResponse(data=data, model=body.model,
                             usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))
