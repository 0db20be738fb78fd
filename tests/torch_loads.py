"""What a process says on stderr before torch starts to load: the first line a person
waits for. Tests of commands and scripts that must speak before the seconds (tens, on a
busy machine) torch and the model take."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: Runs a module (``graphflow``) or a script as ``python -m``/``python`` does, saying on
#: stderr when torch starts to load.
_RUN = """
import importlib.abc, runpy, sys

class Torch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            print("<torch loads>", file=sys.stderr, flush=True)

sys.meta_path.insert(0, Torch())
sys.argv = sys.argv[1:]
if sys.argv[0].endswith(".py"):
    runpy.run_path(sys.argv[0], run_name="__main__")
else:
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def before_torch(*argv: str) -> list[str]:
    """The stderr lines of ``python -m argv[0] ...`` (or ``python argv[0] ...`` for a
    script) before torch starts to load; the process is stopped there (it must get there)."""
    process = subprocess.Popen([sys.executable, "-c", _RUN, *argv], cwd=ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        for line in process.stderr:
            if line.rstrip("\n") == "<torch loads>":
                return lines
            lines.append(line.rstrip("\n"))
    finally:
        process.kill()
        process.wait()
    raise AssertionError(f"torch never loaded: {lines}")
