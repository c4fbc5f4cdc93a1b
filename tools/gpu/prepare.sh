#!/usr/bin/env bash
# On a lent GPU machine (no network): install the carried wheels (pydantic and the
# few light packages the image lacks) into the image's python, then print the setup.
# Usage: bash tools/gpu/prepare.sh WHEEL_DIR
set -euo pipefail
wheels="${1:-gpu_wheels}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install --quiet --no-index --find-links "$wheels" --no-deps "$wheels"/*.whl
python3 - <<'PY'
import torch
print({"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": torch.cuda.device_count(),
       "name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None})
PY
