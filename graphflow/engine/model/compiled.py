"""Compiled segments: graph segments wrapped with ``torch.compile``, captured by graphflow.

graphflow does not fuse kernels; inductor does. A plan that asks for it (``capture.compile``
or a segment's ``compile``, ``graphflow.plan.Compile``) gets each such graph segment's
callable wrapped here, in the allocate phase, while the uncompiled callable is kept for
verify's reference and the runtime's eager fallback. The rest of the pipeline does not
change, and that is the point: the compiled segments run on the plan's streams and
buffers, warm up, are captured into graphflow's own graphs, verified and rolled back
like any segment.

Why each piece is the way it is:

* **Compilation is a cold JIT.** Dynamo compiles a frame the first time its guards see
  a new specialization (a batch size, with ``dynamic: false``). The warmup of each
  descriptor runs the compiled callables eagerly, so every specialization is compiled
  and its kernels loaded before capture. A compile inside capture would launch nothing
  the graph records (or break the capture), so the JIT tripwires refuse it
  (``graphflow.engine.jit.Tripwires``) and this wrapper re-raises their ``CaptureError``.
* **No CUDA graphs of inductor's own.** Modes that capture them are refused by rule
  GF702; graphflow's capture is the only one.
* **Dynamo's recompile limit.** Dynamo keeps a few specializations per function (8) and
  silently runs the function uncompiled past them. Segments that share code (every
  layer's ``pre_attention``) share one cache, and graphflow needs one specialization per
  descriptor size: each call lifts the limit to what the plan needs.
* **A segment dynamo cannot compile** (a dynamo or backend error, a graph break with
  ``fullgraph``, or a frame dynamo skipped so that no graph was compiled at all) runs
  uncompiled from then on, with a ``CompileFallbackWarning`` naming it; under
  ``strict`` it fails the pipeline instead.
* **What is reported.** Each call that made dynamo compile is attributed to its segment:
  the frames compiled, the FX graphs handed to the backend, graph breaks and recompile
  reasons (dynamo's own words), the seconds the compiling calls took, and hits of
  torch's FX graph and AOT autograd caches (``TORCHINDUCTOR_CACHE_DIR``), which make a
  second start fast. ``CompileReport`` gathers them for the pipeline report.

Rollback and ``Engine.close()`` forget the compiled code (dynamo's cache on the
segments' functions), so nothing compiled for the run outlives it.
"""

from __future__ import annotations

import contextlib
import functools
import time
import types
import warnings
from collections.abc import Callable, Iterator, Mapping

import attrs

from graphflow.engine.context import Context
from graphflow.errors import CaptureError
from graphflow.events import Phase
from graphflow.engine.locus import Locus
from graphflow.plan import Compile

__all__ = ["CompileFallbackWarning", "CompileReport", "CompiledSegment", "SegmentCompile", "compile_report",
           "compile_segments"]

#: Specializations a segment's code may get beyond one per descriptor size (dynamo's own default).
_LIMIT_SLACK = 8


class CompileFallbackWarning(UserWarning):
    """A segment the plan compiles runs uncompiled: dynamo could not compile it."""


@attrs.frozen
class SegmentCompile:
    """What compiling one segment did.

    ``compiles``: frames dynamo compiled for it (one per specialization, plus one per
    frame resumed after a graph break); ``graphs``: FX graphs handed to the backend;
    ``recompiles``: dynamo's reason for each compile of a frame already compiled (a new
    batch size is one); ``seconds``: wall time of the calls that compiled; cache hits
    and misses of the FX graph and AOT autograd caches; ``fallback``: why the segment
    runs uncompiled, when it does; ``shares``: the first segment calling the same
    function (every layer's ``pre_attention``), whose compiled code this one reuses
    when dynamo's guards pass for it.
    """

    segment: str
    setting: Compile
    compiles: int = 0
    graphs: int = 0
    graph_breaks: tuple[str, ...] = ()
    recompiles: tuple[str, ...] = ()
    seconds: float = 0.0
    cache_hits: int = 0
    cache_misses: int = 0
    fallback: str | None = None
    shares: str | None = None

    @property
    def compiled(self) -> bool:
        return self.fallback is None

    @property
    def reused(self) -> bool:
        """It compiled nothing of its own: the code compiled for ``shares`` served it."""
        return self.compiled and self.shares is not None and self.compiles == 0

    def line(self) -> str:
        """One line: ``L0.pre: inductor, 3 compile(s), 3 graph(s), 2 recompile(s), 1.84 s``."""
        if self.fallback is not None:
            return f"{self.segment}: runs uncompiled ({self.fallback})"
        if self.reused:
            return f"{self.segment}: reuses the code compiled for {self.shares} (the same function)"
        setting = self.setting
        mode = f" {setting.mode}" if setting.backend == "inductor" and setting.mode != "default" else ""
        cache = (f", cache {self.cache_hits} hit(s)/{self.cache_misses} miss(es)"
                 if self.cache_hits or self.cache_misses else "")
        breaks = f", graph breaks: {'; '.join(self.graph_breaks)}" if self.graph_breaks else ""
        return (f"{self.segment}: {setting.backend}{mode}, {self.compiles} compile(s), {self.graphs} graph(s), "
                f"{len(self.recompiles)} recompile(s), {self.seconds:.2f} s{cache}{breaks}")


