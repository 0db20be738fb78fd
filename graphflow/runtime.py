"""The runtime: run a batch through the captured descriptor that holds it.

The runner picks the descriptor, fills the static inputs and hands back the outputs;
replay itself is whatever the engine's step program holds (graph replays and bound
eager breaks, in order). It never asks which backend made them (SGLang's runner and
backend split), so the same runner drives CUDA graphs and the CPU backend's eager
regions.

* A batch of ``b`` rows runs on the smallest captured size ``>= b``: FULL when that
  size was captured FULL, else PIECEWISE. A descriptor verify did not check before ready
  is checked on its first batch (``graphflow.engine.first_use``): that step serves the
  model's eager step, and a descriptor whose replay differs is taken out of service.
  While a lazy engine's thread still records, a batch that a checked descriptor holds
  replays the smallest such one instead of checking its own (a check's eager step
  would take the host from the recordings); its own is checked once the thread is done.
  Inputs are copied into the leading ``b`` rows
  of the static input buffers and the padded rows are filled with the input's ``pad``
  value (zero by default; a scratch slot index for an input that indexes a cache), so
  a padded step is deterministic. Padded rows never change the state of other rows: a
  state buffer with ``pad: keep`` has its padded rows saved before the step and put
  back after it (preallocated copies, only on padded batches).
* A batch larger than every descriptor runs eagerly (on the static buffers where they
  are large enough, on fresh tensors otherwise) and is counted in ``fallbacks`` under
  its ``FallbackReason``.

Output aliasing: the tensors ``run`` returns are valid until the next ``run``, which
overwrites them. Clone what you keep. They are views of static buffers, except while a
lazy engine's capture thread is at work: a phase of it may run the model on the static
buffers between two steps (a per-size warmup, the CPU backend's capture), while the
caller reads the last step's outputs, so each step's outputs are then copied into
tensors of the runner's own (one copy per output per step, made on the step's stream),
which only ``run`` writes.

Everything the hot path needs is precomputed, per batch size, at the first step of that
size: one ``_Program`` with the input views, the pad views, the step's callables and
the output views (made for every size at once, a deep plan's hundreds of padded state
buffers took half a second, and a lazy engine paid it again at every switch-in). ``run``
is then a list index and three tight loops: no dict lookups by string, no validation, no
events.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import statistics
import time
from collections.abc import Callable, Iterable

import attrs
import torch

from graphflow.engine import Engine
from graphflow.events import Phase
from graphflow.plan import PAD_KEEP, BufferRole, Descriptor, dim_symbols, holders

__all__ = ["FallbackReason", "Runner", "StepTiming", "time_steps"]


class FallbackReason(enum.Enum):
    BATCH_TOO_LARGE = "batch larger than every captured descriptor"
    NOTHING_CAPTURED = "the engine committed no descriptor"
    NOT_CAPTURED_YET = "no descriptor that holds the batch is captured yet (lazy capture under way)"


@attrs.frozen
class _Program:
    descriptor: Descriptor
    inputs: tuple[torch.Tensor, ...]  # static input views at the batch size, in Runner.inputs order
    pads: tuple[tuple[torch.Tensor, float], ...]  # the rows between the batch size and the descriptor's, and their fill
    calls: tuple[Callable[[], object], ...]
    outputs: tuple[torch.Tensor, ...]  # static output views at the batch size
    keeps: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()  # (padded rows of a pad: keep state, their copy)


class Runner:
    """Runs batches on a committed ``Engine``; see the module docstring."""

    def __init__(self, engine: Engine):
        plan = engine.plan
        self.engine = engine
        self.inputs = tuple(b.name for b in plan.buffers if b.role is BufferRole.INPUT)
        self.outputs = tuple(b.name for b in plan.buffers if b.role is BufferRole.OUTPUT)
        symbol = plan.capture.size_symbol
        self._dims = {name: _batch_dim(plan.buffer(name).shape, symbol, name) for name in (*self.inputs, *self.outputs)}
        batched = [n for n in self.inputs if self._dims[n] is not None]
        if not batched:
            raise ValueError(f"no input buffer has a plain {symbol!r} dimension, so the runner cannot tell a "
                             f"batch's size — give one input a dimension equal to {symbol!r}")
        self._size_of = self.inputs.index(batched[0]), self._dims[batched[0]]
        self._kept = tuple(b.name for b in plan.buffers if b.role is BufferRole.STATE and b.pad == PAD_KEEP)
        self._dims.update({name: _batch_dim(plan.buffer(name).shape, symbol, name) for name in self._kept})
        self._scratch: dict[str, torch.Tensor] = {}
        self._served: dict[str, torch.Tensor] = {}  # the caller's outputs while a capture thread works
        self.fallbacks: collections.Counter[FallbackReason] = collections.Counter()
        self._serving: list[Descriptor | None] = []  # batch size -> the descriptor that serves it
        self._programs: list[_Program | None] = []  # batch size -> its program, once made
        with engine.live.lock if engine.live is not None else contextlib.nullcontext():  # the thread switches in
            self._build()

    def _build(self) -> None:
        """Which descriptor serves each batch size, from the engine's captured descriptors.

        A batch's program is made at its first step (``_program_for``), and kept while the
        same descriptor serves it: a lazy engine switches a descriptor in at a time, and
        the batches it takes over are the only ones to make again."""
        engine, live = self.engine, self.engine.live
        own = holders(engine.programs)
        serving = own
        if live is not None and not live.done:
            # While the thread records, a first-use check's eager step would take the host
            # from it: a checked graph that holds the batch serves it, and its own waits.
            unchecked = live.unchecked
            checked = holders(d for d in engine.programs if d not in unchecked)
            serving = checked + own[len(checked):]
        #: The most rows any batch pads: what a pad: keep copy must hold.
        self._max_pad = max((d.size - b for b, d in enumerate(serving) if d is not None), default=0)
        kept = [program if serving[batch] is self._serving[batch] else None
                for batch, program in enumerate(self._programs[:len(serving)])]
        self._programs = kept + [None] * (len(serving) - len(kept))
        self._serving = serving
        self._version = live.version if live is not None else 0

    @property
    def checks(self):
        """How many descriptors were checked against the eager step before ready and on
        their first batch, how many wait for theirs, how many failed there
        (``graphflow.engine.first_use.Checks``): nothing serves a graph unchecked unless
        verify is off."""
        return self.engine.checks

    @property
    def max_size(self) -> int:
        return len(self._serving) - 1

    def descriptor_for(self, batch: int) -> Descriptor | None:
        """The descriptor a batch of this size replays, or None when it falls back to eager."""
        return self._serving[batch] if 0 < batch < len(self._serving) else None

    @torch.no_grad()
    def run(self, *inputs: torch.Tensor, **named: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One step. Inputs in ``self.inputs`` order, or by name (``run(tokens=t)``);
        outputs in ``self.outputs`` order.

        The outputs are valid until the next ``run`` (see the module docstring). Runs
        without autograd, like the pipeline that captured it.
        """
        if named:
            inputs = self._ordered(inputs, named)
        if self.engine.live is not None:
            return self._run_live(inputs)
        return self._step(inputs)

    def _step(self, inputs: tuple[torch.Tensor, ...], live=None) -> tuple[torch.Tensor, ...]:
        position, dim = self._size_of
        batch = inputs[position].shape[dim]
        if batch >= len(self._programs):
            return self._fallback(inputs, batch)
        program = self._programs[batch]
        if program is None:
            program = self._program_for(batch)
        for static, value in zip(program.inputs, inputs):
            static.copy_(value)
        for pad, value in program.pads:
            pad.fill_(value)
        for rows, saved in program.keeps:
            saved.copy_(rows)
        checks = self.engine.first_use
        if checks is not None and checks.unchecked and program.descriptor in checks.unchecked:
            # The eager step's results are served either way; a descriptor found wrong is
            # out of the engine's programs, and the batches it served go elsewhere now.
            if not checks.check(program.descriptor, program.calls) and live is None:
                self._build()
        else:
            for call in program.calls:
                call()
        for rows, saved in program.keeps:
            rows.copy_(saved)
        return program.outputs

    def _run_live(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """A lazy engine's step: in its turn (no recording of the capture thread runs
        meanwhile), with the programs switched in since the last step, asking for this
        batch's; a descriptor's first batch checks it (``LiveSwitch.check``)."""
        live = self.engine.live
        position, dim = self._size_of
        live.asked(inputs[position].shape[dim])
        with live.step():
            if live.version != self._version:
                self._build()
            outputs = self._step(inputs, live)
            if live.done:
                return outputs
            return tuple(self._own(name, out) for name, out in zip(self.outputs, outputs))

    def _own(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """``out`` copied into the runner's tensor for output ``name``, as large as the
        static buffer, so that the capture thread's next phase cannot overwrite it."""
        mine = self._served.get(name)
        if mine is None:
            mine = self._served[name] = torch.empty_like(self.engine.buffers.tensors[name])
        dim = self._dims[name]
        if dim is not None and out.shape[dim] > mine.shape[dim]:  # an eager fallback beyond every size
            mine = self._served[name] = torch.empty_like(out)
        view = mine if dim is None else mine.narrow(dim, 0, out.shape[dim])
        return view.copy_(out)

    def clear_state(self) -> None:
        """Zero every state buffer (the model's caches start empty: new sequences)."""
        plan, live = self.engine.plan, self.engine.live
        # A lazy engine's capture thread uses them too.
        with live.step() if live is not None else contextlib.nullcontext():
            for name, tensor in self.engine.buffers.tensors.items():
                if plan.buffer(name).role is BufferRole.STATE and plan.buffer(name).alias_of is None:
                    tensor.zero_()

    def _ordered(self, inputs: tuple, named: dict) -> tuple:
        if inputs:
            raise TypeError("give the inputs in order or by name, not both")
        unknown = sorted(set(named) - set(self.inputs))
        missing = [n for n in self.inputs if n not in named]
        if unknown or missing:
            problems = ([f"no input named {', '.join(unknown)}"] if unknown else []) + (
                [f"missing {', '.join(missing)}"] if missing else [])
            raise TypeError(f"{'; '.join(problems)}: the inputs are {', '.join(self.inputs)}")
        return tuple(named[n] for n in self.inputs)

    def _program_for(self, batch: int) -> _Program:
        if batch < 1:
            raise ValueError("a batch needs at least one row")
        program = self._programs[batch] = self._program(self._serving[batch], batch)
        return program

    def _program(self, descriptor: Descriptor, batch: int) -> _Program:
        plan = self.engine.plan
        views = self.engine.buffers.views_of(descriptor)
        pad = descriptor.size - batch
        inputs, pads = [], []
        for name in self.inputs:
            dim = self._dims[name]
            view = views[name]
            if dim is None:
                inputs.append(view)
                continue
            inputs.append(view.narrow(dim, 0, batch))
            if pad:
                fill = plan.buffer(name).pad
                pads.append((view.narrow(dim, batch, pad), 0 if fill is None else fill))
        outputs = tuple(views[n] if self._dims[n] is None else views[n].narrow(self._dims[n], 0, batch)
                        for n in self.outputs)
        keeps = tuple(self._keep(name, views[name], batch, pad) for name in self._kept if pad)
        return _Program(descriptor, tuple(inputs), tuple(pads), self.engine.programs[descriptor], outputs, keeps)

    def _keep(self, name: str, view: torch.Tensor, batch: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The padded rows of a ``pad: keep`` state buffer and a copy to save them in: one
        scratch tensor per buffer, as large as the most rows any batch pads."""
        dim = self._dims[name]
        rows = view.narrow(dim, batch, pad)
        scratch = self._scratch.get(name)
        if scratch is None or scratch.shape[dim] < pad:  # a lazy engine's sizes grow as it captures
            shape = list(rows.shape)
            shape[dim] = self._max_pad
            scratch = self._scratch[name] = torch.empty(shape, dtype=rows.dtype, device=rows.device)
        return rows, scratch.narrow(dim, 0, pad)

    def _fallback(self, inputs: tuple[torch.Tensor, ...], batch: int) -> tuple[torch.Tensor, ...]:
        """An eager step for a batch no descriptor holds (slow path, counted)."""
        live = self.engine.live
        if live is not None and not live.done:
            reason = FallbackReason.NOT_CAPTURED_YET
        else:
            reason = FallbackReason.NOTHING_CAPTURED if self.max_size == 0 else FallbackReason.BATCH_TOO_LARGE
        self.fallbacks[reason] += 1
        buffers = self.engine.buffers
        views: dict[str, torch.Tensor] = {}
        for name in buffers:
            if not buffers.uses_size(name) or buffers.capacity(name) >= batch:
                views[name] = buffers.view(name, batch)
            elif self.engine.plan.buffer(name).role is BufferRole.STATE:
                raise ValueError(f"batch of {batch} exceeds state buffer {name!r}, allocated for "
                                 f"{buffers.capacity(name)} — raise its capacity or split the batch")
            else:
                views[name] = buffers.fresh(name, batch)
        for name, value in zip(self.inputs, inputs):
            views[name].copy_(value)
        began = time.perf_counter()
        for call in self.engine.eager_calls(batch, views):
            call()
        if live is not None and not live.done:
            live.turns.eager_took(time.perf_counter() - began)  # a recording's slice follows the eager steps
        return tuple(views[n] for n in self.outputs)


def _batch_dim(shape, symbol: str, name: str) -> int | None:
    uses = [i for i, dim in enumerate(shape) if symbol in dim_symbols(dim)]
    if not uses:
        return None
    plain = [i for i in uses if isinstance(shape[i], str) and shape[i].strip() == symbol]
    if len(uses) != 1 or not plain:
        raise ValueError(f"buffer {name!r} has shape {list(shape)}: the runner pads inputs and slices outputs "
                         f"along one dimension equal to {symbol!r}, and this buffer has {len(uses)} using it")
    return plain[0]


@attrs.frozen
class StepTiming:
    """One descriptor's step, eager against replayed: what capturing it saves a step.
    Medians of the runs counted here, so that one slow run (a page fault, another
    process) does not decide it where there are several. On the CPU backend replay runs
    the same calls, and the two differ by noise only."""

    descriptor: Descriptor
    eager_s: float
    replay_s: float
    eager_runs: int = 1
    replay_runs: int = 1


def time_steps(engine: Engine, steps: int, only: Iterable[Descriptor] | None = None, *,
               eager_budget_s: float | None = None) -> dict[Descriptor, StepTiming]:
    """Each committed descriptor's step (or those of ``only``: timing all 67 of a large
    plan takes minutes, a sample of them seconds) timed ``steps`` times eagerly (the model as
    written, segment by segment, ``Engine.eager_calls``) and ``steps`` times replayed
    (its step program), on the static buffers. Each median is of the timed runs.

    ``eager_budget_s`` bounds the eager runs by time: after the first, only as many more
    (up to ``steps`` in all) as fit in that budget at the first one's pace. A large model's
    eager step is long and host-bound, its runs spread by the host's own noise (seven of
    each of three sizes of the 61-layer plan on the H200: 222 to 293 ms,
    ``bench/results/step_spread.txt``) more than a median of three narrows, and three of
    each sampled size added 2 s to a capture of 23; a short step, where launch jitter
    counts, still gets all ``steps``. Replays are short and steady (seven at B=248: 29.93
    to 30.01 ms) and always run ``steps`` times.

    A step's first run pays what no later run does (caches filled, lazy modules built, a
    graph's first launch uploading it): the timed runs come after one such run of each.
    The pipeline's own runs count: a descriptor warmed up (not ``capture.warmup: auto``'s
    skipped ones) ran its eager step, one verified ran its replay, so only a step the
    pipeline never ran gets an untimed run here (``graphflow run``'s defaults time the
    smallest, median and largest size, which verify's sample usually holds).

    The backend's clock times them (``Backend.time_runs``): CUDA events on a GPU, so a
    replay counts what the device does, not how quickly Python returns; the eager runs,
    then the replays, back to back, with one synchronize before and one after each
    batch. Empty when ``steps`` is 0.

    The steps write the static buffers and run the model: call it between steps, and on
    a lazy engine once its capture thread is done, never beside ``Runner.run``."""
    if steps <= 0 or not engine.programs:
        return {}
    first = next(iter(engine.buffers.tensors.values()), None)
    device = first.device if first is not None else None
    report = engine.report
    warmed = {t.descriptor for t in report.times if t.phase is Phase.WARMUP and not t.skipped}
    replayed = {r.descriptor for r in report.verify}
    timings = {}
    with torch.no_grad():
        for descriptor in engine.programs if only is None else only:
            program = engine.programs[descriptor]
            eager, replay = _in_order(engine.eager_calls(descriptor.size)), _in_order(program)
            if descriptor not in warmed:
                eager()
            if descriptor not in replayed:
                replay()
            eager_s = _eager_runs(engine.backend, device, eager, steps, eager_budget_s)
            (replay_s,) = engine.backend.time_runs(device, (replay,), steps)
            timings[descriptor] = StepTiming(descriptor, statistics.median(eager_s), statistics.median(replay_s),
                                             len(eager_s), len(replay_s))
    return timings


def _eager_runs(backend, device, eager: Callable[[], None], steps: int, budget_s: float | None) -> list[float]:
    if budget_s is None:
        return backend.time_runs(device, (eager,), steps)[0]
    (times,) = backend.time_runs(device, (eager,), 1)
    more = min(steps - 1, int(budget_s / max(times[0], 1e-9)) - 1)
    if more > 0:
        times += backend.time_runs(device, (eager,), more)[0]
    return times


def _in_order(calls: tuple[Callable[[], object], ...]) -> Callable[[], None]:
    def step() -> None:
        for call in calls:
            call()

    return step
