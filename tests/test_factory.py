"""A plan's model factory, looked up before anything runs (``graphflow.plan.factory``).

``graphflow validate`` and ``graphflow run`` find the factory's module and read its
names from the source, importing nothing (no torch, none of the user's code): a typo in
``model:`` is exit 2 with the plan's file, the line of ``model:`` and what it most likely
meant, before a model is built. When the module runs code to make its names (a module
``__getattr__``, ``from x import *``) the lookup cannot tell, and says nothing; ``run``
then imports it and says the same, with the names the module really has.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from graphflow.cli import main
from graphflow.errors import PlanError
from graphflow.plan.factory import find_factory
from graphflow.plan.loader import loads_plan

ROOT = Path(__file__).resolve().parent.parent
#: The toy plan, its factory named from the checkout's root.
TOY = (ROOT / "plans" / "toy.yaml").read_text().replace('"toy_model:build_toy"', "plans.toy_model:build_toy")


def _plan_file(folder: Path, model: str) -> Path:
    path = folder / "typo.yaml"
    path.write_text(TOY.replace("model: plans.toy_model:build_toy", f"model: {model}"))
    return path


def _model_line(path: Path) -> int:
    return next(n for n, line in enumerate(path.read_text().splitlines(), 1) if line.startswith("model:"))


@pytest.fixture
def here(tmp_path, monkeypatch):
    """The checkout as the working directory (``plans.toy_model`` resolves from it), the
    plan files in a folder of their own."""
    monkeypatch.chdir(ROOT)
    return tmp_path


class TestLookup:
    @pytest.mark.parametrize(("model", "said"), [
        ("plans.toy_model:buld_toy", "module 'plans.toy_model' has no attribute 'buld_toy' (model "
                                     "'plans.toy_model:buld_toy'; did you mean 'build_toy'?)"),
        ("plans.toy_modle:build_toy", "cannot find module 'plans.toy_modle' for model 'plans.toy_modle:build_toy'"),
        ("graphflow.integrations.dsv4:build_modle", "module 'graphflow.integrations.dsv4' has no attribute "
                                                    "'build_modle' (model 'graphflow.integrations.dsv4:build_modle'; "
                                                    "did you mean 'build_model'?)"),
    ])
    def test_a_typo_is_named_at_the_model_line(self, here, model, said):
        path = _plan_file(here, model)
        with pytest.raises(PlanError) as info:
            find_factory(loads_plan(path.read_text(), str(path)))
        assert (info.value.file, info.value.line, info.value.element) == (str(path), _model_line(path), "model")
        assert info.value.message.startswith(said)

    def test_a_module_typo_suggests_its_sibling(self, here):
        with pytest.raises(PlanError) as info:
            find_factory(loads_plan(TOY.replace("plans.toy_model:", "plans.toy_modle:")))
        assert "(did you mean 'plans.toy_model'?) — put the module beside the plan" in info.value.message

    @pytest.mark.parametrize("model", ["plans.toy_model:build_toy", "graphflow.integrations.dsv4:build_model",
                                       "plans.toy_model:Toy.forward", "os.path:join", "collections:OrderedDict",
                                       "graphflow:Session", "graphflow.integrations.hf:static_cache"])
    def test_a_factory_that_is_there_passes(self, here, model):
        find_factory(loads_plan(TOY.replace("plans.toy_model:build_toy", model)))

    @pytest.mark.parametrize("source", [
        "def __getattr__(name):\n    return lambda: name\n",
        "from os.path import *\n",
    ], ids=["module __getattr__", "star import"])
    def test_names_made_when_the_module_runs_are_not_judged(self, tmp_path, monkeypatch, source):
        monkeypatch.chdir(tmp_path)
        (tmp_path / "dynamic_model.py").write_text(source)
        find_factory(loads_plan(TOY.replace("plans.toy_model:build_toy", "dynamic_model:anything")))

    def test_a_module_beside_the_plan_is_found(self, tmp_path, monkeypatch):
        monkeypatch.chdir("/")
        folder = tmp_path / "job"
        folder.mkdir()
        (folder / "beside_plan_factory.py").write_text(textwrap.dedent("""
            import torch

            if torch.cuda.is_available():
                def build():
                    return 1
            else:
                class build:
                    pass
            """))
        path = _plan_file(folder, "beside_plan_factory:build")
        find_factory(loads_plan(path.read_text(), str(path)))
        with pytest.raises(PlanError, match=r"has no attribute 'biuld' .*did you mean 'build'\?"):
            find_factory(loads_plan(path.read_text().replace(":build", ":biuld"), str(path)))

    def test_nothing_is_imported(self, here):
        code = ("import sys; from graphflow.plan.factory import find_factory; from graphflow.plan.loader import "
                "loads_plan; find_factory(loads_plan(sys.stdin.read())); "
                "assert not {'torch', 'plans.toy_model', 'graphflow.integrations.dsv4'} & set(sys.modules)")
        done = subprocess.run([sys.executable, "-c", code], input=TOY, cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr


@given(st.from_regex(r"[a-z][a-z_]{0,11}", fullmatch=True) | st.sampled_from(["build_toy", "toy_plan", "torch"]))
def test_a_name_the_module_lacks_is_refused_and_one_it_has_is_not(name):
    names = {"build_toy", "toy_plan", "annotations", "torch", "nn"}  # plans/toy_model.py's, in lower case
    plan = loads_plan(TOY.replace("plans.toy_model:build_toy", f"plans.toy_model:{name}"))
    try:
        find_factory(plan, search=[str(ROOT)])
    except PlanError as error:
        assert name not in names and f"has no attribute {name!r}" in error.message
    else:
        assert name in names


class TestCommands:
    def test_validate_exits_2_naming_the_line_and_what_was_meant(self, here, capsys):
        path = _plan_file(here, "plans.toy_model:buld_toy")
        assert main(["validate", str(path)]) == 2
        out, err = capsys.readouterr()
        assert out == ""
        assert err == (f"graphflow: {path}:{_model_line(path)}: model: module 'plans.toy_model' has no attribute "
                       "'buld_toy' (model 'plans.toy_model:buld_toy'; did you mean 'build_toy'?)\n")

    def test_validate_json_says_it_as_an_unreadable_plan(self, here, capsys):
        path = _plan_file(here, "plans.toy_model:buld_toy")
        assert main(["validate", "--json", str(path)]) == 2
        (document,) = json.loads(capsys.readouterr().out)
        assert (document["status"], document["error"]["line"], document["error"]["element"]) == (
            "unreadable", _model_line(path), "model")

    def test_run_refuses_before_torch_is_imported(self, here):
        path = _plan_file(here, "plans.toy_model:buld_toy")
        code = ("import sys; from graphflow.cli import main; status = main(['run', sys.argv[1], '--backend', 'cpu']); "
                "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(status)")
        done = subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 2, done.stderr
        assert done.stderr == (f"graphflow: {path}:{_model_line(path)}: model: module 'plans.toy_model' has no "
                               "attribute 'buld_toy' (model 'plans.toy_model:buld_toy'; did you mean 'build_toy'?)\n")


class TestImport:
    """What the lookup cannot judge, the import at run time says the same way."""

    def test_a_name_the_module_makes_when_it_runs_is_named_with_its_real_names(self, tmp_path, monkeypatch):
        from graphflow.engine.model.binding import import_factory

        monkeypatch.chdir(tmp_path)
        (tmp_path / "made_names.py").write_text("globals().update(build_model=lambda: 1)\n"
                                                "def __getattr__(name):\n    raise AttributeError(name)\n")
        path = _plan_file(tmp_path, "made_names:build_modle")
        plan = loads_plan(path.read_text(), str(path))
        find_factory(plan)  # cannot tell
        with pytest.raises(PlanError) as info:
            import_factory(plan.model, plan=plan)
        assert (info.value.file, info.value.line) == (str(path), _model_line(path))
        assert info.value.message == ("module 'made_names' has no attribute 'build_modle' (model "
                                      "'made_names:build_modle'; did you mean 'build_model'?)")
