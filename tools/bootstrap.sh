#!/usr/bin/env bash
# Creates (or reuses) the project venv at .venv, installs the package with its test extras and
# prepares the default model. Sourced by tools/test and tools/serve; safe to run again.
# The first run downloads about 3 GB (a 2.6 GB venv, a 0.6 GB model cache) and takes 4-5 minutes;
# later runs take seconds.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${TRITONLLM_VENV:-$root/.venv}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null 2>&1 || python=python3
stamp="$venv/.tritonllm-installed"
bootstrap_started=$SECONDS
bootstrap_step() { echo "[bootstrap $((SECONDS - bootstrap_started))s] $*" >&2; }
if [ ! -x "$venv/bin/python" ]; then
  bootstrap_step "creating the venv at $venv"
  "$python" -m venv "$venv"
fi
# Reinstall when pyproject.toml changed since the last install.
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  bootstrap_step "first run: installing into $venv (about 2.6 GB, 2-4 minutes; nothing is installed outside it)"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip >&2
  bootstrap_step "installing torch 2.13 (the largest part, 1-2 minutes)"
  # torch first, pinned: an unpinned resolve may pull a multi-GB CUDA build.
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "torch==2.13.0" >&2
  bootstrap_step "installing tritonllm with transformers, the tritonserver wheel (nvidia-pytriton), the OpenAI" \
       "frontend and the test tools (about a minute)"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e "$root[test]" >&2
  touch "$stamp"
  bootstrap_step "venv ready ($(du -sh "$venv" 2>/dev/null | cut -f1))"
fi
export PATH="$venv/bin:$PATH"  # Triton's Python stub runs the first python3 on PATH
export VIRTUAL_ENV="$venv"
bootstrap_step "the default models, in ~/.cache/tritonllm (fetched on the first run only: about 0.6 GB, under a minute)"
"$venv/bin/python" -m tools.prepare_model >&2
"$venv/bin/python" -m tools.prepare_embeddings >&2
bootstrap_step "ready"