@attrs.frozen
class CompileReport:
    """Every compiled segment's record, in step order."""

    segments: tuple[SegmentCompile, ...]

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.segments)

    @property
    def fell_back(self) -> tuple[SegmentCompile, ...]:
        return tuple(s for s in self.segments if not s.compiled)

    def summary(self) -> str:
        """One line: ``compile: 18 segment(s) (inductor), 22 compile(s), 22 graph(s), ...``."""
        done = [s for s in self.segments if s.compiled]
        backends = ", ".join(sorted({s.setting.backend for s in done})) or "none"
        hits = sum(s.cache_hits for s in self.segments)
        misses = sum(s.cache_misses for s in self.segments)
        reused = sum(s.reused for s in done)
        fell = (f"; {len(self.fell_back)} uncompiled: {', '.join(s.segment for s in self.fell_back)}"
                if self.fell_back else "")
        return (f"compile: {len(done)} segment(s) ({backends}; {reused} reuse another's code), "
                f"{sum(s.compiles for s in done)} compile(s), {sum(s.graphs for s in done)} graph(s), "
                f"{sum(len(s.graph_breaks) for s in done)} graph break(s), "
                f"{sum(len(s.recompiles) for s in done)} recompile(s), {self.seconds:.2f} s in warmup, "
                f"FX/AOT cache {hits} hit(s)/{misses} miss(es){fell}")

    def lines(self) -> list[str]:
        """A line per segment that compiled something or runs uncompiled (reusers are in the summary)."""
        return [s.line() for s in self.segments if not s.reused]


