#!/usr/bin/env bash
# Installs NVIDIA's aiperf (the second-opinion client of `tritonllm bench --client aiperf`) into a
# venv of its own: its heavy dependencies (and their numpy) must stay out of the project's .venv.
# Prints the path of its `aiperf` executable, for `tritonllm bench --aiperf`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${AIPERF_VENV:-$root/.venv-aiperf}"
version="${AIPERF_VERSION:-0.13.0}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null 2>&1 || python=python3
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
if ! "$venv/bin/aiperf" --version >/dev/null 2>&1; then
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip >&2
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "aiperf==$version" >&2
fi
"$venv/bin/aiperf" profile --help >/dev/null  # the CLI loads (no model hub needed: the machine has none)
"$venv/bin/python" -c "import importlib.metadata as m; print('aiperf', m.version('aiperf'))" >&2
echo "$venv/bin/aiperf"
