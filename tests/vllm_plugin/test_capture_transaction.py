"""Capture as a transaction, against vLLM's real V1 ``capture_model``, dispatcher and wrappers.

The stand-in runner's capture fails inside the graph capture of one descriptor, as a CUDA
error would (``harness.StandInRunner``). vLLM alone leaves the capturing flag on, graph
entries and every dispatch key behind, and then captures while serving; with the plugin
nothing is left and serving runs eagerly.
"""

import gc

import pytest

pytest.importorskip("vllm")

import harness  # noqa: E402

from graphflow.errors import CaptureError  # noqa: E402
from graphflow.integrations.vllm.logs import LOGGER  # noqa: E402

# max_num_seqs=4, 64 batched tokens: PIECEWISE 8, 4, 2, 1 then FULL decode 4, 2, 1.
ORDER = [("PIECEWISE", 8), ("PIECEWISE", 4), ("PIECEWISE", 2), ("PIECEWISE", 1),
         ("FULL", 4), ("FULL", 2), ("FULL", 1)]


def state(runner):
    """What a capture leaves behind that serving would use."""
    from vllm.compilation import monitor
    from vllm.compilation.cuda_graph import CUDAGraphWrapper

    return {
        "flag": monitor.cudagraph_capturing_enabled,
        "entries": sum(len(w.concrete_cudagraph_entries) for w in (runner.full, runner.piecewise)),
        "keys": sum(len(k) for k in runner.cudagraph_dispatcher.cudagraph_keys.values()),
        "wrappers_with_entries": sum(1 for w in CUDAGraphWrapper._all_instances if w.concrete_cudagraph_entries),
        "gc": (gc.isenabled(), gc.get_freeze_count()),
    }


def test_the_stand_in_runner_captures_what_the_dispatcher_lists(runner):
    descs = [(m.name, d.num_tokens) for m, ds in runner.cudagraph_dispatcher.get_capture_descs() for d in ds]
    assert descs == ORDER


def test_vllm_alone_leaves_flag_entries_and_keys_and_captures_while_serving(runner, cpu_cuda):
    runner.fail_at = ("FULL", 2)
    with pytest.raises(RuntimeError, match="stand-in capture failure"):
        runner.capture_model()
    left = state(runner)
    assert left["flag"] is True and left["keys"] == 7 and left["entries"] == 6  # 4 PIECEWISE + FULL 4, 2
    runner.tiny.fail = None
    captures = cpu_cuda.captures
    mode, desc, _ = runner.serve(2)
    assert (mode.name, desc.num_tokens) == ("FULL", 2)
    assert cpu_cuda.captures == captures + 1  # the key without a graph: captured while serving


@pytest.mark.parametrize("fail_at", [ORDER[0], ORDER[4], ORDER[-1]], ids=["first", "middle", "last"])
def test_a_failure_at_any_descriptor_rolls_everything_back(runner, plugin, cpu_cuda, fail_at):
    from vllm.compilation.counter import compilation_counter

    plugin()
    before = compilation_counter.num_cudagraph_captured
    runner.fail_at = fail_at
    with pytest.raises(CaptureError) as info:
        runner.capture_model()
    error = info.value
    assert error.phase == "capture" and error.rank == 0
    assert f"{fail_at[0]}(tokens={fail_at[1]}" in str(error.descriptor)
    assert f"target {fail_at[0]}(tokens={fail_at[1]}" in error.message
    assert isinstance(error.__cause__, RuntimeError)
    assert state(runner) == {"flag": False, "entries": 0, "keys": 0, "wrappers_with_entries": 0, "gc": (True, 0)}
    assert runner.cudagraph_dispatcher.keys_initialized is False
    assert compilation_counter.num_cudagraph_captured == before
    runner.tiny.fail = None
    captures = cpu_cuda.captures
    for tokens in (1, 2, 3, 4, 8):
        mode, desc, out = runner.serve(tokens)
        assert mode.name == "NONE" and desc.num_tokens == tokens and out.shape == (tokens, harness.HIDDEN)
    assert cpu_cuda.captures == captures


def test_with_on_failure_eager_capture_returns_and_serving_is_eager(runner, plugin, plugin_log):
    plugin(on_failure="eager")
    runner.fail_at = ORDER[2]
    with plugin_log.at_level("ERROR", logger=LOGGER):
        assert runner.capture_model() == 0
    (line,) = [r.getMessage() for r in plugin_log.records if r.name == LOGGER and r.levelname == "ERROR"]
    assert "target PIECEWISE(tokens=2)" in line and "serving without CUDA graphs" in line and "rank 0" in line
    assert state(runner)["keys"] == 0 and state(runner)["entries"] == 0
    runner.tiny.fail = None
    assert runner.serve(4)[0].name == "NONE"


