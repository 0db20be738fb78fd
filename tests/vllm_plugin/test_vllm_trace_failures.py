"""A trace file that cannot be written, under vLLM's real capture: every graph stands.

The plugin writes graphflow's trace (``GRAPHFLOW_TRACE=DIR``) through the same
``Tracer`` as graphflow's own runs: a full disk under it warns once and marks the
trace incomplete; it never rolls back a capture that succeeded, on V1 or V2.
"""

import os

import pytest

pytest.importorskip("vllm")


from graphflow.integrations.vllm import plugin as module  # noqa: E402
from graphflow.integrations.vllm.logs import LOGGER  # noqa: E402
from graphflow.dist.trace import INCOMPLETE, Tracer, TraceWriteWarning, read_trace  # noqa: E402
from tests.disk_full import Failing  # noqa: E402

FULL_DISK = "/dev/full"


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
    events = read_trace(tmp_path / "rank0.jsonl")
    record = events[-1]
    assert record["event"] == INCOMPLETE and record["lost"] > 0 and "No space left on device" in record["error"]
    assert [e["n"] for e in events[:-1]] == list(range(len(events) - 1))
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
