"""``graphflow run`` under torchrun on CPUs over gloo: ranks started by torch.distributed.run.

One node with 2 and 3 ranks, two "nodes" (two torchrun agents) meeting through a c10d
rendezvous on 127.0.0.1, a fault on one rank and the placeholder divergence. Each job
is ``python -m torch.distributed.run ...``, killed with its ranks at its deadline, so a
hang fails the test instead of stalling the suite. The jobs start together when the
module's first test asks for one (most of a job is interpreters importing torch, which
overlaps), and each test reads its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from graphflow.cli import main
from graphflow.dist.distributed import NVLS_ENV, in_job, joined
from test_tp import FAULTY_RANK, SIZES, TINY
from torchrun_models import FAILURE_TIMEOUT_S, HANG_TIMEOUT_S, write_plans

#: Every test here shares one set of torchrun jobs, about a minute of processes on 2 cores.
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: Wall-clock bound of one job: interpreters, rendezvous, a tiny capture, on a busy 2-core machine.
JOB_TIMEOUT_S = 150
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
#: What torchrun sets for its ranks: a test run inside a job must not hand it down.
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
                  "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE")


class Job:
    """One torchrun command line, started now; ``result()`` waits for it, up to the deadline."""

    def __init__(self, args: list[str], cwd: pathlib.Path):
        env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
        env.update(PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]), OMP_NUM_THREADS="1")
        self.args = args
        self.started = time.monotonic()
        self.proc = subprocess.Popen(TORCHRUN + args, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self._done = None

    def result(self) -> tuple[int, str, str, float]:
        """(exit status, stdout, stderr, seconds)."""
        if self._done is None:
            try:
                out, err = self.proc.communicate(timeout=max(1.0, JOB_TIMEOUT_S - (time.monotonic() - self.started)))
            except subprocess.TimeoutExpired:
                self.kill()
                out, err = self.proc.communicate()
                pytest.fail(f"torchrun {' '.join(self.args)} did not finish within {JOB_TIMEOUT_S} s\n{out}\n{err}")
            self._done = (self.proc.returncode, out, err, time.monotonic() - self.started)
        return self._done


    def kill(self) -> None:
        """SIGKILL torchrun and the ranks it started (torchrun puts each rank in a session of its own)."""
        pids = [self.proc.pid]
        for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # gone meanwhile
            if int(fields[1]) == self.proc.pid:  # the parent pid
                pids.append(int(stat.parent.name))
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    out = tmp_path_factory.mktemp("torchrun")
    plans = write_plans(out)
    one_node = ["--standalone", "--nproc-per-node"]
    run = ["-m", "graphflow", "run"]
    port = _free_port()
    started = {
        "piecewise2": Job([*one_node, "2", *run, str(plans["piecewise2"]), "--steps", "0", "--json",
                           "--trace", str(out / "piecewise2")], out),
        "full3": Job([*one_node, "3", *run, str(plans["full3"]), "--steps", "0", "--trace", str(out / "full3")], out),
        "fault": Job([*one_node, "2", *run, str(plans["fault"]), "--steps", "0", "--no-verify", "--sizes",
                      str(max(SIZES)), "--json"], out),
        "placeholder": Job([*one_node, "2", *run, str(plans["placeholder"]), "--steps", "0", "--no-detectors",
                            "--json", "--trace", str(out / "placeholder")], out),
        "hang": Job([*one_node, "2", *run, str(plans["hang"]), "--steps", "0", "--json"], out),
    }
    for node in (0, 1):
        # Two agents, as on two hosts: node 0 hosts the rendezvous store. c10d numbers the
        # ranks in the order the agents join, so either node may hold rank 0.
        started[f"node{node}"] = Job(
            ["--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes",
             "--rdzv-conf", f"is_host={int(node == 0)},join_timeout=60", "--local-addr", "127.0.0.1",
             *run, str(plans["full2"]), "--steps", "0", "--trace", str(out / f"node{node}")], out)
    yield out, started
    for job in started.values():
        if job.proc.poll() is None:
            job.kill()
            job.proc.communicate()


def _json(stdout: str) -> dict:
    assert stdout.lstrip().startswith("{"), stdout
    return json.loads(stdout)


class TestOneNode:
    def test_two_ranks_capture_piecewise_and_rank_0_reports_both(self, jobs):
        out, started = jobs
        status, stdout, stderr, _ = started["piecewise2"].result()
        assert status == 0, stderr
        report = _json(stdout)  # rank 0's document only: the other rank prints nothing
        assert report["ok"] and report["world_size"] == 2 and report["group_backend"] == "gloo"
        assert [d["verify"]["bit_exact"] for d in report["descriptors"]] == [True] * len(SIZES)
        ranks = report["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1]
        assert all(r["ok"] and r["verify"] == "bit-exact" and r["device"] == "cpu" for r in ranks), ranks
        assert [r["graphs"] for r in ranks] == [(TINY["n_layers"] + 1) * len(SIZES)] * 2
        assert [pathlib.Path(r["trace"]).name for r in ranks] == ["rank0.jsonl", "rank1.jsonl"]

    def test_two_ranks_traces_agree(self, jobs, capsys):
        out, started = jobs
        assert started["piecewise2"].result()[0] == 0
        assert main(["trace", "diff", str(out / "piecewise2")]) == 0
        assert capsys.readouterr().out.startswith("2 traces agree")

    def test_three_ranks_capture_full_and_rank_0_prints_a_line_per_rank(self, jobs, capsys):
        out, started = jobs
        status, stdout, stderr, _ = started["full3"].result()
        assert status == 0, stderr
        lines = stdout.splitlines()
        assert lines[-1] == "dsv4-tp-full: captured on 3 rank(s) (gloo)"
        per_rank = lines[-4:-1]
        assert [line.split(" (")[0] for line in per_rank] == ["rank 0", "rank 1", "rank 2"]
        assert all(f"{len(SIZES)} graph(s), {len(SIZES)} descriptor(s), verify bit-exact" in line
                   for line in per_rank), per_rank
        assert sum(line.startswith("ok: dsv4-tp-full") for line in lines) == 1  # one report, rank 0's
        assert main(["trace", "diff", str(out / "full3")]) == 0
        assert capsys.readouterr().out.startswith("3 traces agree")


class TestTwoNodes:
    def test_two_agents_on_the_loopback_address_capture_with_identical_traces(self, jobs, tmp_path, capsys):
        out, started = jobs
        results = [started[f"node{n}"].result() for n in (0, 1)]
        assert [r[0] for r in results] == [0, 0], [r[2] for r in results]
        reports = [r[1] for r in results if r[1].strip()]
        assert len(reports) == 1, reports  # rank 0's node reports, the other prints nothing
        assert reports[0].splitlines()[-1] == "dsv4-tp-full: captured on 2 rank(s) (gloo)"
        # Each node wrote the trace of the rank it ran; gathered into one folder, they agree.
        written = sorted(p.name for n in (0, 1) for p in (out / f"node{n}").glob("rank*.jsonl"))
        assert written == ["rank0.jsonl", "rank1.jsonl"]
        for n in (0, 1):
            for path in (out / f"node{n}").glob("rank*.jsonl"):
                shutil.copy(path, tmp_path / path.name)
        assert main(["trace", "diff", str(tmp_path)]) == 0
        assert capsys.readouterr().out.startswith("2 traces agree")


class TestFailures:
    def test_a_fault_on_one_rank_ends_every_rank_with_its_error_within_the_timeout(self, jobs):
        _, started = jobs
        status, stdout, stderr, _ = started["fault"].result()
        assert status != 0  # torchrun's own status: the job failed
        report = _json(stdout)
        assert not report["ok"]
        ranks = report["ranks"]
        assert [r["ok"] for r in ranks] == [False, False]
        assert all(r["seconds"] < FAILURE_TIMEOUT_S for r in ranks), ranks
        fault = f"injected capture fault on rank {FAULTY_RANK}"
        assert "RuntimeError in region" in ranks[FAULTY_RANK]["error"] and fault in ranks[FAULTY_RANK]["error"]
        other = ranks[1 - FAULTY_RANK]["error"]
        assert "ranks diverged" in other
        assert f"rank {FAULTY_RANK} abandoned the pipeline: RuntimeError: {fault}" in other
        # Each rank printed its own error, and torchrun's summary names each rank's.
        assert stderr.count("graphflow: capture failed, rolled back: [phase=capture") == 2, stderr
        assert "traceback : CaptureError: [phase=capture" in stderr
        assert "traceback : DivergenceError: [phase=capture" in stderr

    def test_placeholder_warmup_ends_in_divergence_error_on_every_rank(self, jobs):
        out, started = jobs
        status, stdout, stderr, _ = started["placeholder"].result()
        assert status != 0
        ranks = _json(stdout)["ranks"]
        for r in ranks:
            assert not r["ok"] and r["error"].startswith("[phase=warmup"), r
            assert "ranks diverged at barrier 'all_reduce ep_ar" in r["error"]
            assert r["seconds"] < FAILURE_TIMEOUT_S
        assert stderr.count("traceback : DivergenceError: [phase=warmup") == 2, stderr
        assert main(["trace", "diff", str(out / "placeholder")]) == 1

    def test_a_rank_that_hangs_ends_the_job_after_the_barrier_timeout(self, jobs):
        _, started = jobs
        status, stdout, stderr, _ = started["hang"].result()
        assert status != 0
        ranks = _json(stdout)["ranks"]
        assert ranks[FAULTY_RANK] is None  # it never got to say anything
        waiting = ranks[1 - FAULTY_RANK]
        assert not waiting["ok"] and waiting["error"].startswith("[phase=warmup"), waiting
        assert (f"rank(s) {FAULTY_RANK} did not reach barrier 'all_reduce tp_ar" in waiting["error"]
                and f"within {HANG_TIMEOUT_S:g} s" in waiting["error"])
        assert waiting["seconds"] < FAILURE_TIMEOUT_S
        assert "(SIGTERM)" in stderr  # torchrun stopped the hung rank once the other had failed


STORE = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}


@pytest.mark.parametrize(("env", "backend", "message"), [
    ({}, "gloo", r"^RANK and WORLD_SIZE are not set: start the ranks with torchrun"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "gloo", r"^MASTER_ADDR is not set"),
    ({"RANK": "2", "WORLD_SIZE": "2", **STORE}, "gloo", r"^RANK 2 is outside the job's ranks 0\.\.1 \(WORLD_SIZE 2\)$"),
    ({"RANK": "0", "WORLD_SIZE": "1", **STORE}, "nccl", r"^the nccl backend needs a GPU per rank and torch sees none"),
], ids=["no-rank", "no-store", "rank-outside", "nccl-without-gpu"])
def test_joined_outside_a_job_names_what_to_set(monkeypatch, env, backend, message):
    """The errors of a process that is not (rightly) a rank, before any process group exists."""
    import torch

    if backend == "nccl" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    for name in (*RANK_VARIABLES, *NVLS_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert in_job() == ("RANK" in env)
    with pytest.raises(ValueError, match=message):
        with joined(backend):
            pass


class TestRankRefusesBadInput:
    """A rank's checks before it joins: what every rank of a wrong job says, in-process."""

    def test_a_plan_for_another_world_size_exits_2_and_tells_torchrun(self, tmp_path, monkeypatch, capsys):
        plans = write_plans(tmp_path)
        error_file = tmp_path / "error.json"
        for name, value in (("RANK", "1"), ("WORLD_SIZE", "3"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1"),
                            ("TORCHELASTIC_ERROR_FILE", str(error_file))):
            monkeypatch.setenv(name, value)
        assert main(["run", str(plans["full2"])]) == 2
        message = (f"{plans['full2']}: the plan is written for world_size 2, the job has 3 rank(s) — set world_size "
                   "in the plan or start 2 (nodes × processes per node)")
        assert capsys.readouterr().err == f"graphflow: {message}\n"
        recorded = json.loads(error_file.read_text())["message"]  # what torchrun's summary shows for the rank
        assert recorded["message"] == recorded["extraInfo"]["py_callstack"] == f"CommandError: {message}"
