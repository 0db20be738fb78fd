"""Eager breaks at submodule calls: a PIECEWISE capture of one callable, cut at its submodules.

A Hugging Face decoder's ``forward`` calls every layer's ``self_attn``; capturing it
PIECEWISE with attention eager used to mean restating the forward as plan segments. A
segment's ``breaks`` (``model.layers.*.self_attn``) says instead where its one call is
cut, and this module makes the cut:

1. **allocate** (``Splitter``): the submodules the patterns match have their
   ``forward`` wrapped (an instance attribute, removed again on rollback or close);
   a pattern matching nothing is an error naming the segment. Outside the segment's
   own calls (the model used directly, a reference forward) a wrapper only calls the
   original.
2. **warmup**: each break call runs the submodule and records its output's structure
   (tensor shapes, dtypes and the other values), keyed by its position in the
   segment's call and its arguments' shapes. For a PIECEWISE descriptor the detectors
   let it read values on the host (``Detectors.eager``), as they let an eager segment.
3. **capture**, PIECEWISE: at a break the wrapper asks the backend to ``cut``: the
   graph being recorded ends, outputs shaped like the recorded ones are allocated
   outside any graph, the next graph begins, and the wrapper returns those outputs to
   the rest of the forward, which goes on being captured. The submodule does not run
   (its inputs hold nothing yet). Its arguments are kept: graph memory keeps its
   address, so the graph before the cut refills them on every replay.
4. **replay**: graph, then the submodule called eagerly on the kept arguments with its
   result copied into the outputs the next graph reads, then the next graph...: one
   ``Graph`` whose replay runs them in order, so the engine's regions and programs
   are unchanged. FULL capture calls the submodules inside its one graph; a backend
   that records no graph (the CPU) runs them where they are called.

A break's output must be tensors, tuples, lists, dicts or plain values, of one
structure at one size; plain values are those warmup saw.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import attrs
import torch

from graphflow.engine.context import Context
from graphflow.errors import CaptureError, PlanError
from graphflow.events import Phase
from graphflow.plan import Mode, Segment

__all__ = ["Splitter", "matching"]


def matching(model: object, patterns: tuple[str, ...]) -> dict[str, list[tuple[str, object]]]:
    """The submodules each pattern names, by path: ``*`` stands for any one part."""
    modules = list(model.named_modules()) if isinstance(model, torch.nn.Module) else []
    found: dict[str, list[tuple[str, object]]] = {}
    for pattern in patterns:
        parts = pattern.split(".")
        found[pattern] = [(path, module) for path, module in modules if path and _matches(path.split("."), parts)]
    return found


def _matches(path: list[str], pattern: list[str]) -> bool:
    return len(path) == len(pattern) and all(p == "*" or p == q for p, q in zip(pattern, path))


@attrs.frozen
class _TensorSpec:
    """A tensor a break returned, as a shape to allocate its replay output at."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


