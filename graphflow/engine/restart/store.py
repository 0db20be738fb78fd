"""Saved graphs on disk: a readable ``manifest.json`` (the key, the descriptors, what
was left out and why) beside ``graphs.pickle``, read back with an unpickler that makes
nothing but the saved data classes and plain values."""

from __future__ import annotations

import io
import json
import pathlib
import pickle

import attrs

from graphflow.engine.restart import saved

__all__ = ["SavedGraphsError", "load", "write"]

MANIFEST, GRAPHS = "manifest.json", "graphs.pickle"
_CLASSES = {name: getattr(saved, name) for name in saved.__all__}


class SavedGraphsError(Exception):
    """A directory that holds no saved graphs graphflow can read (says why)."""


def write(run: saved.SavedRun, directory: pathlib.Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / GRAPHS).write_bytes(pickle.dumps(run, protocol=5))
    manifest = {"key": run.key, "descriptors": [{"size": d.size, "mode": d.mode, **({"key": d.key} if d.key else {}),
                                                "graphs": len(d.graphs), "nodes": sum(g.node_count for g in d.graphs)}
                                               for d in run.descriptors],
                "left out": [{"size": size, "mode": mode, "why": why} for size, mode, why in run.left_out],
                "regions": {kind: sum(r.kind == kind for r in run.regions.values())
                            for kind in ("model", "buffer", "pool", "memory")}}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def load(directory: pathlib.Path) -> saved.SavedRun:
    path = directory / GRAPHS
    if not path.is_file():
        raise SavedGraphsError(f"{directory} holds no saved graphs ({GRAPHS} missing)")
    try:
        run = _Unpickler(io.BytesIO(path.read_bytes())).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as exc:
        raise SavedGraphsError(f"{path} cannot be read: {exc}") from exc
    if not isinstance(run, saved.SavedRun):
        raise SavedGraphsError(f"{path} holds no saved run")
    return run


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == saved.__name__ and name in _CLASSES and attrs.has(_CLASSES[name]):
            return _CLASSES[name]
        if (module, name) in (("copyreg", "_reconstructor"), ("builtins", "object")):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of saved graphs")
