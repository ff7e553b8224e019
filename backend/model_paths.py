"""Where models live on disk: the cache folder, the default models' folders, and the folder an
engine loads for a `model` setting (a Hugging Face folder, or a .gguf file made into one).
Fetching the default models is `tools/prepare_model.py`'s job; this module only finds them.
"""

from __future__ import annotations

import os
from pathlib import Path

from backend.errors import MODEL_UNAVAILABLE, check

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json",
                       "generation_config.json", "model.safetensors")
EMBEDDINGS_MODEL_NAME = "all-MiniLM-L6-v2"
EMBEDDINGS_MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                          "sentence_bert_config.json", "1_Pooling/config.json")


def cache_dir() -> Path:
    return Path(os.environ.get("TRITONLLM_CACHE", Path.home() / ".cache" / "tritonllm"))


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def default_embeddings_dir() -> Path:
    return cache_dir() / "models" / EMBEDDINGS_MODEL_NAME


def is_prepared(folder: Path, required: tuple[str, ...] = DEFAULT_MODEL_FILES) -> bool:
    return all((folder / name).is_file() for name in required)


def prepared_default_model() -> Path:
    """The default model's folder; an error telling how to fetch it when it is not there yet."""
    folder = default_model_dir()
    check(is_prepared(folder), "model", "no model given and the default model is not prepared "
          "(run `tritonllm prepare-model`)", code=MODEL_UNAVAILABLE)
    return folder


def resolve_model_path(model: str | None) -> str:
    """The Hugging Face folder to load: the given one (a .gguf file becomes a cached folder with its
    config and tokenizer), else the prepared default model."""
    if not model:
        return str(prepared_default_model())
    from backend.quantization.gguf import gguf_model_folder  # imports torch: only for a given model

    model = os.path.expanduser(model)
    return str(gguf_model_folder(model) or model)
