#!/usr/bin/env bash
# GPU checks of the CUDA paths (under 8 minutes on one GPU): AMP kill/resume equivalence (fp16 +
# GradScaler, bf16), CUDA RNG restore, a CPU checkpoint resumed on CUDA and back, --amp auto and its bf16 -> fp16
# switch, pinned-memory snapshot blocked time, throughput vs the guide loop.
#   bash scripts/gpu_check.sh DATA_DIR     (DATA_DIR holds MNIST/raw/, e.g. ../shared/data/mnist-mini)
# Without a CUDA GPU it says so and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
if ! "$PY" -c "import torch, resumable" 2>/dev/null; then
    echo "gpu_check: $PY cannot import torch and resumable; install first (README) or set PYTHON=" >&2
    exit 2
fi
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA GPU visible; skipping the GPU checks"
    exit 0
fi
DATA=${1:?usage: bash scripts/gpu_check.sh DATA_DIR}
export PYTHONUNBUFFERED=1
"$PY" -c "import torch; print('gpu_check:', torch.cuda.get_device_name(0), 'torch', torch.__version__)"
"$PY" scripts/gpu_check.py "$DATA"
"$PY" scripts/bench_checkpoint.py --sizes 200,1000 --repeats 5 --cuda
"$PY" scripts/bench_throughput.py "$DATA" --epochs 3 --repeats 3 --device cuda
