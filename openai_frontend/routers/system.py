"""GET /health (the LLM ready on at least one Triton replica), /metrics (the frontend's own, with
per-replica readiness and load), /version."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, Request, Response

from openai_frontend.errors import OpenAIError
from openai_frontend.triton import LLM_MODEL

router = APIRouter()


def package_version() -> str:
    try:
        return version("tritonllm")
    except PackageNotFoundError:
        return "unknown"


@router.get("/health")
async def health(raw_request: Request):
    if not await raw_request.app.state.frontend.triton.model_ready(LLM_MODEL):
        raise OpenAIError(503, f"the `{LLM_MODEL}` model is not ready on any Triton replica", None, "model_unavailable")
    return Response(status_code=200)


@router.get("/metrics")
async def metrics(raw_request: Request):
    return Response(raw_request.app.state.frontend.metrics.render(), media_type="text/plain; version=0.0.4")


@router.get("/version")
async def get_version():
    return {"version": package_version()}
