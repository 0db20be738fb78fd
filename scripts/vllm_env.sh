#!/usr/bin/env bash
# The vLLM test environment: a virtual environment of its own, because vllm 0.33.0 pins
# torch 2.14.0 (9.4 GB, about 5 minutes to install) and the main suite runs on another torch.
#
#   bash scripts/vllm_env.sh                      # build it (once), then run tests/vllm_plugin
#   bash scripts/vllm_env.sh CMD ARGS...          # build it (once), then run CMD inside it
#
# It holds what a user gets from `pip install 'graphflow[vllm]'` (vLLM and whatever vLLM
# resolves to: its torch, its transformers), resolved in one install as a user's is, plus
# only the test runner's own packages: not the main suite's `[test]` extra, whose pins
# (transformers among them) would test another stack than the one users run.
#
# Where: $GRAPHFLOW_VLLM_VENV, else .vllm-venv/ in the checkout (git-ignored). A finished
# build leaves a stamp naming what it installed; a second call with the same stamp reuses
# the environment and only reinstalls graphflow (editable, seconds).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${GRAPHFLOW_VLLM_VENV:-$root/.vllm-venv}"
# The tests' own tools: pytest, and hypothesis for tests/conftest.py's profiles.
test_tools=("pytest>=7.4" "hypothesis>=6.90")
install=(-e "$root[vllm]" "${test_tools[@]}")
stamp="$venv/.graphflow-vllm-stamp"
want="graphflow[vllm] ${test_tools[*]} $(grep -o 'vllm==[^"]*' "$root/pyproject.toml") python=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')"

if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
    echo "+ building the vLLM environment in $venv ($want)"
    start=$(date +%s)
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q "${install[@]}"
    echo "$want" > "$stamp"
    echo "+ vLLM environment built in $(( $(date +%s) - start )) s"
fi
"$venv/bin/python" -m pip install -q "${install[@]}"
"$venv/bin/python" -c 'import importlib.metadata as m; print("+ vllm", m.version("vllm"), "torch", m.version("torch"), "transformers", m.version("transformers"))'

cd "$root"
if [[ $# -eq 0 ]]; then
    set -- python -m pytest -q -p no:cacheprovider tests/vllm_plugin
fi
echo "+ $* (in $venv)"
PATH="$venv/bin:$PATH" VIRTUAL_ENV="$venv" exec "$@"
