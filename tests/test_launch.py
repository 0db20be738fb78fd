"""``graphflow.dist.launch``: N gloo ranks started by torch.distributed's elastic launcher.

What the front end adds to elastic, each against real processes: a result per rank when
one fails, the deadline, the caller's environment reaching ranks that come from a
forkserver started earlier, the caller's signal handlers given back, and the rank setup
(``graphflow.dist.distributed.joined``) taking a process group that already exists as it is.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from graphflow.dist.launch import launch


def _sleep_on_rank_1(ctx):
    if ctx.rank == 1:
        time.sleep(60)
    return ctx.rank


def _raise_on_rank_0(ctx):
    if ctx.rank == 0:
        raise ValueError("rank 0 refuses")
    time.sleep(60)
    return ctx.rank


def _environment(ctx, name: str):
    return os.environ.get(name), os.environ["RANK"], os.environ["LOCAL_RANK"]


def _announce_and_sleep(ctx, folder: str):
    from pathlib import Path

    (Path(folder) / f"rank{ctx.rank}.started").write_text("")
    time.sleep(120)
    return ctx.rank


_LAUNCHER = """
import sys, time
sys.path.insert(0, {root!r})
from graphflow.dist.launch import launch
from tests.test_launch import _announce_and_sleep
if __name__ == "__main__":
    start = time.monotonic()
    try:
        launch(_announce_and_sleep, 2, "gloo", args=({folder!r},), timeout_s=300)
    except KeyboardInterrupt:
        print(f"interrupted {{time.monotonic() - start:.1f}}")
"""


def _join_again(ctx):
    """A rank's code that runs graphflow's rank setup inside a job whose group exists."""
    import torch.distributed as dist

    from graphflow.dist.distributed import joined

    group = dist.group.WORLD
    with joined() as again:
        seen = (again.rank, again.world_size, again.backend, str(again.device), dist.group.WORLD is group)
    ones = torch.ones(1)
    dist.all_reduce(ones)  # the group outlives the inner block
    return seen, float(ones)


def test_every_rank_returns_its_value():
    ranks = launch(_join_again, 3, "gloo", timeout_s=60)
    assert [r.ok for r in ranks] == [True] * 3, [r.traceback for r in ranks]
    assert [r.value for r in ranks] == [((rank, 3, "gloo", "cpu", True), 3.0) for rank in range(3)]
    assert all(r.elapsed_s > 0 for r in ranks)


@pytest.mark.slow
def test_a_rank_that_does_not_finish_is_killed_and_reported():
    start = time.monotonic()
    # Long enough for rank 0 to start and finish on a loaded machine, short beside rank 1's sleep.
    ranks = launch(_sleep_on_rank_1, 2, "gloo", timeout_s=12)
    assert ranks[0].ok and ranks[0].value == 0
    assert ranks[1].error == "TimeoutError: rank 1 did not finish within 12 s and was killed"
    assert time.monotonic() - start < 40


def _mark_started(ctx, folder: str):
    from pathlib import Path

    (Path(folder) / f"rank{ctx.rank}.ran").write_text("")
    return ctx.rank


def test_a_rank_that_starts_after_the_deadline_does_not_run(tmp_path):
    """On a loaded machine a rank may start after the deadline has passed: it must not run
    then (its result would come long after the caller was told the deadline), whatever
    the launcher's own start took."""
    ranks = launch(_mark_started, 2, "gloo", args=(str(tmp_path),), timeout_s=0.001)
    for r in ranks:  # each finds the mark, or is stopped by elastic when the other has failed first
        assert r.error in (f"TimeoutError: rank {r.rank} started after the 0.001 s deadline and did not run",
                           f"TimeoutError: rank {r.rank} did not finish within 0.001 s and was killed"), r.error
    assert "started after" in ranks[0].error or "started after" in ranks[1].error
    assert list(tmp_path.glob("*.ran")) == []


def test_a_rank_that_raises_reports_its_error_and_the_others_are_stopped():
    start = time.monotonic()
    ranks = launch(_raise_on_rank_0, 2, "gloo", timeout_s=60)
    assert ranks[0].error == "ValueError: rank 0 refuses" and "_raise_on_rank_0" in ranks[0].traceback
    assert ranks[1].error == "ProcessError: rank 1 was stopped when rank 0 failed (ValueError: rank 0 refuses)"
    assert time.monotonic() - start < 30  # torchrun stopped rank 1; the deadline did not


def test_ranks_see_the_callers_environment_of_each_launch(monkeypatch):
    launch(_environment, 1, "gloo", args=("GRAPHFLOW_LAUNCH_PROBE",))  # the forkserver exists from here on
    monkeypatch.setenv("GRAPHFLOW_LAUNCH_PROBE", "second")
    ranks = launch(_environment, 2, "gloo", args=("GRAPHFLOW_LAUNCH_PROBE",))
    assert [r.value for r in ranks] == [("second", "0", "0"), ("second", "1", "1")]


def test_the_callers_signal_handlers_are_given_back():
    def mine(signum, frame):
        raise AssertionError("not called")

    before = signal.signal(signal.SIGTERM, mine)
    interrupt = signal.getsignal(signal.SIGINT)
    try:
        ranks = launch(_sleep_on_rank_1, 2, "gloo", timeout_s=2)
        assert not ranks[1].ok
        assert signal.getsignal(signal.SIGTERM) is mine
        assert signal.getsignal(signal.SIGINT) is interrupt
    finally:
        signal.signal(signal.SIGTERM, before)


def test_nccl_without_enough_gpus_is_refused_before_starting():
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the GPUs")
    with pytest.raises(ValueError, match=r"^2 NCCL ranks need 2 GPUs, this machine has \d+"):
        launch(_sleep_on_rank_1, 2, "nccl")


def test_an_unknown_backend_is_refused():
    with pytest.raises(ValueError, match=r"^backend 'mpi' is not one of gloo, nccl$"):
        launch(_sleep_on_rank_1, 2, "mpi")


@pytest.mark.slow
def test_ctrl_c_stops_every_rank_at_once_even_when_the_shell_ignored_sigint(tmp_path):
    """A launcher started as a background job has SIGINT ignored, and so do its ranks.
    Elastic stops the ranks with SIGINT when the launcher is interrupted: each must take
    it, not sit out the agent's 30 s grace period until SIGKILL."""
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent)
    script = tmp_path / "launcher.py"
    script.write_text(_LAUNCHER.format(root=root, folder=str(tmp_path)))
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"rank{r}.started").exists() for r in range(2)):
            assert time.monotonic() < deadline and process.poll() is None, process.communicate()
            time.sleep(0.1)
        interrupted = time.monotonic()
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=120)
        stopped_s = time.monotonic() - interrupted
    finally:
        process.kill()
    assert out.startswith("interrupted"), (out, err)
    assert stopped_s < 20, f"the ranks took {stopped_s:.1f} s to stop"
    assert "Traceback" not in err