class Splitter:
    """The breaks of one segment (see the module docstring); ``segment(pointers)`` brackets
    each call of the segment, with the adopted tensors' slots and views of its size."""

    def __init__(self, ctx: Context, segment: Segment, model: object, detectors):
        self.ctx = ctx
        self.name = segment.name
        self._detectors = detectors  # called for the detectors once they exist (allocate makes them last)
        self._templates: dict[tuple, object] = {}
        self._active = False
        self._index = 0
        self._pointers: tuple = ()
        found = matching(model, segment.breaks)
        for pattern, modules in found.items():
            if not modules:
                raise PlanError(f"breaks pattern {pattern!r} of segment {segment.name} matches no submodule of the "
                                f"model — {_nearby(model, pattern)}", element=f"segment {segment.name}")
        for path, module in dict((p, m) for modules in found.values() for p, m in modules).items():
            self._wrap(path, module)

    def _wrap(self, path: str, module: torch.nn.Module) -> None:
        own = module.__dict__.get("forward")
        original = module.forward
        module.forward = functools.partial(self._call, path, original)

        def unwrap() -> None:
            if own is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = own

        self.ctx.stack.push(f"unwrap {path}.forward (a break of {self.name})", unwrap)

    @contextlib.contextmanager
    def segment(self, pointers: tuple) -> Iterator[None]:
        self._active, self._index, self._pointers = True, 0, pointers
        try:
            yield
        finally:
            self._active, self._pointers = False, ()

    def _call(self, path: str, original, *args, **kwargs):
        if not self._active:
            return original(*args, **kwargs)
        key = (self._index, _signature(args, kwargs))
        self._index += 1
        here = self.ctx.locus.here
        cutting = (here.phase is Phase.CAPTURE and here.descriptor is not None
                   and here.descriptor.mode is Mode.PIECEWISE)
        detectors = self._detectors()
        if cutting:
            template = self._templates.get(key)
            if template is None:
                raise CaptureError(f"break {path} of segment {self.name} is called at capture with arguments warmup "
                                   "never gave it (another call order or other shapes)", segment=self.name,
                                   hint="a segment with breaks must call its submodules in the same order with "
                                        "the same shapes at every size: move the varying work out of the segment")
            # Ending one graph and beginning the next is no work of the segment (beginning a
            # capture resets the random generator's graph-safe state, one fill_ off the
            # capture stream), nor is allocating the outputs the next graph reads.
            with detectors.eager() if detectors is not None else contextlib.nullcontext():
                made = self.ctx.backend.cut(functools.partial(self._between, original, args, kwargs, template))
            if made is not None:
                return made
        self._active = False  # a break inside this submodule is part of it
        # Run eagerly at replay (PIECEWISE), it may read values on the host, as an eager
        # segment may; captured inside a FULL graph, it is watched like the rest.
        eager = detectors is not None and (here.descriptor is None or here.descriptor.mode is Mode.PIECEWISE)
        try:
            with detectors.eager() if eager else contextlib.nullcontext():
                result = original(*args, **kwargs)
        finally:
            self._active = True
        if here.phase is Phase.WARMUP:
            self._templates[key] = _template(result, path)
        return result

    def _between(self, original, args: tuple, kwargs: dict, template: object):
        """Outside any capture: the outputs the next graph reads, and the eager call that fills them."""
        outputs = _allocate(template)
        pointers = self._pointers

        def piece() -> None:
            for slot, view in pointers:
                slot.set(view)
            _copy(outputs, original(*args, **kwargs))

        detectors = self._detectors()
        if detectors is not None:  # kept on purpose: not an escape, and read by the next graph
            detectors.add_known([*_tensors((args, kwargs)), *_tensors(outputs)])
        return piece, outputs


def _nearby(model: object, pattern: str) -> str:
    depth = len(pattern.split("."))
    if not isinstance(model, torch.nn.Module):
        return "the model is not an nn.Module, so breaks cannot name its submodules"
    paths = [p for p, _ in model.named_modules() if p and len(p.split(".")) == depth][:4]
    return f"paths at that depth: {', '.join(paths)}" if paths else "write a path such as model.layers.*.self_attn"


def _signature(args: tuple, kwargs: dict) -> tuple:
    return tuple(tuple(t.shape) for t in _tensors((args, kwargs)))


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []


def _template(value: object, path: str) -> object:
    if isinstance(value, torch.Tensor):
        return _TensorSpec(tuple(value.shape), tuple(value.stride()), value.dtype, value.device)
    if isinstance(value, (tuple, list)) and type(value) in (tuple, list):
        return type(value)(_template(item, path) for item in value)
    if type(value) is dict:
        return {key: _template(item, path) for key, item in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise CaptureError(f"break {path} returned a {type(value).__name__}: a break's output must be tensors, tuples, "
                       "lists, dicts or plain values", hint="return those from the submodule, or move the break to "
                                                             "a submodule that does")


def _allocate(template: object) -> object:
    if isinstance(template, _TensorSpec):
        return torch.empty_strided(template.shape, template.stride, dtype=template.dtype, device=template.device)
    if isinstance(template, (tuple, list)):
        return type(template)(_allocate(item) for item in template)
    if isinstance(template, dict):
        return {key: _allocate(item) for key, item in template.items()}
    return template


def _copy(outputs: object, result: object) -> None:
    if isinstance(outputs, torch.Tensor):
        outputs.copy_(result)
    elif isinstance(outputs, (tuple, list)):
        for out, value in zip(outputs, result, strict=True):
            _copy(out, value)
    elif isinstance(outputs, dict):
        for key, out in outputs.items():
            _copy(out, result[key])
