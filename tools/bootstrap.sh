#!/usr/bin/env bash
# Creates (or reuses) the project venv at .venv, installs the package with its test extras and
# prepares the default model. Sourced by tools/test and tools/serve; safe to run again.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${TRITONLLM_VENV:-$root/.venv}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null 2>&1 || python=python3
stamp="$venv/.tritonllm-installed"
if [ ! -x "$venv/bin/python" ]; then
  echo "creating venv at $venv" >&2
  "$python" -m venv "$venv"
fi
# Reinstall when pyproject.toml changed since the last install.
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip >&2
  # torch first, pinned: an unpinned resolve may pull a multi-GB CUDA build.
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "torch==2.13.0" >&2
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e "$root[test]" >&2
  touch "$stamp"
fi
export PATH="$venv/bin:$PATH"  # Triton's Python stub runs the first python3 on PATH
export VIRTUAL_ENV="$venv"
"$venv/bin/python" -m tools.prepare_model >&2
"$venv/bin/python" -m tools.prepare_embeddings >&2
