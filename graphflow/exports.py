"""A package's names, each imported from its module on first use.

Importing a package then imports nothing heavy: ``graphflow.engine`` no torch, and the
Hugging Face integration neither torch nor transformers, until a name that needs them is
asked for. A command reached through such a package (``python -m
graphflow.integrations.hf.batching.server``) can say what it does, or refuse its
arguments, in a fraction of a second instead of after the seconds those imports take.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping

__all__ = ["lazy_names"]


def lazy_names(package: str, names: Mapping[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package``: ``names`` maps each public name to the
    module of the package that holds it."""

    def __getattr__(name: str) -> object:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    return __getattr__
