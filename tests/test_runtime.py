"""The runner: descriptor choice, padding, output aliasing, eager fallback."""

from __future__ import annotations

import attrs
import pytest
import torch

from graphflow.engine import CudaBackend, RunOptions, run_pipeline
from graphflow.plan import Buffer, BufferRole, Descriptor, Mode
from graphflow.runtime import FallbackReason, Runner
from plans.toy_model import build_toy, toy_plan

P, F = Mode.PIECEWISE, Mode.FULL


@pytest.fixture(scope="module")
def piecewise():
    engine = run_pipeline(toy_plan(3, device="cuda:0"), RunOptions(backend="cpu", detectors=False))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def mixed():
    engine = run_pipeline(toy_plan(2, device="cuda:0", full=True, modes=(P, F), sizes=(2, 4)), RunOptions(backend="cpu", detectors=False, sizes=(2, 4)))
    yield engine
    engine.close()


def eager(layers, x, *, full=False, vocab=64):
    x = x.clone()
    logits = torch.empty(x.shape[0], vocab)
    build_toy(layers).step(x, logits, full=full)
    return logits


class TestDispatch:
    def test_smallest_descriptor_that_holds_the_batch(self, piecewise):
        runner = Runner(piecewise)
        assert [runner.descriptor_for(b) for b in (1, 2, 3, 5, 8, 9)] == [
            Descriptor(P, 1), Descriptor(P, 2), Descriptor(P, 4), Descriptor(P, 8), Descriptor(P, 8), None]
        assert runner.max_size == 8

    def test_full_is_preferred_where_captured(self, mixed):
        runner = Runner(mixed)
        assert runner.descriptor_for(1) == Descriptor(F, 2) and runner.descriptor_for(3) == Descriptor(F, 4)

    def test_inputs_and_outputs_are_named_in_plan_order(self, piecewise):
        runner = Runner(piecewise)
        assert (runner.inputs, runner.outputs) == (("x",), ("logits",))


def padded_eager(x, size):
    """The eager toy at the descriptor's size, its padded rows zero, sliced back."""
    return eager(3, torch.cat([x, torch.zeros(size - x.shape[0], x.shape[1])]))[:x.shape[0]]


class TestPrograms:
    """A batch's program is made at its first step and kept while the same descriptor
    serves it: a lazy engine's switch-in makes again only the batches it takes over."""

    def test_made_at_first_use_and_kept_across_a_switch_in_that_does_not_take_the_batch(self):
        engine = run_pipeline(toy_plan(3, device="cuda:0"), RunOptions(backend="cpu", detectors=False))
        try:
            captured = dict(engine.programs)
            engine.programs.clear()
            engine.programs[Descriptor(P, 8)] = captured[Descriptor(P, 8)]  # as a lazy engine starts out
            runner = Runner(engine)
            assert runner._programs == [None] * 9, "made before any step"
            for batch in (3, 7):
                x = torch.randn(batch, 32, generator=torch.Generator().manual_seed(batch))
                (logits,) = runner.run(x)
                assert torch.equal(logits, padded_eager(x, 8))
            made = {b: runner._programs[b] for b in (3, 7)}
            assert made[3].descriptor == made[7].descriptor == Descriptor(P, 8)
            engine.programs[Descriptor(P, 4)] = captured[Descriptor(P, 4)]  # switched in
            runner._build()  # what a lazy engine's next step does, seeing the engine's version change
            for batch, size in ((3, 4), (7, 8)):
                x = torch.randn(batch, 32, generator=torch.Generator().manual_seed(10 + batch))
                (logits,) = runner.run(x)
                assert torch.equal(logits, padded_eager(x, size))
            assert runner._programs[7] is made[7], "a batch the new descriptor does not serve was made again"
            assert runner._programs[3] is not made[3] and runner._programs[3].descriptor == Descriptor(P, 4)
            assert runner.descriptor_for(4) == Descriptor(P, 4) and runner.descriptor_for(5) == Descriptor(P, 8)
        finally:
            engine.close()