class CompiledSegment:
    """A graph segment's callable under ``torch.compile``: what warmup, capture and the
    CPU backend's replay call. ``eager`` is the uncompiled callable."""

    def __init__(self, segment: str, fn: Callable[..., object], setting: Compile, *, limit: int, locus: Locus,
                 shares: str | None = None):
        import torch

        self.segment = segment
        self._locus = locus
        self.eager = fn
        self.setting = setting
        self._limit = limit
        kwargs: dict = {"backend": setting.backend, "dynamic": setting.dynamic, "fullgraph": setting.fullgraph}
        if setting.backend == "inductor":  # mode and options are inductor's; torch takes one or the other
            if setting.options:
                import torch._inductor

                kwargs["options"] = {**torch._inductor.list_mode_options(setting.mode, setting.dynamic),
                                     **setting.inductor_options}
            else:
                kwargs["mode"] = setting.mode
        self.compiled = torch.compile(fn, **kwargs)
        self._record = SegmentCompile(segment, setting, shares=shares)
        self._breaks: dict[str, None] = {}
        self._recompiles: list[str] = []

    @property
    def record(self) -> SegmentCompile:
        return attrs.evolve(self._record, graph_breaks=tuple(self._breaks), recompiles=tuple(self._recompiles))

    def __call__(self, *args):
        if self._record.fallback is not None:
            return self.eager(*args)
        if _watched():
            # Dynamo does not compile under a dispatch mode (the detectors' watch): the
            # watch checks the model's own code in warmup, then the compiled code runs
            # (and, in warmup, compiles) outside it. Capture records the compiled code only.
            if self._locus.here.phase is not Phase.CAPTURE:
                self.eager(*args)
            with _unwatched():
                return self._call(args)
        return self._call(args)

    def _call(self, args: tuple):
        import torch._dynamo

        before = _Probe.take()
        start = time.perf_counter()
        try:
            with torch._dynamo.config.patch(recompile_limit=self._limit,
                                            accumulated_recompile_limit=max(self._limit * 4, 256)):
                result = self.compiled(*args)
        except Exception as exc:
            refused = _refusal(exc)
            if refused is not None:  # a tripwire: a compile inside capture
                raise refused from None
            self._account(before, time.perf_counter() - start)
            if not isinstance(exc, torch._dynamo.exc.TorchDynamoException):
                raise  # the segment's own error, as it would raise uncompiled
            reason = _summary(exc)
            if self.setting.strict:
                raise self._refused(reason) from exc
            result = self.eager(*args)  # an error of the segment itself surfaces here, uncompiled
            self._fall_back(reason)
            return result
        if before.changed():
            failed = self._account(before, time.perf_counter() - start)
            if self._record.graphs == 0:  # every frame failed or traced nothing: it all ran eagerly
                reason = (f"dynamo skipped it: {failed[0].fail_type}: {_summary(failed[0].fail_reason or '')}"
                          if failed else "dynamo compiled no graph of it"
                          + (f" ({next(iter(self._breaks))})" if self._breaks else ""))
                if self.setting.strict:
                    raise self._refused(reason)
                self._fall_back(reason)
        return result

    def _account(self, before: _Probe, seconds: float) -> list:
        """Attribute what dynamo did during one call (``before`` to now) to this segment;
        returns the compiles that failed."""
        after = _Probe.take()
        record = self._record
        compiles, hits, misses, failed = 0, 0, 0, []
        for entry in after.metrics_since(before):
            if getattr(entry, "fail_type", None) is None:
                compiles += 1
            else:
                failed.append(entry)
            reason = getattr(entry, "recompile_reason", None)
            if reason:
                self._recompiles.append(_first_line(reason))
            hits += (getattr(entry, "inductor_fx_local_cache_hit_count", 0) or 0)
            hits += (getattr(entry, "aotautograd_local_cache_hit_count", 0) or 0)
            misses += (getattr(entry, "inductor_fx_local_cache_miss_count", 0) or 0)
            misses += (getattr(entry, "aotautograd_local_cache_miss_count", 0) or 0)
        for reason in after.breaks_since(before):
            self._breaks.setdefault(reason)
        self._record = attrs.evolve(record, compiles=record.compiles + compiles,
                                    graphs=record.graphs + after.graphs - before.graphs,
                                    seconds=record.seconds + seconds, cache_hits=record.cache_hits + hits,
                                    cache_misses=record.cache_misses + misses)
        return failed

    def _refused(self, reason: str) -> CaptureError:
        return CaptureError(f"torch.compile ({self.setting.backend}) cannot compile segment {self.segment}: {reason}",
                            segment=self.segment,
                            hint="make the segment traceable by dynamo (its graph break message says what it cannot "
                                 "trace), or drop strict to let it run uncompiled, or set compile: false on it")

    def _fall_back(self, reason: str) -> None:
        """Run uncompiled from now on, and say so."""
        self._record = attrs.evolve(self._record, fallback=reason)
        warnings.warn(CompileFallbackWarning(
            f"segment {self.segment}: torch.compile ({self.setting.backend}) cannot compile it ({reason}); it runs "
            "uncompiled, and is captured so"), stacklevel=3)


@attrs.frozen
class _Probe:
    """Dynamo's process-wide counters at one moment: the calls between two probes are
    one segment's (segments run one at a time in the thread that compiles)."""

    frames: int
    graphs: int
    breaks: Mapping[str, int]
    last_metric: object

    @classmethod
    def take(cls) -> _Probe:
        from torch._dynamo import utils

        counters = utils.counters
        metrics = utils._compilation_metrics
        return cls(counters["frames"]["total"], counters["stats"]["unique_graphs"], dict(counters["graph_break"]),
                   metrics[-1] if metrics else None)

    def changed(self) -> bool:
        from torch._dynamo import utils

        return utils.counters["frames"]["total"] != self.frames

    def metrics_since(self, before: _Probe) -> list:
        """Compilation metrics recorded after ``before`` (dynamo keeps the last 64)."""
        from torch._dynamo import utils

        entries = list(utils._compilation_metrics)
        if before.last_metric is None:
            return entries
        for index in range(len(entries) - 1, -1, -1):
            if entries[index] is before.last_metric:
                return entries[index + 1:]
        return entries

    def breaks_since(self, before: _Probe) -> list[str]:
        return [_first_line(reason) for reason, count in self.breaks.items() if count > before.breaks.get(reason, 0)]


