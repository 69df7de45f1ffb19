#!/usr/bin/env bash
# The agent's checks against real NVML, for a GPU host (see check_gpu.py for what they
# are). Outside one it skips with one line and exits 0. Run from anywhere:
#   tests/gpu/run.sh            (PYTHON=path/to/python to choose the interpreter)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "tests/gpu/run.sh: skipped: no NVIDIA GPU here (nvidia-smi does not answer)"
  exit 0
fi
if ! "$PY" -c "import pynvml; pynvml.nvmlInit()" >/dev/null 2>&1; then
  echo "tests/gpu/run.sh: skipped: NVML not usable from $PY (pip install nvidia-ml-py)"
  exit 0
fi
exec timeout 300 "$PY" tests/gpu/check_gpu.py "$@"
