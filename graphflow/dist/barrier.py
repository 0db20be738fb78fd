"""A phase barrier through the c10d store: ranks agree, or every rank gets a report.

Why the store and not a collective: when ranks have already diverged, a collective on
their process group is exactly what hangs (gloo pairs mismatched calls wrongly and
every rank fails only at the group's timeout; NCCL just waits). The store is a
separate key-value service, so a barrier over it still works, and ``store.wait`` takes
a timeout.

One arrival, for barrier number ``seq`` of a scope:

1. publish ``(label, count, digest)`` under ``{namespace}/{seq}/{rank}``: the label of
   the boundary or call about to happen, and the scope's event count and running hash
   (``graphflow.dist.trace.TraceLog``);
2. wait, up to ``timeout_s``, for every member's key; a member missing at the timeout
   raises ``DivergenceError`` naming it (it crashed, hangs, or went another way);
3. read them all; if they differ, every member publishes its last events and reads the
   others', finds the first differing event, and raises ``DivergenceError`` naming the
   ranks that differ from the majority and that event. All members see the same
   payloads, so all of them raise, at the same barrier.

A member that gives up at the timeout first claims each missing member's key with a
"gave up" record, and every member publishes with ``compare_set`` (set only if the key
is still absent). The store runs one operation at a time, so each key ends up holding
either its member's arrival or the claim, never both: a stalled rank that comes back
finds the claim where its arrival would go and raises ``DivergenceError`` itself,
instead of passing a barrier the others abandoned and entering a collective alone (a
lone gloo collective pairs with the others' next one and aborts the process group).
The members still waiting wake up on the claim and raise at once.

A rank that fails for another reason calls ``abandon`` so the others fail at once
instead of at the timeout.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from typing import Any

from graphflow.errors import DivergenceError
from graphflow.dist.trace import UNKNOWN, ScopeState, describe, first_difference, majority

__all__ = ["StoreBarrier", "DEFAULT_TIMEOUT_S"]

#: The barrier timeout when the plan does not set ``capture.barrier_timeout_s``.
DEFAULT_TIMEOUT_S = 60.0

_ABANDONED = "abandoned"
_GAVE_UP = "gave up"


class StoreBarrier:
    """Barriers among ``members`` over ``store``, numbered in the order they are reached.

    ``namespace`` separates independent barrier sequences that share one store (two
    pipelines, two channel groups). Every member must build its barrier with the same
    namespace and members.
    """

    def __init__(self, store, rank: int, members: Sequence[int], *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 namespace: str = "graphflow"):
        if rank not in members:
            raise ValueError(f"rank {rank} is not a member of barrier {namespace!r} (members {list(members)})")
        self.store = store
        self.rank = rank
        self.members = tuple(sorted(members))
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.namespace = namespace
        self.seq = 0

    def __repr__(self) -> str:
        return f"StoreBarrier({self.namespace!r}, rank={self.rank}, members={list(self.members)}, seq={self.seq})"

    def _key(self, seq: int, rank: int, part: str = "") -> str:
        return f"{self.namespace}/{seq}/{rank}{part}"

    def arrive(self, label: str, state: ScopeState, **where: Any) -> None:
        """Agree with the other members on ``state`` at ``label``, or raise DivergenceError.

        ``where`` (phase, descriptor, segment) goes into the error.
        """
        if len(self.members) == 1:
            self.seq += 1
            return
        seq = self.seq
        self.seq += 1
        mine = {"label": label, "count": state.count, "digest": state.digest}
        held = self._publish(seq, mine)
        if held != mine:
            self._late(seq, label, held, where)
        keys = [self._key(seq, r) for r in self.members]
        self._wait(keys, seq, label, state, where)
        payloads = dict(zip(self.members, (json.loads(v) for v in self.store.multi_get(keys))))
        if seq > 0:
            self.store.delete_key(self._key(seq - 1, self.rank))
        if all(p == mine for p in payloads.values()):
            return
        missing = tuple(r for r, p in payloads.items() if p["label"] == _GAVE_UP)
        if missing:
            self._missing(missing, seq, label, state, where)
        self._disagree(seq, label, state, payloads, where)

    def abandon(self, reason: str, state: ScopeState) -> None:
        """Tell the other members this rank will not arrive again (it is rolling back)."""
        if len(self.members) == 1:
            return
        seq = self.seq
        self.seq += 1
        mine = {"label": _ABANDONED, "count": state.count, "digest": _ABANDONED, "reason": reason}
        self.store.set(self._key(seq, self.rank, "/window"), json.dumps(_window(state)))
        self._publish(seq, mine)  # where another member already gave up on this rank, it knows

    def _publish(self, seq: int, payload: dict, rank: int | None = None) -> dict:
        """Set ``rank``'s key (this rank's by default) of barrier ``seq`` unless it is set
        already; what the key holds afterwards."""
        text = json.dumps(payload)
        held = self.store.compare_set(self._key(seq, self.rank if rank is None else rank), "", text)
        return payload if held == text.encode() else json.loads(held)

    def _wait(self, keys: list[str], seq: int, label: str, state: ScopeState, where: dict) -> None:
        try:
            self.store.wait(keys, self.timeout)
        except RuntimeError as e:  # c10d raises DistStoreError (a RuntimeError) on timeout
            claim = {"label": _GAVE_UP, "by": self.rank}
            missing = tuple(r for r, key in zip(self.members, keys) if not self.store.check([key])
                            and self._publish(seq, claim, r)["label"] == _GAVE_UP)
            if missing:  # else everyone arrived just as the wait gave up
                self._missing(missing, seq, label, state, where, cause=e)

    def _missing(self, missing: tuple[int, ...], seq: int, label: str, state: ScopeState, where: dict,
                 cause: BaseException | None = None) -> None:
        last = state.window[-1][1] if state.window else None
        raise DivergenceError(
            f"rank(s) {_ranks(missing)} did not reach barrier {label!r} (#{seq}) within "
            f"{self.timeout.total_seconds():g} s; rank {self.rank}'s last event: {describe(last)}",
            ranks=missing, event=last, rank=self.rank, **_where(where),
            hint="the missing ranks crashed, hang, or took another path: compare the traces with "
                 "'graphflow trace diff' (set GRAPHFLOW_TRACE=DIR)",
        ) from cause

    def _late(self, seq: int, label: str, claim: dict, where: dict) -> None:
        """This rank arrived after another member gave up waiting for it: every other member
        has raised or will at this barrier, so this one must too, before communicating."""
        raise DivergenceError(
            f"rank {self.rank} reached barrier {label!r} (#{seq}) too late: rank {claim['by']} had given up "
            f"waiting for it after {self.timeout.total_seconds():g} s, so every rank abandons the pipeline",
            ranks=(self.rank,), rank=self.rank, **_where(where),
            hint="this rank was slower than capture.barrier_timeout_s (a stall, a debugger, a slow first "
                 "compile): find what held it up, or raise the timeout",
        )

    def _disagree(self, seq: int, label: str, state: ScopeState, payloads: dict, where: dict) -> None:
        self.store.set(self._key(seq, self.rank, "/window"), json.dumps(_window(state)))
        window_keys = [self._key(seq, r, "/window") for r in self.members]
        try:
            self.store.wait(window_keys, self.timeout)
            windows = dict(zip(self.members, (json.loads(v) for v in self.store.multi_get(window_keys))))
        except RuntimeError:
            windows = {r: json.loads(self.store.get(k)) for r, k in zip(self.members, window_keys)
                       if self.store.check([k])}
        abandoned = {r: p.get("reason", "") for r, p in payloads.items() if p["label"] == _ABANDONED}
        groups: dict[tuple, list[int]] = {}
        for r, p in payloads.items():
            groups.setdefault((p["label"], p["count"], p["digest"]), []).append(r)
        normal = majority(list(groups.values()))
        differing = tuple(r for r in self.members if r not in normal)
        if abandoned:
            differing = tuple(sorted(abandoned))
        index, events = _first_differing(windows)
        culprit = differing[0]
        event = events.get(culprit) or next((e for e in events.values() if e is not None), None)
        lines = [f"ranks diverged at barrier {label!r} (#{seq}): rank(s) {_ranks(differing)} differ from "
                 f"rank(s) {_ranks(tuple(r for r in self.members if r not in differing))}"]
        for r, reason in sorted(abandoned.items()):
            lines.append(f"rank {r} abandoned the pipeline: {reason}")
        if index is None:
            lines.append("the first differing event is older than the published windows")
        else:
            lines.append(f"first differing event (index {index} in this scope):")
            lines.extend(f"  rank {r}: {describe(events.get(r))}" for r in self.members if r in windows)
        raise DivergenceError("\n".join(lines), ranks=differing, event=event, rank=self.rank, **_where(where),
                              hint="compare the full traces with 'graphflow trace diff' (set GRAPHFLOW_TRACE=DIR)")


def _window(state: ScopeState) -> dict:
    return {"count": state.count, "events": [[i, e] for i, e in state.window]}


def _first_differing(windows: dict[int, dict]) -> tuple[int | None, dict]:
    """The first scope index where the published windows disagree, and each rank's event there.

    A rank whose count is at or below an index has no event there (its trace is
    shorter); an index older than a rank's window is unknown for it and not compared.
    """
    if not windows:
        return None, {}
    known = {r: {i: e for i, e in w["events"]} for r, w in windows.items()}
    ranks = list(windows)
    start = min((i for events in known.values() for i in events), default=min(w["count"] for w in windows.values()))
    stop = max(w["count"] for w in windows.values()) + 1
    sequences = [[known[r][i] if i in known[r] else None if i >= windows[r]["count"] else UNKNOWN
                  for i in range(start, stop)] for r in ranks]
    found = first_difference(sequences, offset=start)
    if found is None:
        return None, {}
    return found.index, {r: e for r, e in zip(ranks, found.events)
                         if sequences[ranks.index(r)][found.index - start] is not UNKNOWN}


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def _where(where: dict) -> dict:
    return {k: where[k] for k in ("phase", "descriptor", "segment") if where.get(k) is not None}
