"""Host state: plain Python values a step changes, which no graph can see.

A graph replays the kernels it recorded with the values their launches were given at
capture. A model that keeps part of its state in Python (a position counter as an
``int``, a "cache is full" ``bool``, a length read by the code that builds a mask) and
changes it on every step runs correctly eagerly, but its graph keeps the value it saw
when captured: every replay then computes with that one value, and wrong results come
from the first step on (Hugging Face's sliding-window cache layers kept such an int).
Verify, when on, refuses such a capture without being able to say which value was the
cause; with verify off nothing did.

So warmup, on the descriptors the detectors watch (``Check.HOST_STATE``), reads every
such value before and after the last warm step and raises on a change, naming the
object path and both values. It reads ints, floats, bools and tuples of them held in
the attributes of the model's modules and of the objects they hold (a cache and its
layers, to a few levels; not graphflow's own objects, such as the channel handles a
model holds), and of the objects the plan adopts tensors from. A value that
appears for the first time is not a change: lazy initialization at the first call is
done once, before any capture.
"""

from __future__ import annotations

import enum
import types
from collections.abc import Iterator, Mapping

import torch

from graphflow.errors import CaptureError

__all__ = ["changes", "check_unchanged", "snapshot"]

#: How far from a module the walk follows plain objects (module -> cache -> layers -> layer).
DEPTH = 3
_SCALARS = (bool, int, float)
#: Values that are not the model's state even where they sit beside it.
_SKIPPED_TYPES = (torch.Tensor, torch.nn.Parameter, type, types.FunctionType, types.MethodType,
                  types.BuiltinFunctionType, types.ModuleType, enum.Enum, torch.dtype, torch.device)
#: nn.Module's own bookkeeping: its children, tensors and hooks are walked (or not) elsewhere.
_MODULE_INTERNALS = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set",
                               "_backward_pre_hooks", "_backward_hooks", "_forward_hooks", "_forward_pre_hooks",
                               "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                               "_forward_pre_hooks_with_kwargs", "_state_dict_hooks", "_state_dict_pre_hooks",
                               "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks"})


def snapshot(model: object, extra: Mapping[str, object] = {}) -> dict[str, object]:
    """Every plain value the walk reaches (see the module docstring), by its path from
    the model (``layers.3.attn.window``, ``cache.layers.0.cumulative_length_int``);
    ``extra`` adds objects by the path they are known by (an adopted tensor's owner)."""
    values: dict[str, object] = {}
    seen: set[int] = set()
    roots: list[tuple[str, object]] = []
    if isinstance(model, torch.nn.Module):
        roots += [(path, module) for path, module in model.named_modules()]
    else:
        roots.append(("", model))
    roots += list(extra.items())
    for path, root in roots:
        for name, value in _walk(root, path, DEPTH, seen):
            values.setdefault(name, value)
    return values


def changes(before: Mapping[str, object], after: Mapping[str, object]) -> list[tuple[str, object, object]]:
    """(path, before, after) for each value present in both and different."""
    return [(path, before[path], value) for path, value in after.items()
            if path in before and before[path] != value]


def check_unchanged(before: Mapping[str, object], after: Mapping[str, object]) -> None:
    """Raise a CaptureError naming every value one step changed."""
    changed = changes(before, after)
    if not changed:
        return
    shown = "; ".join(f"{path}: {old!r} -> {new!r}" for path, old, new in changed[:8])
    more = f" (and {len(changed) - 8} more)" if len(changed) > 8 else ""
    raise CaptureError(
        f"one eager step changed {len(changed)} value(s) the model keeps in Python, which a graph cannot see: "
        f"{shown}{more}. A replay runs no Python: the graph keeps the value it saw at capture and every step "
        f"computes with it",
        hint="keep that state in a tensor the plan owns (a buffer that adopts it: adopt: <path>) and update it in "
             "place, or keep it out of the step; if only an eager segment reads and writes it (it runs at every "
             "replay), turn this check off with RunOptions(disabled_checks={'host_state'})")


def _walk(owner: object, path: str, depth: int, seen: set[int]) -> Iterator[tuple[str, object]]:
    if id(owner) in seen:
        return
    seen.add(id(owner))
    module = isinstance(owner, torch.nn.Module)
    try:
        attributes = vars(owner)
    except TypeError:  # no __dict__ (slots, builtins): nothing of the model's own
        return
    for name, value in list(attributes.items()):
        if module and (name in _MODULE_INTERNALS or name == "training"):
            continue
        where = f"{path}.{name}" if path else name
        if _plain(value):
            yield where, value
        elif depth > 0 and not _is_module(value):
            yield from _inside(value, where, depth - 1, seen)


def _inside(value: object, path: str, depth: int, seen: set[int]) -> Iterator[tuple[str, object]]:
    """The plain values of an object an attribute holds: its own attributes, or the
    items of a list, tuple or dict of objects."""
    if isinstance(value, _SKIPPED_TYPES) or value is None or isinstance(value, (str, bytes)):
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            if not _plain(item) and not _is_module(item):
                yield from _inside(item, f"{path}.{index}", depth, seen)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and not _plain(item) and not _is_module(item):
                yield from _inside(item, f"{path}.{key}", depth, seen)
        return
    if callable(value) and not hasattr(value, "__dict__"):
        return
    if type(value).__module__.partition(".")[0] == "graphflow":  # channel handles, JIT kernels: graphflow's own
        return
    yield from _walk(value, path, depth, seen)


def _is_module(value: object) -> bool:
    """Modules are walked from the model's ``named_modules``, under their own path."""
    return isinstance(value, torch.nn.Module)


def _plain(value: object) -> bool:
    if isinstance(value, _SCALARS) and not isinstance(value, enum.Enum):
        return True
    return isinstance(value, tuple) and bool(value) and all(_plain(item) for item in value)
