"""100 cycles of capture, rollback at every phase and lazy capture in one process: device
memory flat after the first, counted whole (``memory_allocated`` and ``memory_reserved``
as they are, nothing cleared or left out).

The cycles run in a fresh process (tests/cuda/cycles.py), so nothing another test made
is counted, and the first cycle pays for what the process makes once (graphflow's
streams and their cuBLAS workspaces, CUDA's and the allocator's own first blocks).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cuda

MiB = 1 << 20
CYCLES = 100


def test_a_hundred_cycles_leave_device_memory_flat(tmp_path):
    out = tmp_path / "cycles.json"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-m", "tests.cuda.cycles", "--cycles", str(CYCLES), "--out", str(out)],
                          cwd=root, capture_output=True, text=True, timeout=540)
    print(done.stdout, done.stderr[-4000:])
    assert done.returncode == 0
    rows = json.loads(out.read_text())["cycles"]
    assert len(rows) == CYCLES
    for key in ("allocated", "reserved"):
        first = rows[0][key]
        worst = max(abs(row[key] - first) for row in rows[1:])
        assert worst <= MiB, f"{key} moved by {worst / MiB:.1f} MiB after the first cycle: " + ", ".join(
            f"{row[key] / MiB:.1f}" for row in rows[:12])
