"""A server's loop beside lazy capture, in a process of its own; prints one JSON line.

    PYTHONPATH=. python3 -m tests.lazy_server plans/dsv4_61l_full.yaml          # GPU
    PYTHONPATH=. python3 -m tests.lazy_server plans/dsv4_61l_full.yaml --smoke  # CPU, 2 layers

As a server uses lazy capture: ``run_pipeline(plan, RunOptions(lazy=True))``, then on the
main thread, back to back, each step draws a batch size of the plan, makes fresh input
tensors on the device (allocated there each step, from a generator of the loop's own)
and calls ``Runner.run``; it reads the logits and goes on, until every descriptor is
captured and ``--after`` more steps. Every ``--check-every``-th step, and the first step
of the first ``--first-checks`` descriptors served on their graphs, is compared with the
plan's eager step from the same state (the model's own code, segment by segment, outside
any graph), bit for bit; graphflow checks every descriptor's first step itself (that step
serves the eager step's results, so the loop does not check it), and the result says
whether all of those were bit-exact too. Each check copies the plan's state (11 GB for the
61-layer plans) for the reference to start from. The process exits
0 when it got that far; CUDA aborting it shows as its exit status, which the caller
reads (``tests/cuda/test_cuda_lazy_server.py`` runs it ten times per plan).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from graphflow.engine import RunOptions, run_pipeline
from graphflow.engine.model.binding import build_model
from graphflow.integrations.dsv4.plans import plan_variant
from graphflow.plan import BufferRole
from graphflow.runtime import Runner
from bench.ready_bench import eager_from, kept_before

#: --smoke: the 61-layer plans' structure with the mini model's widths, on the CPU.
SMOKE = dict(n_layers=2, vocab_size=512, hidden_size=64, n_heads=4, kv_dim=32, rope_dim=16, n_experts=8, top_k=2,
             moe_inter=64, shared_inter=128, max_len=128, block_size=16, max_batch=32, dtype="float32")


def serve(path: str, *, smoke: bool, after: int, check_every: int, first_checks: int, timeout_s: float,
          seed: int) -> dict:
    device = torch.device("cpu" if smoke else "cuda:0")
    plan = plan_variant(path, sizes=(1, 2, 4) if smoke else None, **(SMOKE if smoke else {}))
    model = build_model(plan, {"device": device, "plan": plan})
    engine = run_pipeline(plan, RunOptions(backend=device.type, lazy=True), model=model)
    runner = Runner(engine)
    sizes = sorted(plan.capture.all_sizes)
    picks = torch.Generator().manual_seed(seed)
    values = torch.Generator(device=device).manual_seed(seed)
    bounds = {name: plan.buffer(name).values for name in runner.inputs}
    touched = [b.name for b in plan.buffers if b.role is not BufferRole.INTERNAL]
    served = checked = differed = on_graphs = after_done = 0
    first_of: set = set()
    began = time.perf_counter()
    try:
        while after_done < after and time.perf_counter() - began < timeout_s:
            batch = sizes[int(torch.randint(len(sizes), (1,), generator=picks))]
            batch = max(1, batch - int(torch.randint(2, (1,), generator=picks)))
            inputs = _fresh(runner, bounds, batch, device, values)
            descriptor = runner.descriptor_for(batch)
            # A step that graphflow checks itself serves the eager step's results: comparing
            # it says nothing, and its copies beside ours would hold the state four times.
            its_own = engine.first_use is not None and descriptor in engine.first_use.unchecked
            check = not its_own and (served % check_every == 0
                                     or (descriptor not in first_of and len(first_of) < first_checks))
            kept = kept_before(engine, touched) if check else {}
            was_checked = _checked(engine)
            (logits,) = runner.run(*inputs)[:1]
            descriptor = runner.descriptor_for(batch)  # after run: it switches new programs in
            got = logits.clone()
            if device.type == "cuda":
                torch.cuda.current_stream().synchronize()  # not the device: a capture may be open
            if _checked(engine) != was_checked:  # a program switched in just before this step
                kept.clear()
                check = False
            if check:
                checked += 1
                differed += not torch.equal(got, eager_from(runner, kept, batch, inputs, descriptor))
                first_of.add(descriptor)
            served += 1
            on_graphs += descriptor is not None
            after_done += engine.background.done
        engine.background.wait(timeout_s)
        background = engine.background
        result = {"plan": path, "descriptors": len(plan.descriptors()), "live": len(engine.programs),
                  "failures": {str(d): str(e) for d, e in background.failures.items()},
                  "retried": {str(d): n for d, n in background.core.tries.items()},
                  "served": served, "on_graphs": on_graphs, "checked": checked, "differed": differed,
                  "first_use_checked": len(background.verified),
                  "first_use_bit_exact": all(v.bit_exact for v in background.verified),
                  "all_live_s": (background.finished_at or time.perf_counter()) - background.started_at,
                  "pauses": engine.live.turns.pauses,
                  # What this process held at most: how many runs fit one device at once.
                  "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if device.type == "cuda" else None,
                  "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None}
    finally:
        engine.close()
    return result


def _checked(engine) -> int:
    """How many first-use checks graphflow ran so far, passed or failed."""
    checks = engine.first_use
    return 0 if checks is None else len(checks.verified) + len(checks.failures)


def _fresh(runner: Runner, bounds: dict, batch: int, device: torch.device, values: torch.Generator) -> tuple:
    """Each input made anew on the device, as a server's are each step; a host copy of an
    input the plan keeps on the host (``positions_host``)."""
    made = {}
    for name in runner.inputs:
        low, high = bounds[name] or (0, 2)
        target = runner.engine.buffers.tensors[name].device
        if target.type == "cpu" and device.type != "cpu":
            continue
        made[name] = torch.randint(low, high, (batch,), device=device, generator=values)
    for name in runner.inputs:
        if name not in made:  # a host input: the same values as its device twin
            twin = name.removesuffix("_host")
            made[name] = made[twin].cpu() if twin in made else torch.zeros(batch, dtype=torch.int64)
    return tuple(made[name] for name in runner.inputs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("plan")
    parser.add_argument("--smoke", action="store_true", help="CPU, 2 layers, 3 sizes")
    parser.add_argument("--after", type=int, default=20, help="steps served once every descriptor is captured")
    parser.add_argument("--check-every", type=int, default=8)
    parser.add_argument("--first-checks", type=int, default=16,
                        help="descriptors whose first step is checked too (graphflow checks every first step itself)")
    parser.add_argument("--timeout-s", type=float, default=180.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    result = serve(args.plan, smoke=args.smoke, after=args.after, check_every=args.check_every,
                   first_checks=args.first_checks, timeout_s=args.timeout_s, seed=args.seed)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
