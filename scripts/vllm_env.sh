#!/usr/bin/env bash
# The vLLM test environment: a virtual environment of its own, because vllm 0.33.0 pins
# torch 2.14.0 (9.4 GB, about 5 minutes to install) and the main suite runs on another torch.
#
#   bash scripts/vllm_env.sh                      # build it (once), then run tests/vllm_plugin
#   bash scripts/vllm_env.sh CMD ARGS...          # build it (once), then run CMD inside it
#
# Where: $GRAPHFLOW_VLLM_VENV, else .vllm-venv/ in the checkout (git-ignored). A finished
# build leaves a stamp naming what it installed; a second call with the same stamp reuses
# the environment and only reinstalls graphflow (editable, seconds).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${GRAPHFLOW_VLLM_VENV:-$root/.vllm-venv}"
vllm_req="vllm==0.33.0"
stamp="$venv/.graphflow-vllm-stamp"
want="$vllm_req python=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')"

if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
    echo "+ building the vLLM environment in $venv ($vllm_req)"
    start=$(date +%s)
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    # vllm pins its own torch; graphflow's extras only ask for torch>=2.4, so installing
    # graphflow afterwards keeps vllm's torch.
    "$venv/bin/python" -m pip install -q "$vllm_req"
    echo "$want" > "$stamp"
    echo "+ vLLM environment built in $(( $(date +%s) - start )) s"
fi
"$venv/bin/python" -m pip install -q -e "$root[test]"

cd "$root"
if [[ $# -eq 0 ]]; then
    set -- python -m pytest -q -p no:cacheprovider tests/vllm_plugin
fi
echo "+ $* (in $venv)"
PATH="$venv/bin:$PATH" VIRTUAL_ENV="$venv" exec "$@"
