"""The package's public surface: small, importable, and never a name hiding a module."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

import graphflow

#: Packages an integration imports that only its extra installs: ``cuda`` (cuda-python's
#: bindings) and ``cutlass`` come with the cutedsl extra, which the test extra leaves out.
OPTIONAL_PACKAGES = {"triton", "cutlass", "cuda", "vllm", "transformers"}


def test_every_exported_name_resolves():
    for name in graphflow.__all__:
        assert getattr(graphflow, name) is not None, name


def test_the_top_level_stays_small():
    assert len(graphflow.__all__) <= 30


def test_no_attribute_of_a_package_hides_its_submodule():
    packages = [graphflow, importlib.import_module("graphflow.engine"), importlib.import_module("graphflow.cli")]
    for package in packages:
        for info in pkgutil.iter_modules(package.__path__):
            if info.name.startswith("__"):  # __main__ runs the CLI
                continue
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            assert getattr(package, info.name) is module, f"{package.__name__}.{info.name} is not the module"


def test_the_rule_table_is_reached_through_its_module():
    import graphflow.plan.rules as rules

    assert rules.RULES and graphflow.validate is rules.validate


def test_no_two_public_classes_share_a_name():
    seen: dict[str, str] = {}
    for info in pkgutil.walk_packages(graphflow.__path__, "graphflow."):
        if info.name.endswith("__main__"):  # runs the CLI
            continue
        try:
            module = importlib.import_module(info.name)
        except ModuleNotFoundError as missing:  # an integration whose extra is not installed here
            assert missing.name.split(".")[0] in OPTIONAL_PACKAGES, missing
            continue
        for name in getattr(module, "__all__", ()):
            value = getattr(module, name)
            if isinstance(value, type) and value.__module__ == module.__name__:
                assert name not in seen, f"{name} is public in both {seen.get(name)} and {module.__name__}"
                seen[name] = module.__name__


def test_importing_graphflow_imports_no_torch():
    code = "import sys, graphflow; graphflow.validate; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