def _watched() -> bool:
    """A Python dispatch mode is active (the detectors watch the call)."""
    import torch

    return torch._C._len_torch_dispatch_stack() > 0


@contextlib.contextmanager
def _unwatched() -> Iterator[None]:
    """Every torch function and dispatch mode set aside (and put back after), so dynamo
    compiles and the detectors see nothing of the compiled code (its autotuning
    synchronizes)."""
    import torch
    from torch.overrides import _pop_mode_temporarily
    from torch.utils._python_dispatch import _disable_current_modes

    from graphflow.engine.detectors import aside

    with contextlib.ExitStack() as stack:
        stack.enter_context(aside())  # and the detectors' synchronize wrappers
        for _ in range(torch._C._len_torch_function_stack()):
            stack.enter_context(_pop_mode_temporarily())
        stack.enter_context(_disable_current_modes())
        yield


def _first_line(text) -> str:
    lines = str(text).strip().splitlines()
    return lines[0].strip() if lines else ""


def _summary(error) -> str:
    """A dynamo error in one line: its first line, or the first two when the first only
    introduces the second (``backend='inductor' raised:``)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    text = f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]
    return text if len(text) <= 300 else text[:297] + "..."


def _refusal(exc: BaseException) -> CaptureError | None:
    """The tripwire's CaptureError in an exception's chain (dynamo wraps what a compile
    callback raises), as a fresh error naming the same place."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, CaptureError):
            return CaptureError(current.message, phase=current.phase, descriptor=current.descriptor,
                                segment=current.segment, rank=current.rank, hint=current.hint_text,
                                settings=current.settings)
        current = current.__cause__ or current.__context__
    return None


def _code_of(fn: Callable[..., object]) -> types.CodeType | None:
    """The code object dynamo caches a callable's compiled frames on."""
    code = getattr(fn, "__code__", None)
    if code is None:
        code = getattr(getattr(fn, "forward", None), "__code__", None)
    return code if isinstance(code, types.CodeType) else None


def compile_segments(ctx: Context, calls: Mapping[str, Callable[..., object]]) -> dict[str, Callable[..., object]]:
    """Each segment's callable as warmup and capture run it: its function wrapped in a
    ``CompiledSegment`` where the plan compiles it and ``RunOptions.compile`` allows,
    else as given. A ``SegmentCall`` (``graphflow.engine.execute``) keeps binding the
    buffers, keywords and return value around the model's function; the function is
    what is compiled."""
    settings = {s.name: setting for s in ctx.segments if (setting := ctx.plan.compile_of(s)) is not None}
    if not settings or not ctx.options.compile:
        return dict(calls)
    import torch._dynamo

    fns = {name: getattr(calls[name], "fn", calls[name]) for name in settings}
    sizes = len({d.size for d in ctx.descriptors}) or 1
    first: dict[types.CodeType, str] = {}  # code -> the first segment calling it
    sharing: dict[types.CodeType, int] = {}
    for name, fn in fns.items():
        code = _code_of(fn)
        if code is not None:
            first.setdefault(code, name)
            sharing[code] = sharing.get(code, 0) + 1
    default = torch._dynamo.config.recompile_limit
    wrapped = dict(calls)
    for name, setting in settings.items():
        code = _code_of(fns[name])
        # One specialization per size for every segment sharing the code, plus dynamo's own slack.
        limit = max(default, sizes * sharing.get(code, 1) + _LIMIT_SLACK)
        shares = first[code] if code is not None and first[code] != name else None
        with ctx.locus.segment(name):
            compiled = CompiledSegment(name, fns[name], setting, limit=limit, locus=ctx.locus, shares=shares)
        call = calls[name]
        wrapped[name] = attrs.evolve(call, fn=compiled) if attrs.has(type(call)) and hasattr(call, "fn") else compiled
    ctx.stack.push("forget the compiled segments' code", functools.partial(_forget, tuple(first)))
    return wrapped


def _forget(codes: tuple[types.CodeType, ...]) -> None:
    """Drop dynamo's cached frames of these functions (their compiled graphs with them)."""
    from torch._dynamo.eval_frame import reset_code

    for code in codes:
        reset_code(code)


def compile_report(fns: Mapping[str, Callable[..., object]]) -> CompileReport | None:
    """The compiled segments' records, or None when no segment is compiled."""
    found = (getattr(call, "fn", call) for call in fns.values())
    records = tuple(fn.record for fn in found if isinstance(fn, CompiledSegment))
    return CompileReport(records) if records else None
