"""What must match for saved graphs to be used: everything that decides which kernels a
step launches and with what arguments, besides the batch.

A graph is only a recording of launches: another GPU, driver, torch or CUDA picks other
kernels; another plan or graphflow records other regions; another model (its code, its
tensors' names, shapes and dtypes) launches other work. Any difference refuses the
saved graphs with one line that says which part differs, and the run captures.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import sys

import torch

from graphflow.engine.restart.driver import driver_version
from graphflow.engine.restart.regions import model_tensors

__all__ = ["differs", "restart_key"]


def restart_key(plan, model: object, device: torch.device) -> dict[str, str]:
    key = {
        "gpu": torch.cuda.get_device_name(device),
        "driver": driver_version(),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "python": sys.version.split()[0],
        "graphflow": _graphflow_version(),
        "plan": _digest(repr(plan)),
        "model code": _digest(_source(model)),
        "model tensors": _digest(";".join(f"{name}:{tuple(t.shape)}:{t.dtype}:{tuple(t.stride())}"
                                          for name, t in model_tensors(model))),
    }
    return {name: f"{value}" for name, value in key.items()}  # plain str: torch's version is a subclass


def differs(saved: dict[str, str], current: dict[str, str]) -> str | None:
    """Which parts of the key differ, as a user reads them; None when all match."""
    parts = [f"{name} {saved.get(name)} when saved, {current.get(name)}" if name in _VERSIONS else name
             for name in sorted(set(saved) | set(current)) if saved.get(name) != current.get(name)]
    return "; ".join(parts) or None


#: The parts of the key a user reads as they are (the others are digests, said by name).
_VERSIONS = ("gpu", "driver", "torch", "cuda", "python", "graphflow")


def _graphflow_version() -> str:
    try:
        return importlib.metadata.version("graphflow")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "checkout"


def _source(model: object) -> str:
    """The source of the module that defines the model's class (its step's code)."""
    try:
        return inspect.getsource(sys.modules[type(model).__module__])
    except (OSError, TypeError, KeyError):
        return type(model).__qualname__


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]
