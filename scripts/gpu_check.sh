#!/usr/bin/env bash
# The CUDA checks, as one prepared script for a lent GPU machine (see ../shared/device/README.md):
#   scripts/gpu_check.sh OUT_DIR
# 1. every test marked `cuda` (tests/test_cuda.py: placements, cold KV tiers, int8, recompute, pinned arena,
#    cold KV on the copy stream without a host sync; tests/test_speculative.py: bf16-exact verify on cuBLAS;
#    slot reuse, device->host slot writes), 2. the GPU benchmark (streamed from pinned RAM vs the PCIe bound).
# Everything lands in OUT_DIR (log, junit XML, benchmark JSON, spans). Budget: well under 8 minutes.
set -uo pipefail
out=${1:?usage: scripts/gpu_check.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
status=0
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print(torch.cuda.get_device_name())" \
  || { echo "gpu_check: CUDA is not available" >&2; exit 2; }
timeout 300 python3 -m pytest -q -m cuda tests/ --junitxml "$out/cuda-tests.xml" 2>&1 \
  | tee "$out/cuda-tests.log" || status=1
timeout 240 python3 scripts/gpu_bench.py --out "$out/bench" 2>&1 | tee "$out/gpu-bench.log" || status=1
exit $status
