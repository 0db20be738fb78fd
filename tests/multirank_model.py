"""A tiny tensor-parallel MoE step and its multi-process harness, for tests/test_multirank.py.

The step reproduces seed 000 in miniature: ``proj`` computes a rank-local partial sum,
``reduce`` all-reduces it on channel ``tp_ar``, ``route`` (data-dependent) picks a top-1
expert from the reduced values and, only when expert 0 wins, runs a further all-reduce
on ``ep_ar``; ``head`` writes the output. A ``draft`` family has its own channel
(``draft_ar``) and buffers.

``LegacyAllReduce`` emulates the legacy custom all-reduce of the seed: during warmup
of a FULL descriptor it leaves rank-local values where the reduced ones belong (what
``torch.empty_like`` handed back). Ranks then route differently, so some call ``ep_ar``
and some do not: the divergence graphflow must report instead of hanging.

``run_workers`` starts ``world_size`` gloo processes with ``graphflow.dist.launch`` (forked
from a server that imported torch once, which keeps the test fast), which run every
scenario in turn and write one JSON result per (scenario, rank).
"""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path

import attrs
import torch

from graphflow.dist.channels import ChannelRegistry
from graphflow.errors import CaptureError
from graphflow.events import Phase
from graphflow.dist.launch import launch
from graphflow.plan import (Buffer, BufferRole, CaptureSettings, Channel, ChannelKind, Descriptor, Family, Mode, Plan,
                            Segment, SegmentKind, Stream, WarmupPolicy)
from graphflow.session import Session
from graphflow.dist.trace import CallPath
from graphflow.plan.rules import validate

H = 4  # hidden size
SIZES = tuple(range(1, 68))  # 67 batch sizes: 67 PIECEWISE descriptors, then FULL ones
BARRIER_TIMEOUT_S = 10.0
GROUP_TIMEOUT_S = 30.0  # the process group's own timeout: a backstop behind the barrier


def step_plan(tp_warmup: WarmupPolicy, *, sizes=SIZES, modes=(Mode.PIECEWISE, Mode.FULL), world_size=3) -> Plan:
    g = SegmentKind.GRAPH
    # Declared on cuda:0, as on a GPU; the CPU backend maps cuda:0 to the CPU.
    buffers = [Buffer(n, ("B", H), "float32", "cuda:0", role=r) for n, r in (
        ("x", BufferRole.INPUT), ("h", BufferRole.INTERNAL), ("y", BufferRole.INTERNAL), ("out", BufferRole.OUTPUT),
        ("dx", BufferRole.INPUT), ("d", BufferRole.OUTPUT))]
    return Plan(
        name="moe-tp",
        streams=[Stream("s0", "cuda:0")],
        buffers=buffers,
        channels=[Channel("tp_ar", ChannelKind.ALL_REDUCE, "tp", 1, "target", tp_warmup),
                  Channel("ep_ar", ChannelKind.ALL_REDUCE, "ep", 2, "target"),
                  Channel("draft_ar", ChannelKind.ALL_REDUCE, "tp", 3, "draft")],
        segments=[Segment("proj", g, "proj", reads=["x"], writes=["h"], stream="s0"),
                  Segment("reduce", g, "reduce", reads=["h"], writes=["h"], channels=["tp_ar"], stream="s0"),
                  Segment("route", g, "route", reads=["h"], writes=["y"], channels=["ep_ar"], data_dependent=True, stream="s0"),
                  Segment("head", g, "head", reads=["y"], writes=["out"], stream="s0"),
                  Segment("draft_step", g, "draft_step", reads=["dx"], writes=["d"], channels=["draft_ar"],
                          family="draft", stream="s0")],
        families=[Family("target"), Family("draft")],
        capture=CaptureSettings(modes=modes, sizes=sizes, warmup_iters=1, barrier_timeout_s=BARRIER_TIMEOUT_S),
        world_size=world_size,
    )


def family_plan(plan: Plan, family: str) -> Plan:
    """The plan of one family alone: its segments, channels and buffers (a pipeline each)."""
    segments = plan.family_segments(family)
    used = {b for s in segments for b in (*s.reads, *s.writes)}
    return attrs.evolve(plan, name=f"{plan.name}-{family}", segments=segments,
                        channels=[c for c in plan.channels if c.family == family],
                        buffers=[b for b in plan.buffers if b.name in used], families=[Family(family)])


