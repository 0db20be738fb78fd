"""Fork/join over streams: which segment waits for which, derived from the dataflow.

A capture region or an eager step is a sequence of segments, each on a stream. Work on
one stream runs in order; work on different streams runs concurrently unless an event
orders it. This module decides, from the plan's ordering, the fewest events that keep
every dependency while letting independent branches overlap. It imports no torch: the
pipeline turns a ``Schedule`` into backend calls, and tests check it on plain data.

How a sequence runs (``Schedule``):

1. the **origin** is the first segment's stream (the capture stream of a region);
2. **fork**: every other stream the sequence uses waits for the origin at the start,
   which joins it into a capture and orders it after earlier work in an eager run;
3. each segment first waits for the events of the segments it depends on that ran on
   other streams (``Step.waits``), runs, then records its event if anyone waits on it;
4. **join**: the origin waits for the last segment of every other stream that it does
   not already follow, so the sequence ends on the origin (a capture with unjoined work
   cannot end).

Dependencies (``dependencies``) follow the rule ``Plan.dag()`` uses (a buffer is versioned
at each write: a reader follows the writer of the version it reads, RAW; a writer
follows the readers of the version it replaces, WAR; ``after`` entries), plus what
concurrency adds: a writer follows the previous writer of the buffer (WAW, which the
DAG leaves out because nothing observes it when segments run one by one), and buffers
are compared by storage, so a view (``alias_of``) conflicts with its target.

Waits are reduced: one per other stream at most (an event recorded later on a stream
covers everything before it there), none for an edge that the stream order or an
earlier wait already covers (the segments' known predecessors are tracked as vector
clocks, one latest position per stream).
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Iterable, Sequence

import attrs

from graphflow.plan import Plan, Segment, dataflow_edges

__all__ = ["Dependency", "Hazard", "Schedule", "Step", "build_schedule", "dependencies"]


class Hazard(enum.Enum):
    """Why one segment must follow another."""

    RAW = "raw"  # reads what the other wrote
    WAR = "war"  # overwrites what the other read
    WAW = "waw"  # overwrites what the other wrote
    AFTER = "after"  # declared with ``after``


@attrs.frozen
class Dependency:
    """``target`` may start only once ``source`` has finished."""

    source: str
    target: str
    hazard: Hazard
    buffer: str | None = None


@attrs.frozen
class Step:
    """One segment of a schedule.

    ``waits`` names earlier segments on other streams whose events this one waits on
    before it starts (at most one per stream); ``event`` is the slot of the event it
    records when it finishes, or None when nobody waits on it.
    """

    name: str
    stream: Hashable
    waits: tuple[str, ...] = ()
    event: int | None = None


@attrs.frozen
class Schedule:
    """How a sequence of segments runs over its streams (see the module docstring).

    ``events`` gives the stream each event slot is recorded on, slot 0 being the fork
    event (recorded on the origin) when there is a fork: a run needs that many events,
    each on its stream's device. ``join`` names the segments the origin waits on at the
    end, each the last of its stream.
    """

    origin: Hashable | None
    steps: tuple[Step, ...]
    fork: tuple[Hashable, ...]
    join: tuple[str, ...]
    events: tuple[Hashable, ...]

    @property
    def fork_event(self) -> int | None:
        return 0 if self.fork else None

    def step(self, name: str) -> Step:
        return next(s for s in self.steps if s.name == name)


def dependencies(plan: Plan, segments: Sequence[Segment]) -> tuple[Dependency, ...]:
    """Every ordering among ``segments`` (in run order) that concurrent execution must keep.

    ``Plan.dag``'s edges (``graphflow.plan.dataflow_edges``) plus write-after-write, with
    buffers compared by storage; computed over the sequence itself, so a segment left
    out (another rank's, another region's) neither adds an edge nor hides one: on this
    rank, a reader depends on the segment that last wrote the storage here.
    """
    found: dict[tuple[str, str, Hazard], Dependency] = {}
    edges = dataflow_edges(segments, storage=plan.storage, waw=True)
    for source, target, kind, buffer, _ in edges:
        found.setdefault((source, target, Hazard(kind)), Dependency(source, target, Hazard(kind), buffer))
    return tuple(found.values())


def build_schedule(names: Sequence[str], streams: Sequence[Hashable],
                   edges: Iterable[Dependency | tuple[str, str]]) -> Schedule:
    """The schedule of ``names`` (in run order), segment ``i`` on ``streams[i]``.

    ``edges`` are (source, target) pairs or ``Dependency`` objects; an edge naming a
    segment outside ``names``, or pointing backwards, is a caller error (ValueError).
    """
    if len(names) != len(streams):
        raise ValueError(f"{len(names)} segments but {len(streams)} streams")
    position = {name: i for i, name in enumerate(names)}
    if len(position) != len(names):
        raise ValueError("segment names in a schedule must be unique")
    sources: list[set[int]] = [set() for _ in names]
    for edge in edges:
        source, target = (edge.source, edge.target) if isinstance(edge, Dependency) else edge
        if source not in position or target not in position:
            raise ValueError(f"edge {source} -> {target} names a segment outside the sequence")
        if position[source] >= position[target]:
            raise ValueError(f"edge {source} -> {target} points backwards in the sequence")
        sources[position[target]].add(position[source])
    if not names:
        return Schedule(None, (), (), (), ())
    origin = streams[0]
    fork = tuple(dict.fromkeys(s for s in streams if s != origin))
    # clock[s]: for the work issued so far on stream s, the latest position known finished
    # before it, per stream. A stream starts after the fork: it knows nothing yet.
    clock: dict[Hashable, dict[Hashable, int]] = {s: {} for s in (origin, *fork)}
    done: list[dict[Hashable, int]] = []  # per segment, what is known finished once it is
    waits: list[tuple[int, ...]] = []
    waited: set[int] = set()
    for i, stream in enumerate(streams):
        known = dict(clock[stream])
        chosen = []
        needed = sorted((j for j in sources[i] if streams[j] != stream), reverse=True)
        for j in needed:  # latest first: waiting on it may cover the earlier ones
            if known.get(streams[j], -1) >= j:
                continue
            chosen.append(j)
            waited.add(j)
            for other, latest in done[j].items():
                if latest > known.get(other, -1):
                    known[other] = latest
        known[stream] = i
        clock[stream] = known
        done.append(known)
        waits.append(tuple(sorted(chosen)))
    last = {s: max(i for i, t in enumerate(streams) if t == s) for s in fork}
    join = tuple(names[last[s]] for s in fork if clock[origin].get(s, -1) < last[s])
    recorders = waited | {position[name] for name in join}
    slots: list[Hashable] = [origin] if fork else []
    steps = []
    for i, name in enumerate(names):
        event = None
        if i in recorders:
            event = len(slots)
            slots.append(streams[i])
        steps.append(Step(name, streams[i], tuple(names[j] for j in waits[i]), event))
    return Schedule(origin, tuple(steps), fork, join, tuple(slots))
