"""Ranks that caught a DivergenceError leave with their own exit status, under torchrun.

A rank whose pipeline diverged rolls back and may go on (a long-lived server catches
the error, uses its process group, leaves). When it leaves, the process group must be
gone already: a gloo group whose worker threads are still alive as the interpreter
finalizes (held by a channel runtime waiting for the cyclic garbage collector) makes
the rank abort, "terminate called without an active exception", exit -6: in 11 of 20
jobs of the divergence below and 3 of 20 of the stall, before the runtime let go of
its groups at close. Each job here is two torchrun ranks of this file (``__main__``
below) on 127.0.0.1: the placeholder divergence and a rank that stalls past the
barrier timeout, each rank catching the DivergenceError, then all-reducing once on the
same group and leaving through ``joined``.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
#: What torchrun sets for its ranks: a test run inside a job must not hand it down.
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
                  "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE")
WORLD = 2
#: Each case's jobs, started two at a time; the whole test stays under a minute on 2 cores.
RUNS = 4
JOB_TIMEOUT_S = 60
CAUGHT = 0  # a rank's exit status when it caught the DivergenceError and its group still served
MISSED = 3  # a rank's exit status when its capture did not end in a DivergenceError


def _job(case: str, out: pathlib.Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]), OMP_NUM_THREADS="1")
    out.mkdir(parents=True)
    with (out / "torchrun.log").open("w") as log:
        return subprocess.Popen([*TORCHRUN, "--standalone", "--nproc-per-node", str(WORLD), __file__, case, str(out)],
                                cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT)


def _statuses(out: pathlib.Path) -> list[int | None]:
    """Each rank's status as it wrote it just before leaving (None: it never got there)."""
    return [int(p.read_text()) if (p := out / f"rank{r}.status").exists() else None for r in range(WORLD)]


class _Group:
    """Stands for a process group: what matters is who still holds it."""


def test_a_closed_runtime_holds_no_process_group():
    import weakref

    from graphflow.dist.channels import ChannelRuntime, GroupBinding
    from graphflow.plan import WarmupPolicy
    from multirank_model import family_plan, step_plan

    group, destroyed = _Group(), []
    plan = family_plan(step_plan(WarmupPolicy.REAL, sizes=(1,), world_size=1), "target")
    runtime = ChannelRuntime(plan, tracer=False, group_factory=lambda name: GroupBinding(
        name, group, (0,), destroy=lambda: destroyed.append(name)))
    handles = dict(runtime.handles)
    held = weakref.ref(group)
    del group
    runtime.close()
    assert sorted(destroyed) == ["ep", "tp"]
    assert held() is None, "the closed runtime or its handles keep the process group alive"
    assert all(h.binding.members == (0,) for h in handles.values())


@pytest.mark.slow
@pytest.mark.parametrize("case", ["diverge", "stall"])
def test_every_rank_exits_with_its_own_status_after_a_caught_divergence(case, tmp_path):
    began = time.monotonic()
    outcomes = []
    for first in range(0, RUNS, 2):
        jobs = {n: _job(case, tmp_path / f"run{n}") for n in range(first, min(first + 2, RUNS))}
        for n, job in jobs.items():
            try:
                job.wait(timeout=JOB_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                job.kill()
                job.wait()
            log = (tmp_path / f"run{n}" / "torchrun.log").read_text()
            outcomes.append((n, job.returncode, _statuses(tmp_path / f"run{n}"), "terminate called" in log, log))
    for n, status, ranks, aborted, log in outcomes:
        assert not aborted, f"run {n}: a rank aborted at exit\n{log}"
        assert ranks == [CAUGHT] * WORLD, f"run {n}: {ranks}\n{log}"
        assert status == 0, f"run {n}: torchrun exited {status}\n{log}"
    assert time.monotonic() - began < 2 * JOB_TIMEOUT_S


# -- the ranks ----------------------------------------------------------------------------


def _diverge(session, rank: int, out: pathlib.Path):
    from multirank_model import LegacyAllReduce, Step

    return Step(session.handles, rank, tp=LegacyAllReduce(session.handles["tp_ar"], session.channels, rank))


def _stall(session, rank: int, out: pathlib.Path):
    """Rank 1 stays away in its first FULL warmup until rank 0 has given up on it; it then
    comes back to a barrier rank 0 abandoned, and raises there too."""
    from graphflow.events import Phase
    from graphflow.plan import Mode
    from multirank_model import Step

    class Stalling(Step):
        stalled = False

        def proj(self, x, h):
            site = session.channels.site
            if rank == 1 and not self.stalled and site.phase is Phase.WARMUP and site.descriptor.mode is Mode.FULL:
                self.stalled = True
                deadline = time.monotonic() + JOB_TIMEOUT_S / 2
                while not (out / "gave-up.rank0").exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
            super().proj(x, h)

    return Stalling(session.handles, rank)


def _rank(case: str, out: pathlib.Path) -> int:
    import attrs
    import torch
    import torch.distributed as dist

    from graphflow.dist.distributed import joined
    from graphflow.engine import RunOptions
    from graphflow.errors import DivergenceError
    from graphflow.plan import WarmupPolicy
    from graphflow.session import Session
    from multirank_model import STALL_TIMEOUT_S, family_plan, step_plan

    torch.set_num_threads(1)
    policy = WarmupPolicy.PLACEHOLDER if case == "diverge" else WarmupPolicy.REAL
    plan = family_plan(step_plan(policy, sizes=(1, 2), world_size=WORLD), "target")
    plan = attrs.evolve(plan, capture=attrs.evolve(plan.capture, barrier_timeout_s=STALL_TIMEOUT_S if case == "stall"
                                                   else 30.0))
    options = RunOptions(backend="cpu", detectors=False, verify=False, skip_rules={"GF503"})
    status = MISSED
    with joined("gloo", group_timeout_s=30) as ctx:
        with Session(plan, options, rank=ctx.rank, world_size=ctx.world_size, namespace=case) as session:
            model = {"diverge": _diverge, "stall": _stall}[case](session, ctx.rank, out)
            try:
                session.capture(model)
            except DivergenceError:
                status = CAUGHT
            (out / f"gave-up.rank{ctx.rank}").write_text("")
        total = torch.tensor([float(ctx.rank + 1)])
        dist.all_reduce(total)  # the group still pairs collectives after the divergence
        if total.item() != WORLD * (WORLD + 1) / 2:
            status = MISSED
    (out / f"rank{ctx.rank}.status").write_text(str(status))
    return status


if __name__ == "__main__":
    sys.exit(_rank(sys.argv[1], pathlib.Path(sys.argv[2])))
