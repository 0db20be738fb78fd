"""The README's examples are code a newcomer copies: they must run as written."""

import pathlib
import re
import shlex

import pytest

from graphflow import Plan, loads_plan, validate

README = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, re.S)


def test_the_yaml_example_loads_and_validates_clean():
    (text,) = _blocks("yaml")
    plan = loads_plan(text, file="README.md")
    assert [s.name for s in plan.segments[:3]] == ["L0.pre", "L0.attn", "L0.post"]
    assert validate(plan).diagnostics == ()


def test_the_decorator_example_builds_a_clean_plan_that_captures_on_the_cpu_backend():
    pytest.importorskip("torch")
    from graphflow.engine import RunOptions, run_pipeline

    (code,) = _blocks("python")
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    plan = namespace["plan"]
    assert isinstance(plan, Plan)
    assert validate(plan).diagnostics == ()
    engine = run_pipeline(plan, RunOptions(backend="cpu"), model=namespace["Model"]().requires_grad_(False))
    with engine:
        assert [r.bit_exact for r in engine.report.verify] == [True, True, True]


def test_the_setup_commands_are_the_ones_ci_runs():
    commands = dict(re.findall(r"^# (run the main job|run the tests)\n(.+)$", README, re.M))
    assert set(commands) == {"run the main job", "run the tests"}
    assert shlex.split(commands["run the main job"])[-3:] == ["graphflow", "run", "plans/dsv4_mini_piecewise.yaml"]
    assert (pathlib.Path(__file__).resolve().parents[1] / "plans/dsv4_mini_piecewise.yaml").is_file()
