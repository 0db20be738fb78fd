"""Every descriptor checked before it serves (``graphflow.engine.first_use``), on the CPU
backend: the ones verify's sample left out are checked on their first batch, in that
step, against the model's eager step; one found wrong is taken out, named, and that step
serves the eager step's values. The CPU backend's replay runs the calls again, so a
model whose Python state advances each call differs there as a CUDA graph's frozen
value does (tests/cuda/test_cuda_first_use.py)."""

from __future__ import annotations

import pytest
import torch

from graphflow.engine import RunOptions, run_pipeline
from graphflow.engine.context import sample
from graphflow.errors import CaptureError
from graphflow.plan import Descriptor, Mode
from graphflow.runtime import Runner
from plans.toy_model import build_toy, toy_plan
from tests.first_use_model import drifting_toy

P = Mode.PIECEWISE
SIZES = tuple(range(1, 17))
WRONG = 10


def test_the_sample_leaves_the_wrong_size_out():
    plan = toy_plan(2, sizes=SIZES)
    assert Descriptor(P, WRONG) not in sample(plan.descriptors())


def test_a_graph_wrong_at_one_unsampled_size_never_serves_a_wrong_value():
    model, drift = drifting_toy(2, WRONG)
    engine = run_pipeline(toy_plan(2, sizes=SIZES), RunOptions(backend="cpu"), model=model)
    try:
        runner = Runner(engine)
        sampled = len(sample(engine.plan.descriptors()))
        assert runner.checks.before_ready == sampled and runner.checks.waiting == len(SIZES) - sampled
        x = torch.randn(WRONG, 32)
        (out,) = runner.run(x)
        want = torch.empty(WRONG, 64)
        build_toy(2).step(x.clone(), want)
        assert torch.equal(out, want + (drift[0] - 1)), "the first batch serves the eager step (the last call replayed)"
        bad = Descriptor(P, WRONG)
        assert bad not in engine.programs and runner.descriptor_for(WRONG) == Descriptor(P, 11)
        error = engine.first_use.failures[bad]
        assert isinstance(error, CaptureError) and error.message.startswith(
            "graph replay of PIECEWISE(B=10) differs from the eager step on its first batch in buffer 'logits'")
        assert error.segment == "head"
        assert runner.checks.failed == 1 and runner.checks.on_first_use == 0
        for _ in range(3):  # later batches of that size replay B=11's graph, which is right
            x = torch.randn(WRONG, 32)
            (out,) = runner.run(x)
            want = torch.empty(WRONG, 64)
            build_toy(2).step(x.clone(), want)
            assert torch.equal(out, want)
    finally:
        engine.close()


def test_a_checked_step_serves_the_eager_step_and_each_descriptor_is_checked_once():
    model = build_toy(2)
    engine = run_pipeline(toy_plan(2, sizes=SIZES), RunOptions(backend="cpu"), model=model)
    try:
        runner = Runner(engine)
        calls = []
        checks = engine.first_use
        check = checks.check
        checks.check = lambda d, program: (calls.append(d.size), check(d, program))[1]
        for batch in (3, 3, 7, 3, 16):
            x = torch.randn(batch, 32)
            (out,) = runner.run(x)
            want = torch.empty(batch, 64)
            build_toy(2).step(x.clone(), want)
            assert torch.equal(out, want)
        assert calls == [3, 7], "16 was verified before ready; each other size once"
        assert runner.checks.on_first_use == 2 and all(r.bit_exact for r in checks.verified)
    finally:
        engine.close()


def test_verify_all_leaves_nothing_to_check_and_verify_off_checks_nothing():
    for verify, waiting in (("all", 0), (False, 0)):
        engine = run_pipeline(toy_plan(2, sizes=(1, 2, 4, 8, 16, 32, 64)), RunOptions(backend="cpu", verify=verify))
        try:
            runner = Runner(engine)
            assert runner.checks.waiting == waiting
            assert (engine.first_use is None) == (verify is False)
            runner.run(torch.randn(3, 32))
            assert runner.checks.on_first_use == 0
        finally:
            engine.close()


