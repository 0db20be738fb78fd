"""One rank of the data-parallel test (test_data_parallel.py): two engines of two TP ranks in
one vLLM world over gloo, as vLLM builds it for a MoE model with ``data_parallel_size=2``.

Usage: python dp_worker.py RANK PORT OUT_JSON CAPTURE... where a capture is a
``;``-separated list of ``NAME=VALUE`` plugin settings (``-`` for none beyond the switch).
Runs vLLM's real V1 capture (the stand-in runner) once per CAPTURE, in order, in this
process, re-registering the plugin with that capture's settings, and writes what each
ended in, with the session's namespace and members, to OUT_JSON. Every rank then waits
for the others (rank 0's process holds the c10d store the barriers use).
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

ENGINE_SIZE = 2  # TP=2, PP=1


def main() -> None:
    rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    captures = [[] if spec == "-" else [item.split("=", 1) for item in spec.split(";")] for spec in sys.argv[4:]]
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    from graphflow.errors import CaptureError, DivergenceError
    from graphflow.integrations.vllm import plugin

    dp_rank, local = divmod(rank, ENGINE_SIZE)
    config = harness.engine_config("moe-tiny", max_num_seqs=4, max_num_batched_tokens=64,
                                   tensor_parallel_size=ENGINE_SIZE, data_parallel_size=2, data_parallel_rank=dp_rank,
                                   distributed_executor_backend="mp")
    config.parallel_config.data_parallel_master_port = port
    config.parallel_config._data_parallel_master_port_list = []
    with set_current_vllm_config(config):
        # vLLM offsets the rank by the DP rank and joins every engine into one world
        ps.init_distributed_environment(world_size=ENGINE_SIZE, rank=local, distributed_init_method="tcp://unused:0",
                                        local_rank=local, backend="gloo")
        ps.initialize_model_parallel(tensor_model_parallel_size=ENGINE_SIZE)
    ps.get_tp_group().use_custom_op_call = False
    import torch.distributed as dist

    results = []
    for settings in captures:
        for name in [n for n in os.environ if n.startswith("GRAPHFLOW_VLLM_")]:
            del os.environ[name]
        os.environ.update({"GRAPHFLOW_VLLM": "1", "GRAPHFLOW_VLLM_WARMUP": "real", **dict(settings)})
        plugin.unregister()
        plugin.register()
        result = {"world": dist.get_world_size(), "tp": list(ps.get_tp_group().ranks),
                  "dp": list(ps.get_dp_group().ranks)}
        opened = []
        original_open = plugin.Plugin._open

        def spy(self, *args, **kwargs):
            session = original_open(self, *args, **kwargs)
            opened.append({"namespace": session.namespace, "members": list(session.world)})
            return session

        plugin.Plugin._open = spy
        start = time.monotonic()
        with standins.CpuCuda().installed(), set_current_vllm_config(config):
            runner = harness.standin_runner_cls()(config, model=harness.TinyMoE(rank=local, world=ENGINE_SIZE))
            try:
                runner.capture_model()
                result["outcome"] = "captured"
            except DivergenceError as e:
                result.update(outcome="diverged", message=str(e), ranks=list(e.ranks))
            except CaptureError as e:
                result.update(outcome="failed", message=str(e))
            except Exception as e:  # noqa: BLE001 - reported to the test, which fails on it
                result.update(outcome="error", message="".join(traceback.format_exception(e)))
            finally:
                plugin.Plugin._open = original_open
        result.update(seconds=time.monotonic() - start, sessions=opened)
        results.append(result)
    dist.barrier()  # rank 0 holds the store: it stays up until every engine is done
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
