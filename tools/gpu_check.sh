#!/usr/bin/env bash
# GPU check (one GPU, under 10 minutes): the engine server's CUDA tests (two colocated receivers
# of one push: every IPC buffer freed), then tools/gpu_check.py (megatron actor + engine
# colocated: train, offload, CUDA IPC weight sync, torch_dist checkpoint), then
# tools/gpu_memory_check.py (a Qwen3-1.7B-shaped actor rank's peak against the memory plan at
# 2k/4k/8k tokens, recompute off and on).
#
#   bash tools/gpu_check.sh [gpu_check.py options]
#
# On a machine without package access, put the missing wheels (megatron-core, fastapi, uvicorn, uvloop, httptools,
# pydantic, ...) in .whl/ first; they are installed into a private target directory.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -d .whl ] && ! "$PY" -c "import megatron.core, fastapi, uvicorn, uvloop, httptools" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/rlhpc-site .whl/*.whl
  export PYTHONPATH=/tmp/rlhpc-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import torch, megatron.core as m; print('torch', torch.__version__, 'megatron-core', m.__version__)"
"$PY" -c "import sglang" 2>/dev/null && echo "sglang installed: not driven by this check yet" || echo "sglang not installed"
RLHPC_SKIP_SLURM=1 "$PY" -m pytest -q -p no:cacheprovider tests/integration/test_engine_cuda.py
"$PY" tools/gpu_check.py "$@"
"$PY" tools/gpu_memory_check.py
