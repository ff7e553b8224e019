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


def resolve_model_path(model: str | None, revision: str | None = None) -> str:
    """The Hugging Face folder to load: the given one (a .gguf file becomes a cached folder with its
    config and tokenizer), a hub id's snapshot in the local Hugging Face cache, else the prepared
    default model."""
    if not model:
        return str(prepared_default_model())
    expanded = os.path.expanduser(model)
    if not os.path.exists(expanded) and looks_like_hub_id(model):
        return str(hf_cache_snapshot(model, revision))
    from backend.quantization.gguf import gguf_model_folder  # imports torch: only for a given model

    return str(gguf_model_folder(expanded) or expanded)


def looks_like_hub_id(model: str) -> bool:
    """`org/name` or `name`, as vLLM's `model` takes them: no absolute, home or dot path."""
    parts = model.split("/")
    return (not model.startswith(("/", "~", ".")) and 1 <= len(parts) <= 2
            and all(part and part not in (".", "..") for part in parts))


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "huggingface"
    return Path(home).expanduser() / "hub"


def hf_cache_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot folder of `repo_id` at `revision` (a branch or tag through refs/, or a commit
    hash; default main) in the local Hugging Face cache. Never downloads: a clear error when the
    model is not cached."""
    cache = hf_hub_cache()
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    revision = revision or "main"
    ref = repo / "refs" / revision
    commit = ref.read_text(encoding="utf-8").strip() if ref.is_file() else revision
    snapshot = repo / "snapshots" / commit
    check(snapshot.is_dir() and (snapshot / "config.json").is_file(), "model",
          f"{repo_id!r} (revision {revision}) is neither a folder nor in the local Hugging Face cache "
          f"({cache}); nothing is downloaded here: fetch it first (`huggingface-cli download {repo_id}"
          f"{'' if revision == 'main' else ' --revision ' + revision}`) or give the model's folder",
          code=MODEL_UNAVAILABLE)
    return snapshot
