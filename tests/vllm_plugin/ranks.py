"""Rank processes on loopback for the plugin's multi-rank tests: each runs a worker script
of this folder and writes its results as JSON."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(worker: str, argvs: list[list[str]], root, timeout_s: float, hung: str) -> list:
    """``worker`` once per argument list (rank order), with the plugin's barrier timeout
    set; each rank's JSON results (``root/rank{N}.json``). A rank that hangs fails the
    test with ``hung``; a rank that fails, with the ranks' logs."""
    env = {**os.environ, "GRAPHFLOW_VLLM_TIMEOUT_S": str(timeout_s)}
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, worker), *argv], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for argv in argvs]
    logs = []
    for proc in procs:
        try:
            logs.append(proc.communicate(timeout=600)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(hung)
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    return [json.loads((root / f"rank{rank}.json").read_text()) for rank in range(len(argvs))]
