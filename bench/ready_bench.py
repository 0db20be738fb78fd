"""Time-to-ready: capturing the 61-layer dsv4 plans with graphflow against a hand-written loop.

    PYTHONPATH=. python3 bench/ready_bench.py --out DIR                 # GPU: both 61-layer plans
    PYTHONPATH=. python3 bench/ready_bench.py --out DIR --smoke         # CPU, 2 layers: checks the script

In one process, on one model (the weights built once and shared), for each plan (FULL:
``plans/dsv4_61l_full.yaml``, PIECEWISE: ``plans/dsv4_61l_decode.yaml``, every descriptor):

* **hand loop**: what an engineer writes without graphflow, on the engine's own bound
  calls (the step's segments bound to static buffers allocated once): largest first, one
  eager warmup per size, then each graph region of that size captured on one side stream
  into one shared pool (``torch.cuda.graph``), the garbage collector frozen. Its inputs at
  each size are the ones graphflow's warmup draws (``fill_inputs``, the same seed): the
  eager attention's work grows with the positions, so both warm up the same work;
* **graphflow bare**: ``run_pipeline`` with verify and the detectors off;
* **graphflow default**: what ``graphflow run`` does (verify a sample of each mode's
  descriptors, detectors on the first descriptor of each mode, ``capture.warmup: auto``:
  only the descriptors verified or watched and each mode's first warm up, the rest go
  straight to capture);
* **default, verify all** (``--runs`` only, key ``default-verify-all``): the same with
  every descriptor verified (``RunOptions(verify="all")``), what verify costs in all;
* **bare, at once** and **default, at once** (``--runs`` only): the same with every graph
  instantiated as its capture ends (``CudaBackend(instantiate_async=False)``), as
  ``torch.cuda.graph`` does, instead of the large ones on graphflow's worker thread;
* **first use** (key ``first-use``, once, after the rounds): the default row's engine
  serving a first and a second batch of each size; the first checks each descriptor
  verify left out before ready against the eager step, so every descriptor is checked
  after one batch of each size: what that costs each first step, in eager steps;
* **graphflow lazy**: ``RunOptions(lazy=True)``: the time until the first step
  is served, until every descriptor is live while steps are served back to back (each
  step's inputs allocated fresh on the device, as a server's are), the slowest step
  served meanwhile over an eager step of its size, and whether the steps checked
  meanwhile (each descriptor's first, and one in ``CHECK_EVERY``, while the checks have
  taken under ``CHECK_SHARE`` of the time) were bit-exact to the plan's eager step on
  the same (padded) inputs;
* **graphflow lazy-idle**: the same with no step served, the capture thread
  alone: what lazy capture costs by itself, apart from what serving beside it costs;
* **restart** (``--runs`` only): a warm restart, in two fresh processes of
  ``bench/restart_bench.py`` (the same plan, layers and sizes): one captures and saves
  the graphs, the next brings every descriptor live from them; the second's seconds
  from its model built to every descriptor live, how many it restored and captured
  (and why each was captured), whether its logits are bit-exact to the first process's
  and to the eager step, and its ratio to the hand loop's last round.

The hand, bare and default rows run ``--rounds`` times (4 by default), every other
round in reverse order (hand, bare, default, then default, bare, hand). One run of the
same row moves by tens of percent over a run and between machines: in one process the
hand loop took 22.3 s in the first round and 32.7 s in the second. So a row's ratio is
paired: its seconds summed over the rounds over the hand loop's summed over the same
rounds. Over an even number of rounds every row's mean place in the run is the same,
so a machine that speeds up or slows down steadily favours none of them. Each row also
shows its fastest round (the phase columns are that round's) and every round's total.
Two processes of two rounds each gave bare 1.05x and 1.14x: four rounds by default.
The lazy runs come after the rounds, right after the hand loop's last round (an even
``--rounds`` ends on it): their ratio is to that round.

Before the first row, the hand loop runs once untimed (``--no-warm`` skips it): a
process's first capture loads the modules of every kernel it launches and grows the
allocator, and the row that ran first would pay for that alone.

Each graphflow row also records the capture pool as measured after capture
(``pool_bytes``), as forecast before any capture from a probed run of each mode's first
descriptor (``pool_forecast_bytes``, ``PipelineReport.pool_forecast``; None on the CPU) and the
static buffers (``buffer_bytes``), and the table prints forecast over measured.

Prints a table of total / warmup / capture / verify seconds with each row's ratio to the
hand loop, and writes ``ready.json`` to ``--out`` (``ready-full.json`` for ``--plans FULL``
alone, and so on, so that one call per plan keeps both). Targets: default at or below
1.0x the hand loop, bare at or below 0.85x, lazy all live within 1.25x with its first
step within 2 s of the model being built and no step served while it captures slower than
1.5x an eager step of its size, the pool forecast within 5 % of the measured pool, a
restart live within 2 s of its model being built.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import pathlib
import statistics
import sys
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from graphflow.engine import CudaBackend, RunOptions, run_pipeline  # noqa: E402
from graphflow.engine.model.binding import build_model  # noqa: E402
from graphflow.engine.warmup import fill_inputs  # noqa: E402
from graphflow.events import Phase  # noqa: E402
from graphflow.integrations.dsv4.plans import plan_variant  # noqa: E402
from graphflow.plan import BufferRole  # noqa: E402
from graphflow.runtime import Runner  # noqa: E402
from bench.timing import guard, sync  # noqa: E402

PLANS = {"FULL": ROOT / "plans" / "dsv4_61l_full.yaml", "PIECEWISE": ROOT / "plans" / "dsv4_61l_decode.yaml"}
#: --smoke: the 61-layer plans' structure with the mini model's widths, on the CPU.
SMOKE_ARGS = dict(vocab_size=512, hidden_size=64, n_heads=4, kv_dim=32, rope_dim=16, n_experts=8, top_k=2,
                  moe_inter=64, shared_inter=128, max_len=128, block_size=16, max_batch=32, dtype="float32")


def hand_loop(plan, model, backend: str) -> dict:
    """Warm up and capture every descriptor the way a hand-written loop does (see the docstring)."""
    holder = run_pipeline(plan, RunOptions(backend=backend, sizes=(), verify=False, detectors=False), model=model)
    mode = plan.capture.modes[0]
    regions = [r.segments for r in plan.regions(mode)]
    sizes = sorted(plan.capture.sizes_for(mode), reverse=True)
    cuda = backend == "cuda"
    stream = torch.cuda.Stream() if cuda else None
    pool = torch.cuda.graph_pool_handle() if cuda else None
    graphs, warm_s, capture_s = [], 0.0, 0.0
    try:
        gc.collect()
        gc.freeze()
        start = time.perf_counter()
        for size in sizes:
            # The inputs graphflow's warmup gives this size (the attention's work grows
            # with the positions): both loops run the same kernels on the same data.
            fill_inputs(plan, holder.buffers.views(size), size, RunOptions().seed, strict=False)
            calls = dict(zip((s.name for s, _ in holder.segments), holder.eager_calls(size)))
            t = time.perf_counter()
            for call in calls.values():
                call()
            sync()
            warm_s += time.perf_counter() - t
            t = time.perf_counter()
            for region in regions:
                if cuda:
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        for name in region:
                            calls[name]()
                    graphs.append(graph)
                else:
                    for name in region:
                        calls[name]()
            capture_s += time.perf_counter() - t
        total = time.perf_counter() - start
    finally:
        gc.unfreeze()
        for graph in graphs:
            graph.reset()
        holder.close()
        if cuda:
            torch.cuda.empty_cache()
    return {"total_s": total, "warmup_s": warm_s, "capture_s": capture_s, "verify_s": 0.0,
            "graphs": len(regions) * len(sizes)}


def graphflow_run(plan, model, options: RunOptions, backend=None) -> dict:
    start = time.perf_counter()
    engine = run_pipeline(plan, options, model=model, backend=backend)
    total = time.perf_counter() - start
    report = engine.report
    row = {"total_s": total, "warmup_s": report.phase(Phase.WARMUP).seconds,
           "capture_s": report.phase(Phase.CAPTURE).seconds, "verify_s": report.phase(Phase.VERIFY).seconds,
           "allocate_s": report.phase(Phase.ALLOCATE).seconds, "graphs": report.graphs,
           "bit_exact": all(v.bit_exact for v in report.verify) if report.verify else None,
           "verified": len(report.verify), "warmups_skipped": report.warmups_skipped,
           "pool_bytes": report.pool_bytes, "pool_forecast_bytes": report.pool_forecast,
           "buffer_bytes": report.buffer_bytes,
           "per_descriptor_s": _per_descriptor([t for t in report.times if not t.skipped])}
    engine.close()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return row


def first_use_run(plan, model, options: RunOptions) -> dict:
    """The default row's engine serving one batch of each descriptor's size, then a second:
    the first checks the descriptors verify left out before ready (``graphflow.engine.first_use``),
    the second replays. What checking every descriptor costs, and when: each first step
    over the second, and over an eager step of that size."""
    engine = run_pipeline(plan, options, model=model)
    try:
        runner = Runner(engine)
        generator = torch.Generator().manual_seed(1)
        device = engine.buffers.tensors["tokens"].device
        vocab, max_len = plan.model_args.get("vocab_size", 512), plan.model_args.get("max_len", 256)
        before = runner.checks
        first, second = {}, {}
        for descriptor in engine.descriptors:
            for times in (first, second):
                inputs = _inputs(runner, descriptor.size, generator, device, vocab, max_len)
                began = time.perf_counter()
                runner.run(*inputs)
                sync()
                times[descriptor.size] = time.perf_counter() - began
        eager = _eager_times(runner, sorted(first), generator, device, vocab, max_len)
        after = runner.checks
    finally:
        engine.close()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    extra = [(first[b] - second[b]) / eager[b] for b in first if eager.get(b)]
    return {"checked_before_ready": before.before_ready, "checked_on_first_use": after.on_first_use,
            "failed": after.failed, "unchecked_after": after.waiting,
            "first_steps_s": sum(first.values()), "second_steps_s": sum(second.values()),
            "first_minus_second_over_eager_median": statistics.median(extra) if extra else None}


#: In the lazy run, every this many served steps is checked against the eager step, besides
#: the first step each descriptor serves (a program just switched in)...
CHECK_EVERY = 16
#: ...while the checks have taken at most this share of the time since the engine was ready:
#: a check runs an eager 61-layer step and copies of the state in the step's turn, which
#: the capture thread waits for. It is the bench's cost, not graphflow's.
CHECK_SHARE = 0.1


def _checked(runner) -> int:
    """How many descriptors graphflow has checked on their first batch, passed or failed
    (each such step ran an eager step and a replay)."""
    checks = runner.checks
    return checks.on_first_use + checks.failed


def _per_descriptor(times) -> dict:
    """Each phase's seconds on the first descriptor and the median of the rest: where a
    row's time goes beyond the hand loop's (the detectors watch the first descriptor)."""
    by_phase: dict = {}
    for t in times:
        by_phase.setdefault(t.phase.value, []).append(t.seconds)
    return {phase: {"first": values[0], "rest_median": statistics.median(values[1:]) if len(values) > 1 else None}
            for phase, values in by_phase.items()}


def lazy_run(plan, model, options: RunOptions, built_at: float, timeout_s: float, serve: bool = True) -> dict:
    """Serve while the background captures, as a server would: each step's inputs made
    fresh on the device (allocated, as a server's are), the step, its logits read, the
    next. A checked step (``CHECK_EVERY``, and each descriptor's first) is compared with
    the plan's eager step from the same state, in a step's turn of its own: the bench's
    cost, not graphflow's (graphflow checks each descriptor's first batch itself).

    Each step's wall time is kept with its batch size; once every descriptor is live, an
    eager step of each size served is timed, and ``worst_step_vs_eager`` is the slowest
    step served while the thread captured over the eager step of its size, less the steps
    in which graphflow checked a new graph (an eager step and a replay, by design: their
    own columns, ``*_first_use_step_vs_eager``).

    ``serve=False`` serves nothing: the capture thread alone, what it costs without
    steps beside it."""
    start = time.perf_counter()
    engine = run_pipeline(plan, options, model=model)
    ready = time.perf_counter()
    runner = Runner(engine)
    sizes = sorted(plan.capture.all_sizes)
    generator = torch.Generator().manual_seed(0)
    device = engine.buffers.tensors["tokens"].device
    max_len = plan.model_args.get("max_len", 256)
    served, checks, exact, graph_steps, first_step, checking_s = 0, 0, True, 0, None, 0.0
    checked: set = set()
    # (batch, seconds, whether graphflow checked a new graph in it, the size it was served
    # at: None eagerly, which step it was, when it began after ready) of the steps served
    # while the thread captured
    steps: list[tuple[int, float, bool, int | None, int, float]] = []
    # What a step and its reference read and leave behind; internal buffers are written
    # before they are read in every step.
    touched = [b.name for b in plan.buffers if b.role is not BufferRole.INTERNAL]
    try:
        while serve and not engine.background.done and time.perf_counter() - ready < timeout_s:
            batch = sizes[int(torch.randint(len(sizes), (1,), generator=generator))]
            batch = max(1, batch - int(torch.randint(2, (1,), generator=generator)))
            check = ((runner.descriptor_for(batch) not in checked or served % CHECK_EVERY == 0)
                     and checking_s <= CHECK_SHARE * (time.perf_counter() - ready))
            # The bench's copy of the state, outside the step's time: it is no server's work.
            kept = kept_before(engine, touched) if check else {}
            capturing = not engine.background.done
            first_uses = _checked(runner)
            # Made on the device each step, as a server's are; timed apart from the step, as
            # the eager steps it is compared with time theirs.
            inputs = _inputs(runner, batch, generator, device, plan.model_args.get("vocab_size", 512), max_len)
            began = time.perf_counter()
            (logits,) = runner.run(*inputs)[:1]
            # Not a device-wide sync: one would wait for the stream the background captures on,
            # which CUDA refuses while it captures.
            torch.cuda.current_stream().synchronize() if torch.cuda.is_available() else None
            took = time.perf_counter() - began
            descriptor = runner.descriptor_for(batch)  # after run: it switches new programs in
            got = logits.clone()
            if capturing:
                steps.append((batch, took, _checked(runner) > first_uses,
                              None if descriptor is None else descriptor.size, served, began - ready))
            if check:
                checked_at = time.perf_counter()
                exact = exact and torch.equal(got, eager_from(runner, kept, batch, inputs, descriptor))
                checks += 1
                checked.add(descriptor)
                checking_s += time.perf_counter() - checked_at
            del kept
            if first_step is None:
                first_step = time.perf_counter()
            served += 1
            graph_steps += descriptor is not None
        background = engine.background
        background.wait(timeout_s)
        live = (background.finished_at or time.perf_counter()) - start
        failures = {str(d): str(e) for d, e in background.failures.items()}
        verified = all(v.bit_exact for v in background.verified)
        first_use = len(background.verified)
        thread = _thread_time(background)
        eager = _eager_times(runner, sorted({b for b, *_ in steps}), generator, device,
                             plan.model_args.get("vocab_size", 512), max_len)
    finally:
        engine.close()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    ratios = [(seconds / eager[batch], batch, seconds, at, index, when)
              for batch, seconds, checking, at, index, when in steps if eager.get(batch) and not checking]
    check_ratios = [(seconds / eager[batch], batch, seconds, at) for batch, seconds, checking, at, *_ in steps
                    if eager.get(batch) and checking]
    worst = max(ratios, key=lambda x: x[0], default=None)
    worst_check = max(check_ratios, key=lambda x: x[0], default=None)
    return {"ready_s": ready - start, "first_step_after_build_s": (first_step or ready) - built_at,
            "all_live_s": live, "served_steps": served, "checked_steps": checks, "checked_descriptors": len(checked),
            "checking_s": checking_s, "steps_on_graphs": graph_steps, "first_use_checked": first_use,
            "served_bit_exact": exact, "verified_bit_exact": verified, "failures": failures, "thread": thread,
            "worst_step_vs_eager": None if worst is None else worst[0],
            "worst_step": None if worst is None else {"batch": worst[1], "seconds": worst[2],
                                                       "eager_s": eager[worst[1]], "served_at": worst[3],
                                                       "step": worst[4], "after_ready_s": worst[5]},
            # The slowest steps that checked nothing, to tell a wait for a recording's slice
            # from a replay padded to a much larger graph.
            "slowest_steps": [{"batch": b, "seconds": t, "vs_eager": r, "served_at": at, "step": i,
                               "after_ready_s": w}
                              for r, b, t, at, i, w in sorted(ratios, key=lambda x: x[0], reverse=True)[:8]],
            "first_use_steps": len(check_ratios),
            "worst_first_use_step_vs_eager": None if worst_check is None else worst_check[0],
            "median_first_use_step_vs_eager": statistics.median(r for r, *_ in check_ratios) if check_ratios
            else None,
            "eager_step_s": {str(b): t for b, t in eager.items()}}


def _eager_times(runner, batches, generator, device, vocab, max_len) -> dict[int, float]:
    """An eager step of each batch size, as a server without graphs would run it (the
    plan's step at that size, on fresh inputs): the faster of two runs, wall clock,
    with the device synchronized."""
    times = {}
    for batch in batches:
        runs = []
        for _ in range(2):
            inputs = _inputs(runner, batch, generator, device, vocab, max_len)
            began = time.perf_counter()
            eager_reference(runner, batch, inputs, None)
            torch.cuda.synchronize() if torch.cuda.is_available() else None
            runs.append(time.perf_counter() - began)
        times[batch] = min(runs)
    return times


def _thread_time(background) -> dict:
    """Where the capture thread's time went: each phase's seconds (its first warmup, then
    each descriptor's capture), and the rest (waiting for steps, and for their turns)."""
    phases: dict = {}
    for t in background.times:
        phases[t.phase.value] = phases.get(t.phase.value, 0.0) + t.seconds
    wall = (background.finished_at or time.perf_counter()) - background.started_at
    return {**phases, "waiting": wall - sum(phases.values()), "wall": wall}


def _inputs(runner, batch, generator, device, vocab, max_len):
    values = {"tokens": torch.randint(0, vocab, (batch,), generator=generator),
              "positions": torch.randint(0, max_len, (batch,), generator=generator)}
    values["positions_host"] = values["positions"].clone()
    return tuple(values[name].to(device) if name != "positions_host" else values[name] for name in runner.inputs)


def kept_before(engine, names) -> dict[str, torch.Tensor]:
    """Copies of the buffers ``names`` as the next step will start from, taken in a step's
    turn of their own: a lazy engine's thread changes buffers inside its turns (a warmup,
    a CPU capture) and puts them back before the turn ends, so a copy taken outside a turn
    may hold a phase's work half done, and a check against it differ from a right step."""
    with engine.live.step() if engine.live is not None else contextlib.nullcontext():
        return {name: engine.buffers.tensors[name].clone() for name in names}


def eager_from(runner, kept: dict, batch, inputs, descriptor) -> torch.Tensor:
    """``eager_reference`` from the buffers ``kept`` before the step served, in a step's
    turn of its own (no phase of a lazy engine's thread between the copies); the buffers
    the served step left are put back after. ``kept`` is used up: it holds the served
    step's buffers meanwhile, swapped one buffer at a time, so that a check costs one copy
    of the plan's state (11 GB at 61 layers), not two."""
    engine = runner.engine
    tensors = engine.buffers.tensors
    with engine.live.step() if engine.live is not None else contextlib.nullcontext():
        for name, value in kept.items():
            served = tensors[name].clone()
            tensors[name].copy_(value)
            value.copy_(served)
            del served
        want = eager_reference(runner, batch, inputs, descriptor)
        for name, value in kept.items():
            tensors[name].copy_(value)
    return want


def eager_reference(runner, batch, inputs, descriptor) -> torch.Tensor:
    """The plan's step, eagerly, at the size the runner served ``batch`` at, same padding."""
    engine = runner.engine
    size = descriptor.size if descriptor is not None else batch
    views = engine.buffers.views(size)
    for name, value in zip(runner.inputs, inputs):
        views[name].zero_()
        views[name][:batch].copy_(value)
    for call in engine.eager_calls(size):
        call()
    return views["logits"][:batch].clone()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="out", help="directory for ready.json")
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--plans", default="FULL,PIECEWISE", help="which plans, by mode (FULL,PIECEWISE)")
    parser.add_argument("--sizes", help="descriptor sizes (default: the plans' 67)")
    parser.add_argument("--lazy-timeout-s", type=float, default=120.0)
    parser.add_argument("--runs", default="hand,bare,default,first-use,lazy,lazy-idle",
                        help="which rows: hand (the loop every ratio is to), bare, default; default-verify-all "
                             "(every descriptor verified); bare-at-once and "
                             "default-at-once (every graph instantiated as its capture ends, as torch.cuda.graph "
                             "does); first-use (the default engine serving a first and a second batch of each "
                             "size: what checking every descriptor on its first batch costs); lazy (serving steps "
                             "back to back) and lazy-idle (the capture thread alone); restart (a new process live "
                             "from the graphs another saved)")
    parser.add_argument("--rounds", type=int, default=4,
                        help="run the hand, bare and default rows this many times, every other round in reverse "
                             "order (even: every row's mean place in the run is the same); ratios are paired over "
                             "the rounds")
    parser.add_argument("--warm", action=argparse.BooleanOptionalAction, default=True,
                        help="run the hand loop once untimed first, so that no row pays for the process's cold start")
    parser.add_argument("--smoke", action="store_true", help="CPU, 2 layers, 3 sizes: checks the script")
    args = parser.parse_args()
    backend = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    overrides = dict(n_layers=2 if args.smoke else args.layers, **(SMOKE_ARGS if args.smoke else {}))
    sizes = (4, 2, 1) if args.smoke else (tuple(int(s) for s in args.sizes.split(",")) if args.sizes else None)
    results = {"device": torch.cuda.get_device_name(0) if backend == "cuda" else "cpu", "torch": torch.__version__,
               "layers": overrides["n_layers"], "plans": {}}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    chosen = args.plans.split(",")
    runs = set(args.runs.split(","))
    if "hand" not in runs:
        parser.error("--runs needs hand: every row is a ratio to it")
    name_of_file = "ready.json" if sorted(chosen) == sorted(PLANS) else f"ready-{'-'.join(chosen).lower()}.json"

    def done(what: str) -> None:
        # Each run is saved and told as it ends: a run cut short by a deadline keeps the rest.
        (out / name_of_file).write_text(json.dumps(results, indent=2))
        print(f"ready_bench: {what} done, {time.perf_counter() - started:.1f} s in", flush=True)

    started = time.perf_counter()
    warmed = False
    for name in chosen:
        plan = plan_variant(PLANS[name], sizes=sizes, **overrides)
        t = time.perf_counter()
        model = build_model(plan, {"device": torch.device(backend if backend == "cpu" else "cuda:0"), "plan": plan})
        sync()
        built = time.perf_counter()
        rows: dict = {}
        entry = {"descriptors": len(plan.descriptors()), "build_s": built - t, "rows": rows}
        results["plans"][name] = entry
        if not warmed and args.warm:
            # The process's first capture loads every kernel's module (CUDA loads them on
            # first launch) and grows the allocator: the row that ran first would pay for it.
            t = time.perf_counter()
            hand_loop(plan, model, backend)
            entry["warm_pass_s"] = time.perf_counter() - t
            warmed = True
            done(f"{name} warm pass ({entry['warm_pass_s']:.2f} s, not timed)")
        bare, default = RunOptions(backend=backend, verify=False, detectors=False), RunOptions(backend=backend)
        verify_all = RunOptions(backend=backend, verify="all")
        chosen_rows = [(run, measure) for run, key, measure in (
            ("hand loop", "hand", lambda: hand_loop(plan, model, backend)),
            ("graphflow bare", "bare", lambda: graphflow_run(plan, model, bare)),
            ("bare, at once", "bare-at-once", lambda: graphflow_run(plan, model, bare, at_once(backend))),
            ("graphflow default", "default", lambda: graphflow_run(plan, model, default)),
            ("default, verify all", "default-verify-all", lambda: graphflow_run(plan, model, verify_all)),
            ("default, at once", "default-at-once", lambda: graphflow_run(plan, model, default, at_once(backend))))
            if key in runs]
        _rounds(rows, chosen_rows, args.rounds, lambda what: done(f"{name} {what}"))
        done(f"{name} rounds")  # the rows are made from every round, once all have run
        if "first-use" in runs:
            guard(entry, "first-use", lambda: first_use_run(plan, model, default))
            done(f"{name} first-use checks")
        for key, serve in (("lazy", True), ("lazy-idle", False)):
            if key in runs:
                model_built = time.perf_counter()
                guard(entry, key, lambda: lazy_run(plan, model, RunOptions(backend=backend, lazy=True), model_built,
                                                   args.lazy_timeout_s, serve=serve))
                last_hand = [t for t in rows.get("hand loop", {}).get("rounds_total_s", ()) if t is not None]
                if key in entry and last_hand:
                    entry[key]["vs_hand_last_round"] = entry[key]["all_live_s"] / last_hand[-1]
                done(f"{name} {key}" if key in entry else f"{name} {key} (failed)")
        if "restart" in runs:
            model = None  # two processes of their own build the model: this one's weights go first
            gc.collect()
            if backend == "cuda":
                torch.cuda.empty_cache()
            guard(entry, "restart", lambda: restart_run(PLANS[name], overrides["n_layers"], sizes, args.smoke))
            last_hand = [t for t in rows.get("hand loop", {}).get("rounds_total_s", ()) if t is not None]
            if "restart" in entry and last_hand and entry["restart"]["live_s"] is not None:
                entry["restart"]["vs_hand_last_round"] = entry["restart"]["live_s"] / last_hand[-1]
            done(f"{name} restart" if "restart" in entry else f"{name} restart (failed)")
        model = None  # the weights go before the next plan builds its own (the lambdas above read it late)
        gc.collect()
    _print(results)
    return 0


def restart_run(plan_path: pathlib.Path, layers: int, sizes: tuple[int, ...] | None, smoke: bool) -> dict:
    """A warm restart of the plan in fresh processes (``bench/restart_bench.py``: capture
    and save, then restore): what the restoring process did."""
    from bench import restart_bench

    with tempfile.TemporaryDirectory() as saved:
        found = restart_bench.processes(("capture", "restore"), str(plan_path), pathlib.Path(saved), smoke=smoke,
                                        layers=None if smoke else layers, sizes=sizes)
    capture, restore = found.get("capture", {}), found.get("restore", {})
    if "error" in capture or "error" in restore:
        raise RuntimeError((capture.get("error") or restore.get("error")).strip().splitlines()[-1])
    restart = restore["restart"] or {}
    return {"capture_live_s": capture["live_s"], "live_s": restore["live_s"],
            "restored": restart.get("restored", 0), "captured": restart.get("captured", 0),
            "refused": restart.get("refused"), "recaptured": list(restart.get("recaptured", ())),
            "built": restart.get("built", {}),
            "bit_exact_to_capture": all(restore.get("equal_to_capture", {}).values()),
            "bit_exact_to_eager": all(restore["logits"]["eager_equal"].values())}


def at_once(backend: str):
    """The backend of the ``-at-once`` rows: every graph instantiated as its capture ends,
    as ``torch.cuda.graph`` does, instead of the large ones on graphflow's worker thread
    (and verify then follows each capture); on the CPU there is nothing to instantiate."""
    return CudaBackend(instantiate_async=False) if backend == "cuda" else None


def _rounds(rows: dict, measures: list, rounds: int, done) -> None:
    """Each ``(run, measure)`` ``rounds`` times, every other round in reverse order;
    ``rows[run]`` is its fastest round, with every round's total beside it and, when the
    hand loop is among them, ``vs_hand``: its totals over the hand loop's in the rounds
    both finished (see the module docstring)."""
    measured: dict = {run: [None] * rounds for run, _ in measures}
    for round_ in range(rounds):
        for run, measure in measures if round_ % 2 == 0 else measures[::-1]:
            one: dict = {}
            guard(one, run, measure)
            if run in one:
                measured[run][round_] = one[run]
            else:
                rows.setdefault("errors", {})[f"{run} (round {round_ + 1})"] = one["errors"][run]
            done(f"{run} round {round_ + 1} " + (f"({one[run]['total_s']:.2f} s)" if run in one else "(failed)"))
    hand = measured.get("hand loop", [None] * rounds)
    for run, results in measured.items():
        finished = [r for r in results if r is not None]
        if not finished:
            continue
        rows[run] = {**min(finished, key=lambda r: r["total_s"]),
                     "rounds_total_s": [None if r is None else r["total_s"] for r in results]}
        paired = [(r["total_s"], h["total_s"]) for r, h in zip(results, hand) if r is not None and h is not None]
        if paired:
            rows[run]["vs_hand"] = sum(r for r, _ in paired) / sum(h for _, h in paired)


def _print(results: dict) -> None:
    print(f"\ntime to ready, {results['layers']} layers, {results['device']}, torch {results['torch']}")
    for name, entry in results["plans"].items():
        rows = {run: row for run, row in entry["rows"].items() if run != "errors"}
        hand_rounds = [t for t in rows.get("hand loop", {}).get("rounds_total_s", ()) if t is not None]
        last_hand = hand_rounds[-1] if hand_rounds else None
        print(f"\n{name} ({entry['descriptors']} descriptors)")
        print(f"{'run':<20}{'paired ratio':>13}{'fastest s':>10}{'warmup':>9}{'capture':>9}{'verify':>9}"
              f"{'graphs':>8}{'pool forecast/measured':>24}  every round's total")
        for run, row in rows.items():
            rounds = ", ".join("-" if t is None else f"{t:.2f}" for t in row.get("rounds_total_s", ()))
            ratio = f"{row['vs_hand']:.3f}x" if "vs_hand" in row else "-"
            print(f"{run:<20}{ratio:>13}{row['total_s']:>10.2f}{row['warmup_s']:>9.2f}"
                  f"{row['capture_s']:>9.2f}{row['verify_s']:>9.2f}{row['graphs']:>8}{_forecast(row):>24}  {rounds}")
        checks = entry.get("first-use")
        if checks:
            print(f"first use: {checks['checked_before_ready']} descriptors verified before ready, "
                  f"{checks['checked_on_first_use']} checked on their first batch ({checks['failed']} failed, "
                  f"{checks['unchecked_after']} left); first steps {checks['first_steps_s']:.2f} s, second steps "
                  f"{checks['second_steps_s']:.2f} s, a first step costs "
                  f"{checks['first_minus_second_over_eager_median']:.2f} eager steps more (median)")
        for key in ("lazy-idle", "lazy"):
            lazy = entry.get(key)
            if not lazy:
                continue
            thread = ", ".join(f"{phase} {seconds:.2f}" for phase, seconds in lazy["thread"].items() if phase != "wall")
            worst = lazy.get("worst_step")
            slowest = (f"slowest step while capturing (no check in it) {lazy['worst_step_vs_eager']:.2f}x an eager "
                       f"step of its size "
                       f"(B={worst['batch']} served {_served_at(worst)}: {worst['seconds'] * 1e3:.0f} ms, "
                       f"eager {worst['eager_s'] * 1e3:.0f} ms; step {worst['step']}, "
                       f"{worst['after_ready_s']:.2f} s after ready), "
                       if worst else "")
            checking = (f"{lazy['first_use_checked']} descriptors checked on their first batch (those steps "
                        f"{lazy['median_first_use_step_vs_eager']:.2f}x an eager step, median; at most "
                        f"{lazy['worst_first_use_step_vs_eager']:.2f}x), " if lazy.get("first_use_steps") else
                        f"{lazy['first_use_checked']} descriptors checked on their first batch, ")
            served = (f"{lazy['served_steps']} steps served meanwhile ({lazy['steps_on_graphs']} on graphs), "
                      f"{slowest}{checking}"
                      f"{lazy['checked_steps']} steps checked by the bench ({lazy['checked_descriptors']} "
                      f"descriptors, {lazy['checking_s']:.2f} s): bit-exact {lazy['served_bit_exact']}, "
                      if key == "lazy" else "nothing served, ")
            first = (f", first step {lazy['first_step_after_build_s']:.2f} s after the model was built"
                     if key == "lazy" else "")
            against = (f"{lazy['all_live_s'] / last_hand:.2f}x the hand loop's last round, {last_hand:.2f} s"
                       if last_hand else "no hand loop to compare")
            print(f"{key}: ready in {lazy['ready_s']:.2f} s{first}, all live in {lazy['all_live_s']:.2f} s "
                  f"({against}); "
                  f"{served}verified bit-exact {lazy['verified_bit_exact']}, "
                  f"failures {len(lazy['failures'])}; the thread's seconds: {thread}")
        restart = entry.get("restart")
        if restart:
            against = (f" ({restart['vs_hand_last_round']:.2f}x the hand loop's last round)"
                       if "vs_hand_last_round" in restart else "")
            said = f"; refused: {restart['refused']}" if restart["refused"] else "".join(
                f"; captured {line}" for line in restart["recaptured"][:3])
            print(f"restart: a new process live {restart['live_s']:.2f} s after its model was built{against}, "
                  f"{restart['restored']} descriptors restored, {restart['captured']} captured{said}; bit-exact to "
                  f"the capturing process {restart['bit_exact_to_capture']}, to the eager step "
                  f"{restart['bit_exact_to_eager']} (the capturing process: live {restart['capture_live_s']:.2f} s, "
                  f"saving included)")
        for run, error in {**entry["rows"].get("errors", {}), **entry.get("errors", {})}.items():
            print(f"{run} failed: {error}")

def _served_at(step: dict) -> str:
    return "eagerly" if step.get("served_at") is None else f"on the B={step['served_at']} graph"


def _forecast(row: dict) -> str:
    """The pool forecast before capture over the pool measured after it, with both sizes."""
    forecast, pool = row.get("pool_forecast_bytes"), row.get("pool_bytes")
    if forecast is None or not pool:
        return "-"
    return f"{forecast / pool:.3f} ({forecast / 2**20:.0f}/{pool / 2**20:.0f} MiB)"


if __name__ == "__main__":
    sys.exit(main())

