#!/usr/bin/env bash
# The packages of transformers' server (`transformers serve`, transformers[serving]) that the
# GPU machine's image lacks, as wheels for its Python 3.12, for tests/cuda/test_cuda_hf_server.py:
#
#   bash scripts/serving_wheels.sh [OUT_DIR]     # default .whl/serving (git-ignored), about 6 MiB
#
# The versions are the ones the test extra installs here (transformers[serving]==5.17.0's
# fastapi, uvicorn, openai, pydantic, starlette), with their dependencies, less those the
# image already has (typer's click, h11, idna, annotated-doc: not shadowed). Carry .whl and
# scripts/gpu_check.sh installs them into /tmp/serving-site first, on PYTHONPATH (the servers
# the test starts inherit it).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.whl/serving}
mkdir -p "$out"
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$out" fastapi==0.165.0 uvicorn==0.55.0 openai==3.63.0 pydantic==2.14.4 starlette==1.10.0
rm -f "$out"/click-*.whl "$out"/h11-*.whl "$out"/idna-*.whl "$out"/annotated_doc-*.whl
ls "$out"
du -sh "$out"
