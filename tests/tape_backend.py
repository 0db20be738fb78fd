"""A stand-in for CUDA graph capture on the CPU: record the ops a region runs, replay only them.

What a CUDA graph does that the CPU backend does not: replay runs the recorded kernels on
the recorded memory and none of the Python that launched them. ``TapeBackend`` records
every ATen op a region runs (its arguments and outputs, by object) and replays the tape:
each op again on the same tensors, its fresh results copied into the recorded outputs,
so tensors made during capture keep their identity as graph memory keeps its address.
It implements ``Backend.cut`` as the CUDA backend does (end one tape, start the next,
the eager call between them), so the split protocol (graphflow.engine.model.split) can be
exercised without a GPU. It proves nothing about CUDA itself: tests/cuda does that.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from graphflow.engine.backend import CpuBackend, Graph

__all__ = ["TapeBackend"]


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.tape: list | None = None  # None: not recording (between two pieces)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.tape is not None:
            self.tape.append((func, args, kwargs, out))
        return out


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _replay(tape: list) -> None:
    """Each op again; a result in new memory is copied into the recorded output (a view
    of an argument, or the argument an in-place op returns, is already up to date)."""
    for func, args, kwargs, out in tape:
        fresh = func(*args, **kwargs)
        inputs = {_storage(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for recorded, value in zip(tree_flatten(out)[0], tree_flatten(fresh)[0]):
            if isinstance(recorded, torch.Tensor) and _storage(recorded) not in inputs:
                recorded.copy_(value)


class _Tapes(Graph):
    def __init__(self, tapes: list[list], between: list):
        steps = [lambda tape=tapes[0]: _replay(tape)]
        for call, tape in zip(between, tapes[1:]):
            steps += [call, lambda tape=tape: _replay(tape)]
        self.tapes, self.between, self._steps = tapes, between, steps
        self.replay = self._run

    def _run(self) -> None:
        for step in self._steps:
            step()

    def destroy(self) -> None:
        self.tapes, self.between, self._steps = [], [], []


class TapeBackend(CpuBackend):
    """The CPU backend whose regions replay their recorded ops (see the module docstring)."""

    name = "tape"

    def __init__(self):
        super().__init__()
        self._open: tuple[_Recorder, list, list] | None = None

    def capture(self, calls, recording, stream, pool, side=()):
        recorder, tapes, between = _Recorder(), [[]], []
        recorder.tape = tapes[0]
        self._open = (recorder, tapes, between)
        try:
            with recorder:
                recording()
        finally:
            self._open = None
        return _Tapes(tapes, between)

    def cut(self, make):
        if self._open is None:
            return None
        recorder, tapes, between = self._open
        recorder.tape = None
        call, value = make()
        between.append(call)
        tapes.append([])
        recorder.tape = tapes[-1]
        return value
