"""One rank's capture session: where it is, what it traced, and the barriers it crosses.

Inside vLLM the plugin has no pipeline to listen to, only the calls it wraps; this
object is what those wrappers share. It keeps, for one rank:

* the site: family, descriptor and phase (``warmup``/``capture``), set by the runner
  hooks and read by the custom all-reduce hook, so each collective's trace event names
  them;
* graphflow's ``TraceLog`` (scopes ``world`` for phase boundaries and each TP group's
  members for its collectives) and, when tracing, a ``Tracer`` file per rank in
  graphflow's trace format, so ``graphflow trace diff`` reads it;
* a ``StoreBarrier`` per scope over the c10d store, crossed at every phase boundary
  (warmup and capture begin and end, per descriptor): ranks whose traces differ raise
  ``DivergenceError`` at the same barrier, naming the first differing call, instead of
  hanging in the next collective or in ``register_graph_buffers``;
* before the first of them, the settings check (``agree_settings``): ranks that run the
  plugin with different ``GRAPHFLOW_VLLM_*`` values fail at once, naming the variable,
  and one that never arrives (its worker runs without the plugin) is named at the
  timeout with what to check.

Its ``world`` is one engine's ranks (``group.engine_group``), not ``torch.distributed``'s.

Host work only: vLLM captures with ``capture_error_mode="global"``, so nothing here
touches CUDA, from this thread or another. No vLLM or torch import.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs

from graphflow.dist.barrier import StoreBarrier
from graphflow.errors import DivergenceError
from graphflow.dist.trace import ScopeState, TraceLog

__all__ = ["CaptureSession", "Site"]

_WORLD = "world"


@attrs.define
class Site:
    """Where this rank's capture is: the family, descriptor and phase being run."""

    family: str = "target"
    descriptor: Any = None
    mode: str | None = None
    phase: str | None = None


