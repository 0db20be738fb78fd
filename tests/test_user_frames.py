"""Where the user's code failed, said by the command line, and its exit statuses as
docs/cli.md's table gives them (every row a CPU can produce)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from graphflow.cli import main

TOY = Path("plans/toy.yaml").resolve()

MODEL = '''\
import sys

sys.path.insert(0, {plans!r})
from toy_model import build_toy


def explode(x, logits):
    raise {error}("boom")


def build(layers, hidden, vocab, seed, fail_in_factory=False):
    model = build_toy(layers=layers, hidden=hidden, vocab=vocab, seed=seed)
    if fail_in_factory:
        raise ValueError("no weights here")
    model.head = explode
    return model
'''


def _line(path: Path, text: str) -> int:
    return next(n for n, line in enumerate(path.read_text().splitlines(), 1) if text in line)


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A plan beside its own model, mine.py, whose head segment raises; run from there."""
    def make(error: str = "RuntimeError", model: str = "mine:build", **model_args):
        (tmp_path / "mine.py").write_text(MODEL.format(plans=str(TOY.parent), error=error))
        plan = TOY.read_text().replace("toy_model:build_toy", model)
        for key, value in model_args.items():
            plan = plan.replace("seed: 0}", f"seed: 0, {key}: {value}}}")
        (tmp_path / "plan.yaml").write_text(plan)
        return tmp_path
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])  # this test's mine.py, not an earlier one's
    monkeypatch.delenv("GRAPHFLOW_DEBUG", raising=False)
    sys.modules.pop("mine", None)
    yield make
    sys.modules.pop("mine", None)


def run(capsys, *before):
    """``graphflow [BEFORE...] run plan.yaml`` on the CPU: its status and stderr."""
    status = main([*before, "run", "plan.yaml", "--backend", "cpu", "--quiet"])
    return status, capsys.readouterr().err


class TestWhereTheUserCodeFailed:
    def test_the_one_line_ends_with_the_raise_in_the_segment(self, home, capsys):
        folder = home()
        status, err = run(capsys)
        line = _line(folder / "mine.py", 'raise RuntimeError("boom")')
        first = err.splitlines()[0]
        assert status == 1
        assert "segment=head" in first and "RuntimeError: boom" in first
        assert first.endswith(f"(at mine.py:{line})")
        assert "where in your code" not in err

    def test_debug_lists_the_user_frames_with_their_source(self, home, capsys):
        folder = home()
        status, err = run(capsys, "--debug")
        line = _line(folder / "mine.py", 'raise RuntimeError("boom")')
        assert status == 1
        assert "graphflow: where in your code (most recent call last):" in err
        assert f"mine.py:{line} in explode" in err
        assert 'raise RuntimeError("boom")' in err
        assert "graphflow/engine" not in err and "torch/" not in err  # only the user's own frames

    def test_graphflow_debug_in_the_environment_does_the_same(self, home, capsys, monkeypatch):
        folder = home()
        monkeypatch.setenv("GRAPHFLOW_DEBUG", "1")
        status, err = run(capsys)
        assert status == 1
        assert f"mine.py:{_line(folder / 'mine.py', 'raise RuntimeError')} in explode" in err

    def test_a_factory_that_raises(self, home, capsys):
        folder = home(fail_in_factory="true")
        status, err = run(capsys, "--debug")
        line = _line(folder / "mine.py", 'raise ValueError("no weights here")')
        assert status == 1
        assert err.splitlines()[0].endswith(f"(at mine.py:{line})")
        assert f"mine.py:{line} in build" in err

    def test_a_subprocess_run_says_it_too(self, home):
        folder = home()
        proc = subprocess.run([sys.executable, "-m", "graphflow", "--debug", "run", "plan.yaml", "--backend", "cpu",
                               "--quiet"], capture_output=True, text=True, cwd=folder,
                              env={"PYTHONPATH": str(TOY.parent.parent), "PATH": "/usr/bin:/bin"})
        line = _line(folder / "mine.py", 'raise RuntimeError("boom")')
        assert proc.returncode == 1
        assert proc.stderr.splitlines()[0].endswith(f"(at mine.py:{line})")
        assert "Traceback" not in proc.stderr


    def test_an_installed_packages_frames_are_not_the_users(self, capsys, tmp_path):
        """PyYAML's parser raised the syntax error: the user's file is the plan, which the
        message names already, and no frame of an installed package is pointed at."""
        plan = tmp_path / "broken.yaml"
        plan.write_text("graphflow: 1\nname: x\n  bad: [\n")
        assert main(["run", str(plan), "--quiet"]) == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert "broken.yaml:3: YAML syntax error" in line and "(at " not in line


class TestExitStatusTable:
    """Each row of docs/cli.md's table of exit statuses."""

    def test_0_success(self, capsys):
        assert main(["run", str(TOY), "--backend", "cpu", "--quiet", "--sizes", "1"]) == 0

    def test_1_the_plan_has_errors(self, capsys, tmp_path):
        plan = tmp_path / "broken.yaml"
        plan.write_text(TOY.read_text().replace("reads: [x], writes: [logits]", "reads: [nowhere], writes: [logits]"))
        assert main(["validate", str(plan)]) == 1

    def test_1_capture_failed(self, home, capsys):
        home()
        assert run(capsys)[0] == 1

    def test_2_a_plan_that_cannot_be_read(self, capsys, tmp_path):
        assert main(["run", str(tmp_path / "missing.yaml")]) == 2
        (tmp_path / "bad.yaml").write_text("graphflow: 1\nname: [unclosed\n")
        assert main(["run", str(tmp_path / "bad.yaml")]) == 2

    def test_2_a_factory_module_that_does_not_exist(self, home, capsys):
        home(model="nosuchmodule:build")
        status, err = run(capsys)
        assert status == 2
        assert "plan.yaml:5: model: cannot find module 'nosuchmodule'" in err

    def test_2_bad_arguments(self, capsys):
        assert main(["run", str(TOY), "--sizes", "1,x"]) == 2
        with pytest.raises(SystemExit) as exit_:
            main(["run", str(TOY), "--no-such-flag"])
        assert exit_.value.code == 2

    def test_130_interrupted(self, home, capsys):
        home(error="KeyboardInterrupt")
        status, err = run(capsys)
        assert status == 130
        assert err.splitlines()[-1] == "graphflow: interrupted"
