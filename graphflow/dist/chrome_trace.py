"""Per-rank capture traces as one Chrome trace: the JSON that Perfetto and chrome://tracing open.

``graphflow trace diff`` names the first event where ranks differ; a timeline shows the
rest at a glance: how long each phase and descriptor took on each rank, where the
collectives fell, and which rank went its own way or stopped. The output is the Trace
Event Format's JSON object form (the one ``torch.profiler`` exports):

* one process per rank (``pid``: the rank), with one thread, ``capture pipeline``:
  ``process_name`` / ``thread_name`` metadata (``ph: "M"``) name them, and a rank that
  diverged or stalled says so in its process name;
* the pipeline, each phase, descriptor and region as complete events (``ph: "X"``,
  ``ts`` and ``dur`` in microseconds from the first event of any rank), nested as they
  ran; a span whose end event never came (a rollback, a rank killed in a hang) ends at
  the rank's last event and says so in its ``args``;
* every collective as a thread instant (``ph: "i"``, ``s: "t"``) named ``op channel``,
  with its counter ``n``, path, group, shape and segment in ``args``; rollbacks too;
* the first divergence (``graphflow.dist.trace.diff_traces``): an instant on each rank at the
  event ``trace diff`` names (``cat: "divergence"``), and one global instant (``s: "g"``)
  that draws a line across every rank.

Timestamps are the ranks' wall clocks (``time.time()``), comparable on one host; across
hosts they are as close as the clocks are. This module imports no torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from graphflow.dist.trace import comparable, describe, diff_traces, incomplete

__all__ = ["chrome_trace"]

#: Begin and end events of the spans, and what names a span.
_BEGIN = {"pipeline_begin": "pipeline", "phase_begin": "phase", "descriptor_begin": "descriptor",
          "region_begin": "region"}
_END = {"pipeline_end": "pipeline", "phase_end": "phase", "descriptor_end": "descriptor", "region_end": "region"}
#: A trace that ends with one of these finished (committed, or rolled back); any other last event means the
#: rank stopped writing in the middle: it stalled, or was killed.
_TERMINAL = frozenset({"pipeline_end", "rollback"})
_TID = 0


def chrome_trace(traces: Sequence[Sequence[Mapping[str, Any]]],
                 sources: Sequence[str | os.PathLike] | None = None) -> dict:
    """The Chrome trace (a JSON-ready dict) of per-rank traces, one process per rank.

    ``sources`` name the files the traces came from (kept in ``otherData``).
    """
    pids = _pids(traces)
    timed = any("ts" in e for t in traces for e in t)
    start = min((float(e["ts"]) for t in traces for e in t if "ts" in e), default=0.0)

    def micros(event: Mapping[str, Any]) -> float:
        # A trace written without timestamps is laid out by its counter, one microsecond an event.
        if timed and "ts" in event:
            return round((float(event["ts"]) - start) * 1e6, 3)
        return float(event.get("n", 0))

    found = diff_traces(traces) if len(traces) > 1 else None
    out: list[dict] = []
    for i, (pid, trace) in enumerate(zip(pids, traces)):
        out.extend(_rank_events(pid, trace, micros))
        out.extend(_metadata(pid, i, trace, found))
    divergence = None
    if found is not None:
        divergence = _divergence(found, pids, traces, micros)
        out.extend(divergence.pop("marks"))
    out.sort(key=lambda e: (e["ph"] != "M", e["pid"], e["ts"], -e.get("dur", 0.0)))
    other: dict[str, Any] = {"source": "graphflow capture trace", "ranks": len(traces),
                             "clock": "wall clock (time.time)" if timed else "event counter (no timestamps)"}
    if sources is not None:
        other["traces"] = [str(s) for s in sources]
    if divergence is not None:
        other["first_divergence"] = divergence
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": other}


def _pids(traces: Sequence[Sequence[Mapping[str, Any]]]) -> list[int]:
    """Each trace's rank as its process id; the trace's position when ranks are missing or repeat."""
    ranks = [t[0].get("rank") if t else None for t in traces]
    if all(isinstance(r, int) for r in ranks) and len(set(ranks)) == len(ranks):
        return list(ranks)
    return list(range(len(traces)))


def _span_name(kind: str, event: Mapping[str, Any]) -> str:
    if kind == "pipeline":
        return "pipeline"
    value = event.get(kind)
    return str(value) if value is not None else kind


def _args(event: Mapping[str, Any]) -> dict:
    return {k: v for k, v in event.items() if k not in ("ts", "rank") and v is not None}


def _rank_events(pid: int, trace: Sequence[Mapping[str, Any]], micros) -> list[dict]:
    """A rank's spans (begin/end pairs nested as they ran) and instants."""
    out: list[dict] = []
    stack: list[tuple[str, Mapping[str, Any]]] = []

    def close(kind: str, begin: Mapping[str, Any], end: Mapping[str, Any], complete: bool) -> None:
        ts = micros(begin)
        args = {"n": begin.get("n"), **{k: begin[k] for k in ("phase", "descriptor", "region") if begin.get(k)}}
        if complete:
            args["end_n"] = end.get("n")
        else:
            args["incomplete"] = f"no {kind}_end: the span ends at #{end.get('n')} {end.get('event')}"
        out.append({"name": _span_name(kind, begin), "cat": kind, "ph": "X", "ts": ts,
                    "dur": max(0.0, round(micros(end) - ts, 3)), "pid": pid, "tid": _TID, "args": args})

    for event in trace:
        name = event.get("event")
        if name in _BEGIN:
            stack.append((_BEGIN[name], event))
        elif name in _END:
            kind = _END[name]
            if any(k == kind for k, _ in stack):
                while stack:
                    open_kind, begin = stack.pop()
                    close(open_kind, begin, event, open_kind == kind)
                    if open_kind == kind:
                        break
        else:
            out.append(_instant(pid, event, micros))
    last = trace[-1] if trace else None
    while stack:
        kind, begin = stack.pop()
        close(kind, begin, last, False)
    return out


