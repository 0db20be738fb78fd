"""A process that captures with the plugin, its trace on a disk that fills up, and ends
without unregistering it or shutting a vLLM worker down (test_vllm_trace_failures.py).

Usage: python full_disk_worker.py TRACE_DIR. Loads the plugin through vLLM's loader with
``GRAPHFLOW_TRACE=TRACE_DIR``, runs the stand-in runner's real V1 ``capture_model`` with the
trace failing from its third write on, then returns: what closes the trace is the
plugin's own exit handler, or nothing.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import standins  # noqa: E402

standins.setup()

import harness  # noqa: E402


def main() -> None:
    from vllm.config import set_current_vllm_config
    from vllm.plugins import load_general_plugins

    from graphflow.dist.trace import Tracer
    from tests.disk_full import Failing

    os.environ.update(GRAPHFLOW_VLLM="1", GRAPHFLOW_TRACE=sys.argv[1], VLLM_PLUGINS="graphflow")
    real = Tracer._open
    Tracer._open = lambda self: Failing(real(self), after=3)
    load_general_plugins()
    config = harness.engine_config(max_num_seqs=4, max_num_batched_tokens=64)
    harness.init_distributed(config, port=int(sys.argv[2]))
    with standins.CpuCuda().installed(), set_current_vllm_config(config):
        harness.standin_runner_cls()(config, model=harness.TinyMoE()).capture_model()


if __name__ == "__main__":
    main()