def test_a_capture_that_succeeds_is_committed_and_logged(runner, plugin, cpu_cuda, plugin_log):
    plugin()
    with plugin_log.at_level("INFO", logger=LOGGER):
        runner.capture_model()
    left = state(runner)
    assert left["flag"] is False and left["keys"] == 7 and left["entries"] == 7
    assert [(m, d.num_tokens) for m, d in runner.runs if m != "NONE"] == ORDER
    messages = [r.getMessage() for r in plugin_log.records if r.name == LOGGER]
    assert any("captured 7 graphs on rank 0" in m and "target PIECEWISE=4 (largest 8), target FULL=3 (largest 4)"
               in m for m in messages)
    captures = cpu_cuda.captures
    mode, desc, _ = runner.serve(2)
    assert mode.name == "FULL" and cpu_cuda.captures == captures  # replayed, not captured


def test_a_keyboard_interrupt_rolls_back_and_stays_an_interrupt(runner, plugin):
    plugin()
    runner.fail_at = ORDER[1]
    original = runner.tiny.forward

    def interrupted(x):  # Ctrl-C during a long capture: it arrives inside the graph capture
        if runner.tiny.fail is not None:
            raise KeyboardInterrupt
        return original(x)

    runner.tiny.forward = interrupted
    with pytest.raises(KeyboardInterrupt):
        runner.capture_model()
    assert state(runner)["keys"] == 0 and state(runner)["flag"] is False


def test_v2_alone_keeps_the_graphs_captured_before_a_failure(runner_v2):
    runner_v2.fail_at = ("FULL", 2)
    with pytest.raises(RuntimeError, match="stand-in capture failure"):
        runner_v2.capture_model()
    assert len(runner_v2.cudagraph_manager.graphs) == 1 and runner_v2.piecewise.concrete_cudagraph_entries


@pytest.mark.parametrize("fail_at", [ORDER[0], ORDER[4], ORDER[-1]], ids=["first", "middle", "last"])
def test_v2_a_failure_at_any_descriptor_rolls_everything_back(runner_v2, plugin, fail_at):
    from vllm.compilation import monitor
    from vllm.compilation.counter import compilation_counter

    plugin()
    before = (compilation_counter.num_cudagraph_captured, compilation_counter.num_gpu_runner_capture_triggers)
    runner_v2.fail_at = fail_at
    with pytest.raises(CaptureError) as info:
        runner_v2.capture_model()
    assert f"target {fail_at[0]}(tokens={fail_at[1]}" in info.value.message and info.value.rank == 0
    manager = runner_v2.cudagraph_manager
    assert manager.graphs == {} and manager._graphs_captured is False
    assert not runner_v2.piecewise.concrete_cudagraph_entries and monitor.cudagraph_capturing_enabled is True
    assert (gc.isenabled(), gc.get_freeze_count()) == (True, 0)
    assert (compilation_counter.num_cudagraph_captured, compilation_counter.num_gpu_runner_capture_triggers) == before
    for tokens in (1, 2, 4, 8):
        assert manager.dispatch(tokens, tokens, 1, 0).cg_mode.name == "NONE"


def test_v2_a_capture_that_succeeds_keeps_its_graphs_and_traces_both_phases(runner_v2, plugin, tmp_path,
                                                                          monkeypatch):
    from graphflow.integrations.vllm import plugin as module
    from graphflow.dist.trace import read_trace

    monkeypatch.setenv("GRAPHFLOW_TRACE", str(tmp_path))
    plugin()
    runner_v2.capture_model()
    module.unregister()  # closes the trace
    manager = runner_v2.cudagraph_manager
    assert len(manager.graphs) == 3 and manager._graphs_captured
    assert manager.dispatch(2, 2, 1, 0).cg_mode.name == "FULL"
    events = read_trace(tmp_path / "rank0.jsonl")
    phases = [(e["event"], e["phase"], e["descriptor"]) for e in events if e["event"].startswith("phase")]
    assert phases[:3] == [("phase_begin", "capture_model", None),
                          ("phase_begin", "warmup", "target PIECEWISE(tokens=8)"),
                          ("phase_end", "warmup", "target PIECEWISE(tokens=8)")]
    assert ("phase_end", "capture", "target FULL(tokens=1, reqs=1, q=1)") in phases
