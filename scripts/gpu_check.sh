#!/usr/bin/env bash
# Every GPU test and benchmark, in one call on the device machine:
#   device run: bash scripts/gpu_check.sh [quick]
# Results land under $OUT (or ./out here): pytest logs, benchmark tables and JSON.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}
mkdir -p "$OUT"
status=0
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")'
python3 -m pytest -m cuda -q -rs -p no:cacheprovider tests 2>&1 | tee "$OUT/cuda_tests.log" || status=1
[ "${1:-}" = quick ] && exit $status
for bench in $(cat scripts/gpu_benches.txt 2>/dev/null); do
  echo "== $bench"
  python3 $bench --out "$OUT" 2>&1 | tee -a "$OUT/bench.log" || status=1
done
exit $status