class LegacyAllReduce:
    """The seed's custom all-reduce: a FULL warmup got rank-local memory, not the sum."""

    def __init__(self, handle, runtime: ChannelRuntime, rank: int):
        self.handle, self.runtime, self.rank = handle, runtime, rank

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self.handle.all_reduce(t)
        descriptor = self.runtime.site.descriptor
        if self.handle.path() is CallPath.PLACEHOLDER and descriptor is not None and descriptor.mode is Mode.FULL:
            t.fill_(float(self.rank - 1))  # rank-local "uninitialized" contents
        return t


class Step(torch.nn.Module):
    """The model: methods follow the engine's convention ``fn(*reads, *writes_not_in_reads)``."""

    def __init__(self, channels, rank: int, *, tp=None, fail_draft_capture_on: int | None = None):
        super().__init__()
        self.channels = channels
        self.tp = tp or channels.get("tp_ar")
        self.rank = rank
        self.register_buffer("router", torch.tensor([[1.0, -1.0]] * H))  # [H, E=2]: positive sums pick expert 0
        self.fail_draft_capture_on = fail_draft_capture_on

    def proj(self, x, h):
        torch.mul(x, float(self.rank + 1), out=h)  # this rank's partial sum

    def reduce(self, h):
        self.tp.all_reduce(h)

    def route(self, h, y):
        expert = int(torch.topk(h.sum(0) @ self.router, 1).indices[0])  # top-1 of E=2, read on the host
        torch.mul(h, 2.0, out=y)
        if expert == 0:  # only then does the expert-parallel collective run
            self.channels["ep_ar"].all_reduce(y)

    def head(self, y, out):
        torch.add(y, 1.0, out=out)

    def draft_step(self, dx, d):
        handle = self.channels["draft_ar"]
        if self.rank == self.fail_draft_capture_on and handle.path() is CallPath.CAPTURED:
            raise RuntimeError("injected draft capture failure")
        torch.mul(dx, 3.0, out=d)
        handle.all_reduce(d)


# -- scenarios: each runs in every worker and returns a JSON-able dict ---------------------

def _outcome(fn) -> dict:
    start = time.monotonic()
    try:
        value = fn()
        return {"ok": True, "elapsed_s": time.monotonic() - start, **(value or {})}
    except CaptureError as e:
        return {"ok": False, "elapsed_s": time.monotonic() - start, "type": type(e).__name__, "message": str(e),
                "phase": e.phase, "descriptor": str(e.descriptor) if e.descriptor is not None else None,
                "ranks": list(getattr(e, "ranks", ())), "event": getattr(e, "event", None),
                "traceback": "".join(traceback.format_exception(e.__cause__ or e))}


def scenario_seed(rank: int, world: int, out: Path, policy: WarmupPolicy) -> dict:
    from graphflow.engine import RunOptions

    plan = family_plan(step_plan(policy, world_size=world), "target")
    # The legacy placeholder is what GF503 forbids: the reproduction turns that rule off.
    skip = {"GF503"} if policy is WarmupPolicy.PLACEHOLDER else set()
    report = validate(plan, disable=skip)
    assert report.ok, report.diagnostics
    options = RunOptions(backend="cpu", detectors=False, verify=False, skip_rules=skip)
    with Session(plan, options, rank=rank, world_size=world, trace=str(out / f"seed-{policy.value}"),
                 namespace=f"seed-{policy.value}") as session:
        model = Step(session.handles, rank, tp=LegacyAllReduce(session.handles["tp_ar"], session.channels, rank))
        return _outcome(lambda: {"graphs": session.capture(model).report.graphs})


