"""What a collective call through a channel handle costs, with tracing off and on.

Rows (microseconds per call, best of ``--repeat`` runs of ``--n`` calls):

* raw: ``torch.distributed.all_reduce`` on a world-size-1 process group (gloo on CPU,
  NCCL on a GPU), the floor;
* handle, committed, tracing off: the runtime hot path (one attribute check);
  the same path bound to no process group, against a bare Python call of the same
  shape, isolates its own cost from the collective's;
* handle, committed, tracing on: plus one JSON-lines trace event per call;
* handle, warmup: plus the in-memory trace (running hash) and the store agreement
  (world size 1, so the barrier is trivial);
* store barrier, N ranks: one ``StoreBarrier.arrive`` among N threads over a TCPStore,
  what each collective costs in warmup and capture at world size N (not on the hot
  path).

Prints a table and writes ``trace.json`` under ``--out`` (``bench/results`` here).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from graphflow.dist.barrier import StoreBarrier
from graphflow.dist.channels import ChannelRuntime, GroupBinding
from graphflow.events import Event, EventKind, Phase
from graphflow.plan import CaptureSettings, Channel, ChannelKind, Plan
from graphflow.dist.trace import TraceLog, Tracer


def _per_call(fns: dict, n: int, repeat: int, sync) -> dict[str, float]:
    """Best time per call of each function; runs are interleaved so load drifts hit all alike."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeat):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
            best[name] = min(best[name], (time.perf_counter() - start) / n)
    return {name: us * 1e6 for name, us in best.items()}


def _noop(tensor, group=None) -> None:
    pass


def _barrier_us(world: int, n: int) -> float:
    server = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    stores = [dist.TCPStore("127.0.0.1", server.port, world, is_master=False) for _ in range(world)]
    times: list[float] = []

    def rank(r: int) -> None:
        log = TraceLog(r)
        log.record({"event": "phase_begin"})
        barrier = StoreBarrier(stores[r], r, range(world), timeout_s=30, namespace=f"bench{world}")
        start = time.perf_counter()
        for i in range(n):
            barrier.arrive("collective", log.state())
        times.append((time.perf_counter() - start) / n)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=10000, help="calls per run")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--numel", type=int, default=1024, help="elements of the float32 tensor")
    parser.add_argument("--barrier-n", type=int, default=300, help="barriers per rank in the store rows")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    backend = "nccl" if cuda else "gloo"
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    t = torch.ones(args.numel, device=device)
    plan = Plan(name="bench", channels=[Channel("tp", ChannelKind.ALL_REDUCE, "tp", 1, "target")],
                capture=CaptureSettings(barrier_timeout_s=30))
    trace_dir = tempfile.mkdtemp()

    def runtime_in(kinds, tracer=None):
        runtime = ChannelRuntime(plan, tracer=tracer or False)
        for kind, phase in kinds:
            runtime.on_event(Event(kind, phase=phase, defer=lambda *_: None))
        return runtime

    committed = runtime_in([(EventKind.PIPELINE_BEGIN, None), (EventKind.PIPELINE_END, None)])
    traced = runtime_in([(EventKind.PIPELINE_BEGIN, None), (EventKind.PIPELINE_END, None)], Tracer(trace_dir, 0))
    warmup = runtime_in([(EventKind.PIPELINE_BEGIN, None), (EventKind.PHASE_BEGIN, Phase.WARMUP)])
    for handle in (committed.handles["tp"], traced.handles["tp"], warmup.handles["tp"]):
        handle.all_reduce(t)  # communicator set up outside the timing

    world = dist.group.WORLD  # the handles' group: the raw call does the same group lookup as theirs
    timed = _per_call({
        "raw dist.all_reduce": lambda: dist.all_reduce(t, group=world),
        "handle, committed, tracing off": lambda: committed.handles["tp"].all_reduce(t),
        "handle, committed, tracing on": lambda: traced.handles["tp"].all_reduce(t),
        "handle, warmup (hash + agreement)": lambda: warmup.handles["tp"].all_reduce(t),
    }, args.n, args.repeat, sync)
    raw = timed["raw dist.all_reduce"]
    rows = list(timed.items())
    # The hot path's own cost, without a collective to hide in: a handle bound to no
    # process group (the identity) against a bare Python call of the same shape.
    idle = ChannelRuntime(plan, tracer=False, group_factory=lambda name: GroupBinding(name, None, (0,)))
    dispatch = _per_call({"bare Python call": lambda: _noop(t, group=None),
                          "handle dispatch, no process group": lambda: idle.handles["tp"].all_reduce(t)},
                         args.n * 10, args.repeat, lambda: None)
    traced.close()
    dist.destroy_process_group()
    for world in (2, 3):
        rows.append((f"store barrier, {world} ranks (TCPStore)", _barrier_us(world, args.barrier_n)))

    print(f"collective through a channel handle: {backend}, {args.numel} x float32 on {device}, "
          f"best of {args.repeat} x {args.n} calls")
    print(f"{'path':<40} {'us/call':>9} {'vs raw':>9}")
    for name, us in rows:
        print(f"{name:<40} {us:>9.2f} {us - raw:>+9.2f}")
    bare = dispatch["bare Python call"]
    for name, us in dispatch.items():
        print(f"{name:<40} {us:>9.3f} {us - bare:>+9.3f}  (vs bare call)")
    result = {
        "benchmark": "trace", "backend": backend, "device": str(device), "numel": args.numel, "n": args.n,
        "repeat": args.repeat, "torch": torch.__version__, "python": platform.python_version(),
        "host": platform.node(), "cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "rows": [{"path": name, "us_per_call": round(us, 3), "overhead_us": round(us - raw, 3)} for name, us in rows],
        "dispatch": [{"path": name, "us_per_call": round(us, 4), "overhead_us": round(us - bare, 4)}
                     for name, us in dispatch.items()],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "trace.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out / 'trace.json'}")


if __name__ == "__main__":
    main()