class TestRun:
    @pytest.mark.parametrize("batch", [1, 2, 4, 8])
    def test_exact_size_equals_the_eager_model(self, piecewise, batch):
        x = torch.randn(batch, 32, generator=torch.Generator().manual_seed(batch))
        (logits,) = Runner(piecewise).run(x)
        assert torch.equal(logits, eager(3, x))

    def test_full_step_equals_the_eager_model(self, mixed):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(7))
        (logits,) = Runner(mixed).run(x)
        assert torch.equal(logits, eager(2, x, full=True))

    def test_padded_rows_are_zeros_and_outputs_sliced(self, piecewise):
        runner = Runner(piecewise)
        runner.run(torch.full((4, 32), 5.0))  # leave garbage in the rows a padded batch will not fill
        x = torch.randn(3, 32, generator=torch.Generator().manual_seed(3))
        (logits,) = runner.run(x)
        assert logits.shape == (3, 64)
        padded = torch.cat([x, torch.zeros(1, 32)])
        assert torch.equal(logits, eager(3, padded)[:3])

    def test_outputs_are_views_of_static_buffers_overwritten_by_the_next_run(self, piecewise):
        runner = Runner(piecewise)
        (first,) = runner.run(torch.randn(2, 32))
        kept = first.clone()
        assert first.data_ptr() == piecewise.buffers.tensors["logits"].data_ptr()
        runner.run(torch.randn(2, 32))
        assert not torch.equal(first, kept)

    def test_empty_batch_is_an_error(self, piecewise):
        with pytest.raises(ValueError, match="a batch needs at least one row"):
            Runner(piecewise).run(torch.randn(0, 32))


class TestFallback:
    def test_batch_larger_than_every_descriptor_runs_eagerly_and_is_counted(self, piecewise):
        runner = Runner(piecewise)
        x = torch.randn(11, 32, generator=torch.Generator().manual_seed(11))
        (logits,) = runner.run(x)
        assert torch.equal(logits, eager(3, x))
        runner.run(torch.randn(9, 32))
        assert runner.fallbacks == {FallbackReason.BATCH_TOO_LARGE: 2}

    def test_state_buffer_too_small_refuses_the_fallback(self):
        plan = toy_plan(1, device="cuda:0", sizes=(1, 2))
        cache = Buffer("cache", ("B", 32), "float32", "cpu", role=BufferRole.STATE)
        with run_pipeline(attrs.evolve(plan, buffers=(*plan.buffers, cache)), RunOptions(backend="cpu", detectors=False)) as engine:
            with pytest.raises(ValueError, match="batch of 3 exceeds state buffer 'cache', allocated for 2"):
                Runner(engine).run(torch.randn(3, 32))

    def test_nothing_captured(self):
        with run_pipeline(toy_plan(1, device="cuda:0", sizes=(1,)), RunOptions(backend="cpu", detectors=False, sizes=())) as engine:
            runner = Runner(engine)
            runner.run(torch.randn(1, 32))
            assert runner.fallbacks == {FallbackReason.NOTHING_CAPTURED: 1}


def test_runner_needs_an_input_with_a_plain_batch_dimension():
    plan = toy_plan(1, device="cuda:0", sizes=(1,))
    buffers = [attrs.evolve(b, shape=("2*B", 16)) if b.name == "x" else b for b in plan.buffers]
    with run_pipeline(attrs.evolve(plan, buffers=buffers), RunOptions(backend="cpu", detectors=False, verify=False, sizes=()), model=build_toy(1)) as engine:
        with pytest.raises(ValueError, match="buffer 'x' has shape \\['2\\*B', 16\\]: the runner pads inputs"):
            Runner(engine)


class TestHostBuffersOnTheCudaBackend:
    """Buffers on ``cpu`` under the CUDA backend: host memory eager segments read (no GPU needed here).

    The CUDA half (capture, verify and a 64-step decode of a plan with such a buffer) is
    tests/cuda/test_cuda_dsv4.py.
    """

    def test_cpu_stays_the_host_and_other_device_types_are_refused(self):
        backend = CudaBackend()
        assert backend.device("cpu") == torch.device("cpu")
        assert backend.remapped == {}
        with pytest.raises(ValueError) as info:
            backend.device("meta")
        assert str(info.value) == "device 'meta' is neither a CUDA device nor cpu — write it 'cuda:N' or 'cpu'"

    def test_the_host_has_no_baseline_memory_nothing_to_synchronize_and_a_plain_stream(self):
        backend = CudaBackend()
        host = torch.device("cpu")
        assert backend.memory_allocated(host) == 0
        backend.synchronize(host)
        stream = backend.new_stream(host)
        assert stream.device == host
        assert not backend.is_capturing(stream)
        with backend.on_stream(stream):
            pass
        assert len(backend.time_runs(host, (lambda: None,), 3)[0]) == 3

    def test_a_graph_segment_on_the_host_gets_no_pool(self):
        with pytest.raises(ValueError) as info:
            CudaBackend().new_pool(torch.device("cpu"))
        assert str(info.value) == ("a graph segment on cpu cannot be captured by the cuda backend — put its buffers "
                                   "and stream on a cuda device, or make it an eager segment")
