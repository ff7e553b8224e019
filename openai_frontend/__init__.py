"""tritonllm's OpenAI-compatible REST frontend: FastAPI in front of Triton's gRPC streaming API,
serving the `llm` model (completions, chat) and the `embeddings` model."""

from openai_frontend.app import Settings, build_app

__all__ = ["Settings", "build_app"]
