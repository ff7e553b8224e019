"""POST /v1/embeddings: texts or token ids -> the `embeddings` Triton model (all-MiniLM-L6-v2)."""

from __future__ import annotations

import base64

from fastapi import Request

from openai_frontend.errors import invalid
from openai_frontend.generation import unless_disconnected
from openai_frontend.prompts import valid_text
from openai_frontend.schemas import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage

MAX_INPUTS = 2048  # OpenAI's limit per request (the 1 MiB body limit bounds their total size)


def split_inputs(value) -> list[str] | list[list[int]]:
    """The input field's four shapes -> texts, or token-id lists (ids of the embeddings model's
    tokenizer, as OpenAI's API takes them)."""
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        return [value]
    return list(value)


async def serve_embeddings(frontend, body: EmbeddingRequest, raw_request: Request):
    frontend.check_embeddings_model(body.model)
    inputs = split_inputs(body.input)
    if not inputs:
        raise invalid("input", "input: must not be empty")
    if len(inputs) > MAX_INPUTS:
        raise invalid("input", f"input: at most {MAX_INPUTS} items per request, got {len(inputs)}")
    for i, item in enumerate(inputs):
        if not item:  # OpenAI refuses empty strings and empty token lists too
            raise invalid("input", f"input[{i}]: must not be empty" if len(inputs) > 1 else "input: must not be empty")
        if isinstance(item, str):
            valid_text(item, "input")
    # Cancelled (its Triton calls with it) if the client leaves: the work stops after the batch in hand.
    vectors, num_tokens = await unless_disconnected(raw_request, frontend.triton.embed(inputs))
    if body.dimensions is not None and body.dimensions != vectors.shape[1]:
        raise invalid("dimensions", f"dimensions: this model only produces {vectors.shape[1]}")
    data = [EmbeddingData(index=i, embedding=(base64.b64encode(vector.astype("<f4").tobytes()).decode()
                                              if body.encoding_format == "base64" else vector.tolist()))
            for i, vector in enumerate(vectors)]
    tokens = int(num_tokens.sum())
    return EmbeddingResponse(data=data, model=body.model,
                             usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))