class CaptureSession:
    """A rank's trace and barriers for one capture (or profiling) run of vLLM.

    ``world`` is the ranks that capture together (one engine's); ``scope`` adds the
    groups inside it that must agree on their own calls (a TP group); a group with the
    world's members is the world scope. ``store`` is None at world size 1: nothing to
    agree with. ``log`` is the process's trace log (one per process, so a profiling run
    and the capture run that follows it write one trace file); ``namespace`` must differ
    between sessions sharing a store and be the same on every member.
    """

    def __init__(self, *, rank: int, world: Sequence[int], store: Any = None, log: TraceLog | None = None,
                 timeout_s: float = 60.0, namespace: str = "graphflow-vllm", agree_calls: bool = False):
        self.rank = rank
        self.world = tuple(sorted(world))
        self.log = log if log is not None else TraceLog(rank)
        self.tracer = self.log.sink
        self.site = Site()
        self.agree_calls = agree_calls
        self._store = store
        self._timeout_s = timeout_s
        self.namespace = namespace
        self._barriers: dict[str, StoreBarrier] = {}
        self._scopes: dict[str, tuple[int, ...]] = {_WORLD: self.world}
        self._calls: dict[int, int] = {}
        self.failed: str | None = None

    # -- scopes and barriers ---------------------------------------------------------------
    def scope(self, members: Sequence[int]) -> str:
        """The agreement scope of the ranks ``members`` (``world`` when they are all)."""
        members = tuple(sorted(members))
        if members == self.world:
            return _WORLD
        name = "ranks:" + "-".join(map(str, members))
        self._scopes.setdefault(name, members)
        return name

    def _barrier(self, scope: str) -> StoreBarrier | None:
        members = self._scopes[scope]
        if self._store is None or len(members) < 2:
            return None
        barrier = self._barriers.get(scope)
        if barrier is None:
            barrier = self._barriers[scope] = StoreBarrier(
                self._store, self.rank, members, timeout_s=self._timeout_s, namespace=f"{self.namespace}/{scope}")
        return barrier

    def _arrive(self, scope: str, label: str) -> None:
        barrier = self._barrier(scope)
        if barrier is None:
            return
        site = self.site
        try:
            barrier.arrive(label, self.log.state(scope), phase=site.phase, descriptor=site.descriptor)
        except DivergenceError as e:
            self.failed = str(e)
            raise

    def agree_settings(self, settings: Mapping[str, str]) -> None:
        """Every member runs the plugin with ``settings`` (variable -> value), or every
        member raises ``DivergenceError`` saying which variable differs on which ranks.

        A member that never arrives is one whose worker runs without the plugin, or a
        rank that stalled: after the timeout the error names it and says what to check.
        """
        if self._store is None or len(self.world) < 2:
            return
        text = json.dumps(dict(settings), sort_keys=True)
        self._store.set(self._settings_key(self.rank), text)
        barrier = StoreBarrier(self._store, self.rank, self.world, timeout_s=self._timeout_s,
                               namespace=f"{self.namespace}/settings/agree")
        digest = hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
        try:
            barrier.arrive("graphflow settings", ScopeState(0, digest, ()), phase=self.site.phase)
        except DivergenceError as error:
            self.failed = str(error)
            raise self._settings_error(error) from error

    def _settings_key(self, rank: int) -> str:
        return f"{self.namespace}/settings/{rank}"

    def _settings_error(self, error: DivergenceError) -> DivergenceError:
        """The barrier's error, said in settings: which variable differs, or who is missing."""
        seen = {r: json.loads(self._store.get(self._settings_key(r))) for r in self.world
                if self._store.check([self._settings_key(r)])}
        names = sorted({name for values in seen.values() for name in values})
        lines = []
        for name in names:
            holders: dict[str, list[int]] = {}
            for r, values in seen.items():
                holders.setdefault(values.get(name, "(unset)"), []).append(r)
            if len(holders) > 1:
                lines.append(f"{name} is " + " and ".join(f"{value!r} on rank(s) {_ranks(ranks)}"
                                                          for value, ranks in holders.items()))
        if lines:
            minority = sorted(_minority(seen, names))
            return DivergenceError(
                f"ranks of one engine run the vLLM plugin with different settings: {'; '.join(lines)}",
                ranks=minority, rank=self.rank, phase=self.site.phase,
                hint="give every worker the same GRAPHFLOW_VLLM_* values (under Ray a node's own environment wins "
                     "over the driver's: set them where the Ray nodes start, or nowhere but the driver)")
        missing = tuple(r for r in self.world if r not in seen)
        if missing and error.ranks:
            return DivergenceError(
                f"rank(s) {_ranks(missing)} never started graphflow's capture within {self._timeout_s:g} s: "
                f"their workers run without the plugin, or stalled ({error.message})",
                ranks=missing, rank=self.rank, phase=self.site.phase,
                hint="set GRAPHFLOW_VLLM=1 where every worker starts: under Ray, vLLM copies only some variables "
                     "to its workers (the plugin adds GRAPHFLOW_ to VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY in a "
                     "driver where it is on), and a node's own GRAPHFLOW_VLLM=0 wins over the driver's")
        return error

    # -- events ----------------------------------------------------------------------------
    def boundary(self, event: str, **fields: Any) -> dict:
        """A phase boundary: record it, flush the trace, and agree with every scope's ranks."""
        site = self.site
        record = self.log.record({"event": event, "phase": site.phase, "family": site.family, "mode": site.mode,
                                  "descriptor": _text(site.descriptor), **fields})
        if self.tracer is not None:
            self.tracer.flush()  # on disk before waiting: a rank killed in a hang leaves its trace
        label = f"{event} {site.phase or ''} {_text(site.descriptor) or ''}".strip()
        for scope in list(self._scopes):
            self._arrive(scope, label if scope == _WORLD else f"{label} [{scope}]")
        return record

    def count_call(self, communicator: Any) -> int:
        """The communicator's call counter in this session (0, 1, 2, ...): the same on every
        rank that made the same calls, whatever the communicator did before."""
        counter = self._calls.get(id(communicator), 0)
        self._calls[id(communicator)] = counter + 1
        return counter

    def record_call(self, scope: str, fields: Mapping[str, Any]) -> dict:
        """One collective call, in ``scope`` (and the world's, when they are the same ranks)."""
        site = self.site
        event = self.log.record({"event": "collective", "phase": site.phase, "family": site.family,
                                 "mode": site.mode, "descriptor": _text(site.descriptor), **fields}, (scope,))
        return event

    def agree_call(self, scope: str, label: str) -> None:
        """Before a collective that communicates: every member is about to make the same call."""
        if self.agree_calls:
            self._arrive(scope, label)

    def abandon(self, reason: str) -> None:
        """This rank stops (its capture failed): the others fail at their next barrier, at once."""
        self.failed = reason
        for scope, barrier in self._barriers.items():
            with contextlib.suppress(Exception):  # the store may be gone too; the timeout remains
                barrier.abandon(reason, self.log.state(scope))
        for scope in self._scopes:
            if scope not in self._barriers and self._barrier(scope) is not None:
                with contextlib.suppress(Exception):
                    self._barriers[scope].abandon(reason, self.log.state(scope))

    # -- the site --------------------------------------------------------------------------
    @contextlib.contextmanager
    def at(self, **where: Any) -> Iterator[Site]:
        """Set parts of the site (family, descriptor, mode, phase) for a block, then restore them."""
        site = self.site
        saved = attrs.asdict(site, recurse=False)
        for key, value in where.items():
            setattr(site, key, value)
        try:
            yield site
        finally:
            for key, value in saved.items():
                setattr(site, key, value)

    def flush(self) -> None:
        if self.tracer is not None:
            self.tracer.flush()


def _minority(seen: Mapping[int, Mapping[str, str]], names: Sequence[str]) -> list[int]:
    """The ranks outside the largest group of identical settings (ties: the lowest ranks' group)."""
    groups: dict[str, list[int]] = {}
    for r, values in sorted(seen.items()):
        groups.setdefault(json.dumps([values.get(n) for n in names]), []).append(r)
    largest = max(groups.values(), key=len)
    return [r for r in seen if r not in largest]


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks))


def _text(value: Any) -> str | None:
    return None if value is None else str(value)
