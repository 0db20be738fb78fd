"""A trace file that cannot be written, under vLLM's real capture: every graph stands.

The plugin writes graphflow's trace (``GRAPHFLOW_TRACE=DIR``) through the same
``Tracer`` as graphflow's own runs: a full disk under it warns once and marks the
trace incomplete; it never rolls back a capture that succeeded, on V1 or V2.
"""

import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")


from graphflow.integrations.vllm import plugin as module  # noqa: E402
from graphflow.integrations.vllm.logs import LOGGER  # noqa: E402
from graphflow.dist.trace import INCOMPLETE, Tracer, TraceWriteWarning, read_trace  # noqa: E402
from tests.disk_full import Failing  # noqa: E402

FULL_DISK = "/dev/full"
HERE = os.path.dirname(os.path.abspath(__file__))


def ends_incomplete(path) -> bool:
    """Whether the trace at ``path`` ends with its ``trace_incomplete`` record, every event before it whole."""
    events = read_trace(path)
    record = events[-1]
    return (record["event"] == INCOMPLETE and record["lost"] > 0 and "No space left on device" in record["error"]
            and [e["n"] for e in events[:-1]] == list(range(len(events) - 1)))


def test_v1_a_trace_that_fills_the_disk_keeps_every_graph_and_says_it_is_incomplete(
        runner, plugin, cpu_cuda, tmp_path, monkeypatch, plugin_log):
    from vllm.compilation import monitor

    real = Tracer._open
    monkeypatch.setattr(Tracer, "_open", lambda self: Failing(real(self), after=3))
    monkeypatch.setenv("GRAPHFLOW_TRACE", str(tmp_path))
    plugin()
    with plugin_log.at_level("INFO", logger=LOGGER), \
            pytest.warns(TraceWriteWarning, match=r"rank0\.jsonl.*No space left on device"):
        runner.capture_model()
    module.unregister()  # closes the trace
    assert monitor.cudagraph_capturing_enabled is False
    assert sum(len(k) for k in runner.cudagraph_dispatcher.cudagraph_keys.values()) == 7
    assert sum(len(w.concrete_cudagraph_entries) for w in (runner.full, runner.piecewise)) == 7
    messages = [r.getMessage() for r in plugin_log.records if r.name == LOGGER]
    assert any("captured 7 graphs on rank 0" in m and "incomplete" in m and "events lost" in m for m in messages)
    assert ends_incomplete(tmp_path / "rank0.jsonl")
    captures = cpu_cuda.captures
    mode, desc, _ = runner.serve(2)
    assert mode.name == "FULL" and cpu_cuda.captures == captures  # replayed, not captured


@pytest.mark.skipif(not os.path.exists(FULL_DISK), reason="needs Linux's /dev/full")
def test_v2_a_trace_on_a_full_disk_keeps_every_graph(runner_v2, plugin, tmp_path, monkeypatch):
    (tmp_path / "rank0.jsonl").symlink_to(FULL_DISK)
    monkeypatch.setenv("GRAPHFLOW_TRACE", str(tmp_path))
    plugin()
    with pytest.warns(TraceWriteWarning, match="No space left on device"):
        runner_v2.capture_model()
    tracer = module.registered()._log.sink
    module.unregister()
    assert tracer.incomplete and tracer.lost > 0
    manager = runner_v2.cudagraph_manager
    assert len(manager.graphs) == 3 and manager._graphs_captured
    assert manager.dispatch(2, 2, 1, 0).cg_mode.name == "FULL"


def test_vllms_worker_shutdown_closes_the_trace(vllm_world, runner, plugin, tmp_path, monkeypatch):
    """Under vLLM nothing unregisters the plugin: the worker's shutdown (vLLM's ``Worker``,
    shut down by its executor when the engine ends) closes the trace, which so gets its
    ``trace_incomplete`` record, and the plugin stays on for another capture."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.gpu_worker import Worker

    real = Tracer._open
    monkeypatch.setattr(Tracer, "_open", lambda self: Failing(real(self), after=3))
    monkeypatch.setenv("GRAPHFLOW_TRACE", str(tmp_path))
    plugin()
    with pytest.warns(TraceWriteWarning):
        runner.capture_model()
    assert INCOMPLETE not in (tmp_path / "rank0.jsonl").read_text()
    with set_current_vllm_config(runner.vllm_config):
        worker = Worker(runner.vllm_config, local_rank=0, rank=0, distributed_init_method="tcp://127.0.0.1:1",
                        is_driver_worker=True)
    worker.shutdown()
    assert ends_incomplete(tmp_path / "rank0.jsonl") and module.registered() is not None


def test_a_process_that_ends_closes_the_trace(tmp_path):
    """A process that captured and ends without vLLM shutting a worker down (a script, an
    engine stopped by its interpreter's exit) closes the trace at exit."""
    from tests.vllm_plugin.ranks import free_port

    done = subprocess.run([sys.executable, os.path.join(HERE, "full_disk_worker.py"), str(tmp_path), str(free_port())],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "TraceWriteWarning" in done.stderr, done.stderr[-3000:]
    assert ends_incomplete(tmp_path / "rank0.jsonl")
