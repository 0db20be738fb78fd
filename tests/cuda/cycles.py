"""A long-lived process's captures, in cycles, with device memory counted whole after each.

One cycle: a clean run and close; a run rolled back at each phase (a failure as the
phase begins, a failure after graphs exist, a host sync that invalidates a capture); a
lazy run that serves steps while its thread captures, then closes. After each cycle,
``memory_allocated`` and ``memory_reserved`` as they are (garbage collected and the
device synchronized, nothing cleared or left out). Run in a fresh process, so the
first cycle pays for everything made once::

    python -m tests.cuda.cycles --cycles 100 --out cycles.json

tests/cuda/test_cuda_cycles.py runs it and asserts the counts flat after the first cycle.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import attrs
import torch

from graphflow.engine import RunOptions, run_pipeline
from graphflow.errors import CaptureError
from graphflow.events import EventKind, Phase
from graphflow.plan import Mode, Stream
from graphflow.runtime import Runner
from plans.toy_model import build_toy, toy_plan

MiB = 1 << 20
SIZES = (1, 2)


def two_stream_plan():
    """The FULL toy plan with each layer's blend on a second stream: a run takes two."""
    plan = toy_plan(2, hidden=256, vocab=512, full=True, modes=(Mode.PIECEWISE, Mode.FULL), sizes=SIZES)
    segments = [attrs.evolve(s, stream="s1") if s.name.endswith(".mix") else s for s in plan.segments]
    return attrs.evolve(plan, segments=segments, streams=[*plan.streams, Stream("s1", "cuda:0")])


class Fault:
    """Fails the run at ``kind`` of ``phase`` (the ``index``-th descriptor, for
    DESCRIPTOR_END), or syncs the host inside the first capture when ``sync``."""

    def __init__(self, phase: Phase, kind: EventKind = EventKind.PHASE_BEGIN, index: int | None = None,
                 sync: bool = False):
        self.phase, self.kind, self.index, self.sync = phase, kind, index, sync
        self.current: Phase | None = None

    def on_event(self, event):
        if event.kind is EventKind.PHASE_BEGIN:
            self.current = event.phase
        if self.sync or event.phase is not self.phase or event.kind is not self.kind:
            return
        if self.index is None or event.index == self.index:
            raise RuntimeError(f"injected at {self.phase.value} {self.kind.name}")

    def wrap(self, model):
        pre = model.layers[0].pre

        def synced(x, h):
            if self.current is Phase.CAPTURE:
                float(x.sum().item())  # a host sync: the capture is invalidated
            pre(x, h)

        model.layers[0].pre = synced
        return model


FAULTS = (
    Fault(Phase.ALLOCATE), Fault(Phase.WARMUP), Fault(Phase.PREWARM), Fault(Phase.CAPTURE),
    Fault(Phase.CAPTURE, EventKind.DESCRIPTOR_END, index=2), Fault(Phase.CAPTURE, sync=True),
    Fault(Phase.VERIFY), Fault(Phase.COMMIT),
)


def cycle(plan, generator: torch.Generator) -> None:
    run_pipeline(plan, RunOptions(backend="cuda"), model=build_toy(2, hidden=256, vocab=512, device="cuda")).close()
    for fault in FAULTS:
        model = build_toy(2, hidden=256, vocab=512, device="cuda")
        if fault.sync:
            fault.wrap(model)
        try:
            run_pipeline(plan, RunOptions(backend="cuda", detectors=False), model=model, listeners=[fault]).close()
        except CaptureError:
            pass
        else:
            raise AssertionError(f"the fault at {fault.phase.value} {fault.kind.name} {fault.index} sync={fault.sync} did not fail the run")
        del model
    engine = run_pipeline(plan, RunOptions(backend="cuda", lazy=True),
                          model=build_toy(2, hidden=256, vocab=512, device="cuda"))
    try:
        runner = Runner(engine)
        for step in range(12):
            runner.run(torch.randn(1 + step % 2, 256, device="cuda", generator=generator))
        torch.cuda.current_stream().synchronize()
        assert engine.background.wait(60) and engine.background.failures == {}, engine.background.failures
    finally:
        engine.close()


def counts() -> tuple[int, int]:
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=100)
    parser.add_argument("--out", help="write the counts as JSON here")
    args = parser.parse_args(argv)
    plan = two_stream_plan()
    generator = torch.Generator("cuda").manual_seed(0)
    start = counts()
    rows = []
    began = time.perf_counter()
    for index in range(1, args.cycles + 1):
        cycle(plan, generator)
        allocated, reserved = counts()
        rows.append({"cycle": index, "allocated": allocated, "reserved": reserved})
        if index in (1, 2, 3, 5, 10) or index % 25 == 0:
            print(f"cycle {index:3d}: allocated {allocated / MiB:8.2f} MiB, reserved {reserved / MiB:8.2f} MiB "
                  f"({time.perf_counter() - began:.1f} s)", flush=True)
    result = {"start": {"allocated": start[0], "reserved": start[1]}, "cycles": rows,
              "pipelines_per_cycle": 2 + len(FAULTS)}
    if args.out:
        with open(args.out, "w", encoding="utf-8") as file:
            json.dump(result, file, indent=1)
    return result


if __name__ == "__main__":
    main()
