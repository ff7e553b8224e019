"""GET /health and /health/ready (the LLM ready on at least one Triton replica: loaded, and its
process answering the background probe; and the embeddings model, where loaded, answering on one),
/health/live (the frontend itself answers), /metrics (the
frontend's own, with per-replica readiness and load), /version."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, Request, Response

from openai_frontend.errors import OpenAIError
from openai_frontend.triton import EMBEDDINGS_MODEL, LLM_MODEL

router = APIRouter()


def package_version() -> str:
    try:
        return version("tritonllm")
    except PackageNotFoundError:
        return "unknown"


@router.get("/health")
@router.get("/health/ready")
async def health(raw_request: Request):
    """Readiness: answered from the last background check (every 2 s), never by calling Triton, so
    probing it is free and cannot hang."""
    triton = raw_request.app.state.frontend.triton
    if not await triton.model_ready(LLM_MODEL):
        raise OpenAIError(503, f"the `{LLM_MODEL}` model is not ready on any Triton replica", None, "model_unavailable")
    if (why := triton.embeddings_down()) is not None:
        raise OpenAIError(503, f"the `{EMBEDDINGS_MODEL}` model is down on every Triton replica: {why}", None,
                          "model_unavailable")
    return Response(status_code=200)


@router.get("/health/live")
async def live():
    """Liveness: the frontend's event loop answers (restart the frontend only when this fails)."""
    return Response(status_code=200)


@router.get("/metrics")
async def metrics(raw_request: Request):
    return Response(raw_request.app.state.frontend.metrics.render(), media_type="text/plain; version=0.0.4")


@router.get("/version")
async def get_version():
    return {"version": package_version()}
