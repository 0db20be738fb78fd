"""One rank of the three-rank test (test_divergence.py): vLLM's TP group over gloo, the
plugin loaded through vLLM's entry-point machinery, the stand-in runner's real V1 capture.

Usage: python rank_worker.py RANK WORLD PORT OUT_JSON SCENARIO... where a scenario is
``model:policy:trace_dir``. Runs them in order in one process (vLLM initializes its
distributed state once per process) and writes what each ended in to OUT_JSON.
"""

import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import standins  # noqa: E402

standins.setup()

import harness  # noqa: E402


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    scenarios = [s.split(":", 2) for s in sys.argv[5:]]
    from vllm.config import set_current_vllm_config
    from vllm.plugins import load_general_plugins

    from graphflow.errors import CaptureError, DivergenceError
    from graphflow.integrations.vllm import plugin

    results = []
    for index, (model, policy, trace) in enumerate(scenarios):
        os.environ.update(GRAPHFLOW_VLLM="1", GRAPHFLOW_VLLM_WARMUP=policy, GRAPHFLOW_TRACE=trace,
                          GRAPHFLOW_VLLM_PREPARE="standins:prepare_hook" if policy == "prepare" else "")
        standins.PREPARED.clear()
        if index == 0:
            load_general_plugins()  # vLLM's own loader (its engine and workers call it): vllm.general_plugins
        else:
            plugin.unregister()
            plugin.register()
        result = {"model": model, "policy": policy, "loaded": plugin.registered() is not None}
        config = harness.engine_config(model, max_num_seqs=4, max_num_batched_tokens=64, tensor_parallel_size=world,
                                       distributed_executor_backend="mp")
        if index == 0:
            harness.init_distributed(config, rank=rank, world=world, port=port, tp=world)
        freed = standins.FreedBlocks()
        start = time.monotonic()
        with standins.CpuCuda().installed(), freed.installed(), set_current_vllm_config(config):
            runner = harness.standin_runner_cls()(config, model=harness.TinyMoE(rank=rank, world=world, freed=freed))
            try:
                runner.capture_model()
                result["outcome"] = "captured"
            except DivergenceError as e:
                result.update(outcome="diverged", message=str(e), ranks=list(e.ranks), event=e.event,
                              phase=e.phase, descriptor=str(e.descriptor))
            except CaptureError as e:
                result.update(outcome="refused" if e.phase == "validate" else "failed", message=str(e),
                              phase=e.phase)
            except Exception as e:  # noqa: BLE001 - reported to the test, which fails on it
                result.update(outcome="error", message="".join(traceback.format_exception(e)))
        result["seconds"] = time.monotonic() - start
        result["routes"] = runner.tiny.routes[:4]
        result["prepared"] = list(standins.PREPARED)
        results.append(result)
    with open(out, "w") as f:
        json.dump(results, f, default=str)


if __name__ == "__main__":
    main()