def scenario_families(rank: int, world: int, out: Path) -> dict:
    from graphflow.engine import RunOptions

    full = step_plan(WarmupPolicy.REAL, sizes=(1, 2), modes=(Mode.PIECEWISE,), world_size=world)
    registry = ChannelRegistry()
    sessions = {}
    try:
        for family in ("target", "draft"):
            plan = family_plan(full, family)
            assert validate(plan).ok, validate(plan).diagnostics
            session = sessions[family] = Session(plan, RunOptions(backend="cpu", detectors=False), rank=rank,
                                                 world_size=world, registry=registry, namespace=f"families-{family}")
            def capture(session=session) -> None:
                session.capture(Step(session.handles, rank, fail_draft_capture_on=1))

            result = _outcome(capture)
            if family == "draft":
                draft = result
            else:
                ids_after_target = registry.taken
        taken_after_draft = registry.taken
        # The target's graphs still replay: x -> (sum over ranks of x*(r+1)) * 2, all-reduced on ep_ar, + 1.
        engine = sessions["target"].engine
        views = engine.buffers.views(2)
        views["x"].copy_(torch.arange(2 * H, dtype=torch.float32).view(2, H) + 1)
        for call in engine.programs[next(d for d in engine.descriptors if d.size == 2)]:
            call()
        expected = (views["x"] * sum(r + 1 for r in range(world)) * 2 * world + 1).tolist()
        replay_ok = views["out"].tolist() == expected
        handle_ids = {f: [h.channel.id for h in s.handles.values()] for f, s in sessions.items()}
    finally:
        for session in reversed(sessions.values()):
            session.close()
    return {"ids_after_target": ids_after_target, "draft": draft, "ids_after_draft": taken_after_draft,
            "replay_ok": replay_ok, "handle_ids": handle_ids}


class Layered(torch.nn.Module):
    """Two collectives: on a ``tp`` subgroup, then on the world."""

    def __init__(self, channels, rank: int):
        super().__init__()
        self.channels, self.rank = channels, rank

    def step(self, x, h):
        torch.mul(x, float(self.rank + 1), out=h)
        self.channels["tp_ar"].all_reduce(h)
        self.channels["world_ar"].all_reduce(h)


def scenario_subgroups(rank: int, world: int, out: Path) -> dict:
    """``tp`` partitions ranks into [0, 1] and [2]: each partition sums its partials, then the world sums."""
    from graphflow.dist.channels import new_group_factory
    from graphflow.engine import RunOptions

    plan = Plan(
        name="subgroups",
        streams=[Stream("s0", "cuda:0")],
        buffers=[Buffer("x", ("B", H), "float32", "cuda:0", role=BufferRole.INPUT),
                 Buffer("h", ("B", H), "float32", "cuda:0", role=BufferRole.OUTPUT)],
        channels=[Channel("tp_ar", ChannelKind.ALL_REDUCE, "tp", 1, "target"),
                  Channel("world_ar", ChannelKind.ALL_REDUCE, "world", 2, "target")],
        segments=[Segment("step", SegmentKind.GRAPH, "step", reads=["x"], writes=["h"], stream="s0",
                          channels=["tp_ar", "world_ar"])],
        capture=CaptureSettings(modes=[Mode.PIECEWISE], sizes=[1, 2], barrier_timeout_s=BARRIER_TIMEOUT_S),
        world_size=world,
    )
    assert validate(plan).ok, validate(plan).diagnostics
    layout = {"tp": [list(range(world - 1)), [world - 1]]}
    with Session(plan, RunOptions(backend="cpu"), rank=rank, world_size=world, trace=str(out / "subgroups"),
                 group_factory=new_group_factory(rank, layout, timeout_s=GROUP_TIMEOUT_S),
                 namespace="subgroups") as session:
        engine = session.capture(Layered(session.handles, rank))
        views = engine.buffers.views(2)
        views["x"].fill_(1.0)
        for call in engine.programs[Descriptor(Mode.PIECEWISE, 2)]:
            call()
        return {"h": views["h"].unique().tolist(), "tp_members": list(session.handles["tp_ar"].binding.members),
                "verify_bit_exact": [v.bit_exact for v in engine.report.verify]}


#: The stalled-rank scenario's barrier timeout: short, so the stall costs the suite little.
STALL_TIMEOUT_S = 3.0
STALLED_RANK = 2


