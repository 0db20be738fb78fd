"""Which graphs served which steps: the silent failure of a serving engine is graphs that
were captured and never dispatched, or batches that keep falling back to eager.

A ``Coverage`` counts, per key, the steps served on its graph, the tokens they carried
and the padded ones, and each eager step with why it was eager; and how many keys were
compared with the engine's eager step before serving and on their first batch
(``checks``, the engine's ``Checks``): what a server reads to know nothing serves
unchecked. ``as_dict`` is what a server exports; ``table`` is printed at the end of a run;
``warnings`` names a key captured and never used, and a fallback rate above
``FALLBACK_WARN``.
"""

from __future__ import annotations

import collections
import enum
import threading

import attrs

from graphflow.engine.first_use import Checks
from graphflow.engine.lazy import KeyState
from graphflow.integrations.hf.batching.keys import ServingKey

__all__ = ["FALLBACK_WARN", "Coverage", "Fallback", "KeyCoverage"]

#: The share of steps served eagerly above which a run is warned about.
FALLBACK_WARN = 0.01


class Fallback(enum.StrEnum):
    """Why a step ran eagerly."""

    NO_GRAPH_YET = "no graph yet"
    NOT_PLANNED = "key never captured"
    FAILED = "capture failed"


@attrs.define
class KeyCoverage:
    key: ServingKey
    graph_steps: int = 0
    eager: collections.Counter = attrs.field(factory=collections.Counter)
    tokens: int = 0
    padded: int = 0
    failure: str | None = None

    @property
    def steps(self) -> int:
        return self.graph_steps + sum(self.eager.values())


class Coverage:
    """Counts, safe to read from another thread while the engine serves.

    ``states`` is where each key stands (``KeyState``): the lazy-capture thread's own
    table when capture is lazy, so that what it writes is what coverage reads."""

    def __init__(self, keys: tuple[ServingKey, ...], states: dict[ServingKey, KeyState] | None = None) -> None:
        self._lock = threading.Lock()
        self._keys: dict[ServingKey, KeyCoverage] = {key: KeyCoverage(key) for key in keys}
        self.states = states if states is not None else dict.fromkeys(keys, KeyState.PLANNED)
        self._checks = collections.Counter()  # before_ready, on_first_use, failed

    def entry(self, key: ServingKey) -> KeyCoverage:
        with self._lock:
            found = self._keys.get(key)
            if found is None:
                found = self._keys[key] = KeyCoverage(key)
                self.states.setdefault(key, KeyState.UNPLANNED)
            return found

    def state(self, key: ServingKey) -> KeyState:
        return self.states.get(key, KeyState.UNPLANNED)

    def mark(self, key: ServingKey, state: KeyState, failure: str | None = None) -> None:
        """A foreground capture's verdict on ``key`` (a lazy one's states are the thread's)."""
        entry = self.entry(key)
        self.states[key] = state
        entry.failure = failure

    def checked(self, key: ServingKey, *, before_ready: bool, passed: bool) -> None:
        """``key``'s replay was compared with the engine's eager step: before ``serve``
        returned (whatever it found), or on its first batch (live, or failed there)."""
        with self._lock:
            self._checks["before_ready" if before_ready else "on_first_use" if passed else "failed"] += 1

    @property
    def checks(self) -> Checks:
        """Keys compared before serving, on their first batch since, captured and still
        waiting for theirs, and found wrong there."""
        with self._lock:
            counts = dict(self._checks)
        waiting = sum(state is KeyState.CAPTURED for state in list(self.states.values()))
        return Checks(counts.get("before_ready", 0), counts.get("on_first_use", 0), waiting, counts.get("failed", 0))

    def served(self, key: ServingKey, tokens: int, fallback: Fallback | None) -> None:
        entry = self.entry(key)
        with self._lock:
            if fallback is None:
                entry.graph_steps += 1
            else:
                entry.eager[fallback] += 1
            entry.tokens += tokens
            entry.padded += key.q - tokens

    def as_dict(self) -> dict:
        """Per key (its ``str``): state, steps on its graph, eager steps by reason, tokens,
        padded tokens, why it failed; the totals; the keys with a graph (``captured``: live,
        or waiting for their first batch's check) and the ``live`` ones; and the checks
        (``checks``)."""
        with self._lock:
            entries = list(self._keys.values())
        state = {e.key: self.state(e.key) for e in entries}
        keys = {str(e.key): {"state": str(state[e.key]), "graph_steps": e.graph_steps,
                             "eager_steps": {str(reason): n for reason, n in e.eager.items()},
                             "tokens": e.tokens, "padded_tokens": e.padded, "failure": e.failure}
                for e in entries}
        steps = sum(e.steps for e in entries)
        eager = sum(sum(e.eager.values()) for e in entries)
        # A graph captured and never replayed served nothing for its memory, checked or not.
        unused = [str(e.key) for e in entries if state[e.key] in (KeyState.LIVE, KeyState.CAPTURED)
                  and e.graph_steps == 0]
        # A captured key not checked yet has its graph as much as a live one: a step that
        # batches to it replays it (and checks it).
        captured = sum(state[e.key] in (KeyState.LIVE, KeyState.CAPTURED) for e in entries)
        return {"keys": keys, "steps": steps, "graph_steps": steps - eager, "eager_steps": eager,
                "fallback_rate": eager / steps if steps else 0.0, "captured": captured,
                "live": sum(state[e.key] is KeyState.LIVE for e in entries), "unused": unused,
                "checks": attrs.asdict(self.checks)}

    def warnings(self) -> list[str]:
        summary = self.as_dict()
        found = []
        if summary["unused"]:
            found.append(f"{len(summary['unused'])} captured graph(s) never served a step: "
                         f"{', '.join(summary['unused'][:4])}{' ...' if len(summary['unused']) > 4 else ''} "
                         "(their memory served nothing: narrow the padding intervals' range or capture lazily)")
        if summary["steps"] and summary["fallback_rate"] > FALLBACK_WARN:
            reasons = collections.Counter()
            for entry in summary["keys"].values():
                reasons.update(entry["eager_steps"])
            found.append(f"{summary['eager_steps']} of {summary['steps']} steps ran eagerly "
                         f"({summary['fallback_rate']:.1%}): "
                         + ", ".join(f"{n} {reason}" for reason, n in reasons.most_common()))
        return found

    def table(self) -> str:
        """Plain text, one row per key that served or failed, busiest first."""
        with self._lock:
            entries = sorted(self._keys.values(), key=lambda e: (-e.steps, e.key))
        rows = [("key", "state", "graph steps", "eager steps (why)", "tokens", "padded")]
        for e in entries:
            state = self.state(e.key)
            if e.steps == 0 and state in (KeyState.PLANNED, KeyState.LIVE, KeyState.CAPTURED):
                continue
            why = ", ".join(f"{n} {reason}" for reason, n in e.eager.items()) or "-"
            rows.append((str(e.key), str(state) if e.failure is None else f"failed: {e.failure}",
                         str(e.graph_steps), why, str(e.tokens), f"{e.padded / max(e.tokens + e.padded, 1):.0%}"))
        summary = self.as_dict()
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        lines.append(f"{summary['graph_steps']} of {summary['steps']} steps on graphs, "
                     f"{summary['live']} keys live, {len(summary['unused'])} never used")
        return "\n".join(lines)
