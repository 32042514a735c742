#!/usr/bin/env bash
# One short GPU check (for a lent GPU machine): the fused kernels in bf16/fp16 against the fp32 reference,
# and the full cp_attention path with each kernel. Needs a CUDA build of torch; installs nothing else.
# Usage: bash launch/gpu_check.sh [python]   (default: python3)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
py="${1:-python3}"
"$py" - <<'PY'
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
      f"device {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
PY
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$py" -m pytest -q -rs tests/gpu
