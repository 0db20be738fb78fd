"""A server's FULL keys saved, and a new process serving from them, on the GPU, each
server a process of its own (``tests/serving_restart_run.py``): the restored keys are
built from saved nodes, none is captured but those that find kernels, every restored
key's first batch matches the engine's eager step, and the tokens are the engine's
eager ones; a server with another plan is refused in one line and captures."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.cuda, pytest.mark.slow]

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(role: str, directory: pathlib.Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "tests.serving_restart_run", role, str(directory)], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_new_server_serves_from_the_saved_keys_and_a_changed_plan_captures(tmp_path):
    saved = _run("save", tmp_path)
    print(saved["report"])
    assert saved["tokens"] == saved["eager"]
    assert saved["saved"]["saved"] > 0 and not saved["saved"]["left_out"], saved["saved"]
    restored = _run("restore", tmp_path)
    print(restored["restart"], restored["report"], sep="\n")
    restart = restored["restart"]
    assert restart["refused"] is None and not restart["left_out"], restart
    assert restart["restored"] >= 1 and restart["restored"] + restart["captured"] == saved["saved"]["saved"]
    assert restart["built"]["nodes"] > 0
    assert restored["tokens"] == saved["eager"]
    assert restored["checks"]["failed"] == 0 and restored["checks"]["on_first_use"] > 0, restored["report"]
    changed = _run("changed", tmp_path)
    assert "plan differs" in changed["restart"]["refused"] and "\n" not in changed["restart"]["refused"]
    assert changed["restart"]["restored"] == 0 and changed["tokens"] == saved["eager"]