def test_a_lazy_engine_checks_every_descriptor_on_its_first_batch():
    model, drift = drifting_toy(2, WRONG)
    engine = run_pipeline(toy_plan(2, sizes=SIZES), RunOptions(backend="cpu", lazy=True), model=model)
    try:
        assert engine.background.wait(60)
        runner = Runner(engine)
        assert runner.checks.before_ready == 0 and runner.checks.waiting == len(SIZES)
        for batch in (WRONG, 12, 1):
            runner.run(torch.randn(batch, 32))
        assert runner.checks.failed == 1 and runner.checks.on_first_use == 2
        assert Descriptor(P, WRONG) in engine.background.failures
        assert runner.descriptor_for(WRONG) == Descriptor(P, 11)
    finally:
        engine.close()


def test_graphflow_run_says_how_many_were_checked_before_ready_and_how_many_wait(capsys, tmp_path):
    import json

    from graphflow.cli import main
    from graphflow.plan.loader import dump_plan

    plan = tmp_path / "toy.yaml"
    plan.write_text(dump_plan(toy_plan(2, sizes=range(1, 11))))
    assert main(["run", str(plan), "--backend", "cpu", "--json", "--steps", "0", "--no-detectors"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["checks"] == {"before_ready": 5, "on_first_use": 0, "waiting": 5, "failed": 0}
    assert [d["size"] for d in document["descriptors"] if d["verify"] is None] == [9, 7, 5, 4, 2]


@pytest.mark.parametrize("lazy", [False, True])
def test_a_closed_engine_holds_no_model_through_its_checks(lazy):
    """The checks keep the model's callables; closing lets go of them, so a caller that
    still holds the engine holds no model."""
    import gc
    import weakref

    model = build_toy(2)
    alive = weakref.ref(model)
    engine = run_pipeline(toy_plan(2, sizes=SIZES), RunOptions(backend="cpu", lazy=lazy), model=model)
    if lazy:
        assert engine.background.wait(60)
    Runner(engine).run(torch.randn(3, 32))
    engine.close()
    del model
    gc.collect()
    assert alive() is None and engine.first_use.unchecked == set()


def test_a_check_holds_one_copy_of_the_state_at_a_time(monkeypatch):
    """A 61-layer plan's state is 11 GB: a check that held the start and the eager
    step's results at once needed two copies free beside it, and two servers no longer
    fitted one device. The copies a check makes are counted while they live."""
    import weakref

    from graphflow.engine.model.binding import build_model
    from graphflow.integrations.dsv4.plans import plan_variant
    from tests.lazy_server import SMOKE

    plan = plan_variant("plans/dsv4_61l_full.yaml", sizes=tuple(range(1, 9)), **SMOKE)
    engine = run_pipeline(plan, RunOptions(backend="cpu"), model=build_model(plan, {"device": torch.device("cpu"),
                                                                                    "plan": plan}))
    try:
        runner = Runner(engine)
        unchecked = sorted(d.size for d in engine.first_use.unchecked)
        assert unchecked, "the sample leaves a descriptor to check on its first batch"
        size = unchecked[0]
        views = engine.buffers.views(size)
        start = engine.first_use._needs.start
        state_bytes = sum(views[n].nbytes for n in start)
        largest = max(views[n].nbytes for n in engine.first_use._needs.written)
        alive, peak = [0], [0]
        clone = torch.Tensor.clone

        def counted(tensor, *args, **kwargs):
            copy = clone(tensor, *args, **kwargs)
            alive[0] += copy.nbytes
            peak[0] = max(peak[0], alive[0])
            weakref.finalize(copy, lambda n=copy.nbytes: alive.__setitem__(0, alive[0] - n))
            return copy

        inputs = [torch.randint(0, 2, (size,)) for _ in runner.inputs]
        monkeypatch.setattr(torch.Tensor, "clone", counted)
        runner.run(*inputs)
        monkeypatch.undo()
        assert runner.checks.on_first_use == 1
        assert state_bytes < peak[0] <= state_bytes + largest + sum(views[n].nbytes for n in runner.outputs)
    finally:
        engine.close()