class Stalling(Step):
    """A rank that stalls in ``proj`` during FULL warmup for longer than the barrier timeout.

    It stays away until every other rank has given up on it (each writes a marker file
    once its pipeline has raised and rolled back), so it always comes back to a
    collective the others abandoned, however loaded the machine is.
    """

    def __init__(self, channels, rank: int, runtime, markers: Path, world: int):
        super().__init__(channels, rank)
        self.runtime, self.markers, self.world = runtime, markers, world
        self.stalled = False

    def proj(self, x, h):
        site = self.runtime.site
        if (self.rank == STALLED_RANK and not self.stalled and site.phase is Phase.WARMUP
                and site.descriptor.mode is Mode.FULL):
            self.stalled = True
            others = [self.markers / f"gave-up.rank{r}" for r in range(self.world) if r != self.rank]
            deadline = time.monotonic() + 60
            while not all(m.exists() for m in others) and time.monotonic() < deadline:
                time.sleep(0.01)
        super().proj(x, h)


def scenario_stalled(rank: int, world: int, out: Path) -> dict:
    """One rank stalls past the barrier timeout; then the same session captures again."""
    from graphflow.engine import RunOptions

    plan = family_plan(step_plan(WarmupPolicy.REAL, sizes=(1, 2), world_size=world), "target")
    plan = attrs.evolve(plan, capture=attrs.evolve(plan.capture, barrier_timeout_s=STALL_TIMEOUT_S))
    markers = out / "stalled"
    markers.mkdir(exist_ok=True)
    with Session(plan, RunOptions(backend="cpu", detectors=False), rank=rank, world_size=world,
                 trace=str(out / "stalled"), namespace="stalled") as session:
        model = Stalling(session.handles, rank, session.channels, markers, world)
        torch.distributed.barrier()  # start together: only the stall may make a rank late
        first = _outcome(lambda: session.capture(model))
        (markers / f"gave-up.rank{rank}").write_text(first.get("type", "ok"))
        # The retry waits for the stalled rank to come back from its stall: a longer timeout.
        session.channels.timeout_s = BARRIER_TIMEOUT_S
        retry = _outcome(lambda: {"graphs": session.capture(model).report.graphs})
        # The group itself still pairs collectives: every rank adds its rank + 1.
        total = torch.tensor([float(rank + 1)])
        torch.distributed.all_reduce(total)
    return {"first": first, "retry": retry, "sum": total.item()}


SCENARIOS = {
    "seed_placeholder": lambda rank, world, out: scenario_seed(rank, world, out, WarmupPolicy.PLACEHOLDER),
    "seed_real": lambda rank, world, out: scenario_seed(rank, world, out, WarmupPolicy.REAL),
    "families": scenario_families,
    "subgroups": scenario_subgroups,
    "stalled": scenario_stalled,
}


def _run_scenarios(ctx, out: str, names: tuple[str, ...]) -> None:
    """One rank (``graphflow.dist.launch``): every scenario in turn, one JSON result file each."""
    out = Path(out)
    torch.set_num_threads(1)
    for name in names:
        try:
            result = SCENARIOS[name](ctx.rank, ctx.world_size, out)
        except Exception as e:  # reported to the test, which fails with the traceback
            result = {"ok": False, "type": type(e).__name__, "message": str(e), "traceback": traceback.format_exc()}
        (out / f"{name}.rank{ctx.rank}.json").write_text(json.dumps(result, default=str))


def run_workers(out: Path, world: int, names, timeout_s: float = 120.0) -> dict[str, list[dict]]:
    """Run the scenarios in ``world`` gloo processes (``graphflow.dist.launch``); results[name][rank].

    A rank that never got to write a scenario's result reads as ``{"ok": False, "type": "missing"}``.
    """
    launch(_run_scenarios, world, "gloo", args=(str(out), tuple(names)), timeout_s=timeout_s,
           group_timeout_s=GROUP_TIMEOUT_S)
    results = {}
    for name in names:
        results[name] = []
        for r in range(world):
            path = out / f"{name}.rank{r}.json"
            results[name].append(json.loads(path.read_text()) if path.exists() else {"ok": False, "type": "missing"})
    return results


if __name__ == "__main__":
    import sys
    import tempfile

    directory = Path(tempfile.mkdtemp())
    print(json.dumps(run_workers(directory, int(os.environ.get("WORLD", "3")), sys.argv[1:] or list(SCENARIOS)),
                     indent=1, default=str))
    print(directory)
