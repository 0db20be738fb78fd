#!/usr/bin/env bash
# Every GPU test and benchmark, on the device machine (carry .whl for CuTe DSL and, from
# scripts/serving_wheels.sh, transformers' server packages):
#   bash scripts/gpu_check.sh            # the CUDA tests, then every benchmark
#   bash scripts/gpu_check.sh tests      # the CUDA tests only
#   bash scripts/gpu_check.sh benches    # the benchmarks only (scripts/gpu_benches.txt)
#   bash scripts/gpu_check.sh benches "bench/x.py --a 1" ...   # only these benchmark lines
#   GPU_TESTS="tests/cuda/test_cuda_hf.py" bash scripts/gpu_check.sh tests   # only these test files
# Each benchmark stops after BENCH_TIMEOUT_S seconds (default 540), so one that hangs
# cannot take the others' time.
# Results land under $OUT (or ./out here): pytest logs, benchmark tables and JSON.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}
mkdir -p "$OUT"
stage=${1:-all}
shift $(( $# > 0 ? 1 : 0 ))
status=0
# CuTe DSL is not on the GPU machine's image: unpack the archive ../shared/tools/cute_bundle.sh built.
if [ -f .whl/cute-cu13-cp312.tar.xz ]; then
  mkdir -p /tmp/site && tar -xJf .whl/cute-cu13-cp312.tar.xz -C /tmp/site &&
    export PYTHONPATH=$PYTHONPATH:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
fi
# transformers' server packages, missing on the GPU image (scripts/serving_wheels.sh): for the server test.
if compgen -G '.whl/serving/*.whl' > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/serving-site \
    .whl/serving/*.whl && export PYTHONPATH=/tmp/serving-site:$PYTHONPATH
fi
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")'
if [ "$stage" != benches ]; then
  python3 -m pytest -m cuda -q -rs -p no:cacheprovider --durations=15 ${GPU_TESTS:-tests} 2>&1 |
    tee "$OUT/cuda_tests.log" || status=1
fi
if [ "$stage" != tests ]; then
  # Each line: a benchmark script and its arguments (--out is added).
  if [ $# -gt 0 ]; then benches=$(printf '%s\n' "$@"); else benches=$(cat scripts/gpu_benches.txt); fi
  while read -r bench; do
    [ -z "$bench" ] && continue
    echo "== $bench"
    # eval: a line's quotes work as in a shell (--compile-sizes "" passes an empty value).
    eval "timeout \"\${BENCH_TIMEOUT_S:-540}\" python3 $bench --out \"\$OUT\"" 2>&1 | tee -a "$OUT/bench.log" || status=1
  done <<< "$benches"
fi
exit $status