def _instant(pid: int, event: Mapping[str, Any], micros) -> dict:
    kind = event.get("event", "event")
    if kind == "collective":
        name = " ".join(str(event[k]) for k in ("op", "channel") if event.get(k) is not None) or "collective"
    else:
        name = str(kind)
    record = {"name": name, "cat": str(kind), "ph": "i", "s": "t", "ts": micros(event), "pid": pid, "tid": _TID,
              "args": _args(event)}
    if kind == "rollback":
        record["cname"] = "terrible"
    return record


def _state(index: int, trace: Sequence[Mapping[str, Any]], found) -> str | None:
    """``diverged at #N`` / ``stalled at #N ...`` / ``trace incomplete ...``: what the process
    name says, or None for a healthy rank. An incomplete trace's rank did not stall: its
    tracer stopped writing (``graphflow.dist.trace.INCOMPLETE``)."""
    ended = found is not None and index in found.differing and found.events[index] is None
    lost = incomplete(trace)
    if lost is not None and not (found is not None and index in found.differing):
        return f"trace incomplete: {lost.get('lost')} event(s) lost ({lost.get('error')})"
    if found is not None and index in found.differing and not ended:
        return f"diverged at event #{found.index}"
    if trace and (ended or trace[-1].get("event") not in _TERMINAL):
        last = trace[-1]
        where = f" ({last['phase']})" if last.get("phase") else ""
        return f"stalled: trace ends at #{last.get('n')} {last.get('event')}{where}"
    return None


def _metadata(pid: int, index: int, trace: Sequence[Mapping[str, Any]], found) -> list[dict]:
    state = _state(index, trace, found)
    name = f"rank {pid}" + (f" — {state}" if state else "")
    return [
        {"name": "process_name", "ph": "M", "ts": 0, "pid": pid, "tid": _TID, "args": {"name": name}},
        {"name": "process_sort_index", "ph": "M", "ts": 0, "pid": pid, "tid": _TID, "args": {"sort_index": pid}},
        {"name": "thread_name", "ph": "M", "ts": 0, "pid": pid, "tid": _TID, "args": {"name": "capture pipeline"}},
    ]


def _divergence(found, pids: Sequence[int], traces, micros) -> dict:
    """Marks on every rank at the first differing event, and its description for ``otherData``."""
    index = found.index
    majority_event = found.events[found.majority[0]]
    marks = []
    times = []
    for i, (pid, trace) in enumerate(zip(pids, traces)):
        event = found.events[i]
        differs = i in found.differing
        anchor = event if event is not None else (trace[-1] if trace else {"n": index})
        ts = micros(anchor)
        times.append(ts)
        if event is None:
            text = f"rank {pid}'s trace ends before event #{index}"
        elif differs:
            text = f"rank {pid} differs here: {describe(event)}"
        else:
            others = [f"rank {pids[j]}" for j in found.differing]
            text = f"{', '.join(others)} {'differs' if len(others) == 1 else 'differ'} from this event"
        marks.append({"name": "first divergence" if differs else "others diverge here", "cat": "divergence",
                      "ph": "i", "s": "t", "ts": ts, "pid": pid, "tid": _TID,
                      "cname": "terrible" if differs else "bad",
                      "args": {"n": index, "what": text, "this rank": describe(event),
                               "majority": describe(majority_event)}})
    differing = ", ".join(f"rank {pids[j]}" for j in found.differing)
    marks.append({"name": f"ranks diverge at event #{index} ({differing})", "cat": "divergence", "ph": "i",
                  "s": "g", "ts": min(times), "pid": pids[found.differing[0]], "tid": _TID, "cname": "terrible",
                  "args": {"n": index}})
    return {"marks": marks, "event": index, "ranks": [pids[j] for j in found.differing],
            "agree": [pids[j] for j in found.majority],
            "events": {str(pids[i]): None if e is None else comparable(e) for i, e in enumerate(found.events)}}
