"""vLLM's custom all-reduce, traced per rank and served by the family's warmup policy.

``CustomAllreduce.custom_all_reduce`` (vllm/distributed/device_communicators/
custom_all_reduce.py) takes one of four paths, and the trace names which:

============================  =============================================================
path                          when
============================  =============================================================
``declined``                  disabled, or the tensor does not qualify: vLLM tries the next
                              backend (NCCL)
``captured``                  capture is open and the stream is capturing: the IPC kernel is
                              recorded into the graph
(warmup)                      capture is open, the stream is not capturing (the eager warmup
                              runs before each graph): vLLM returns ``torch.empty_like``,
                              rank-local garbage. The family's policy decides instead:
                              ``placeholder`` keeps vLLM's, ``real`` runs the eager IPC
                              all-reduce (the right sums), ``prepare`` runs the prepare
                              hooks once per shape (no communication) and returns zeros, the
                              same on every rank
``outside_capture``           no capture open: the eager IPC all-reduce
============================  =============================================================

Each call is one trace event: the communicator's call counter, shape, dtype, bytes,
``_IS_CAPTURING``, the stream's capture state and the path, with the family, phase and
descriptor of the session. Outside a session the wrapper costs one global read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from graphflow.plan import WarmupPolicy
from graphflow.dist.trace import CallPath

__all__ = ["stream_capturing", "traced_custom_all_reduce"]

_WARMUP_PATHS = {
    WarmupPolicy.PLACEHOLDER: CallPath.PLACEHOLDER,
    WarmupPolicy.REAL: CallPath.EAGER_WARMUP,
    WarmupPolicy.PREPARE: CallPath.PREPARE,
}


def stream_capturing() -> bool | None:
    """Whether the current CUDA stream is capturing; None where CUDA cannot say (no driver)."""
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except (RuntimeError, AssertionError):
        return None


def traced_custom_all_reduce(original: Callable, active: Callable[[], Any]) -> Callable:
    """A replacement for ``CustomAllreduce.custom_all_reduce`` around ``original``.

    ``active()`` returns the plugin's state with a session open (a capture or profiling
    run), else None: then the call is vLLM's, untouched.
    """

    def custom_all_reduce(self, input: torch.Tensor) -> torch.Tensor | None:
        state = active()
        if state is None:
            return original(self, input)
        session = state.session
        family = session.site.family
        counter = session.count_call(self)
        capturing = stream_capturing()
        if self.disabled or not self.should_custom_ar(input):
            path = "declined"
        elif not self._IS_CAPTURING:
            path = CallPath.OUTSIDE_CAPTURE.value
        elif capturing:
            path = CallPath.CAPTURED.value
        else:
            path = _WARMUP_PATHS[state.settings.policy(family)].value
        scope = session.scope(_members(self))
        session.record_call(scope, {
            "op": "all_reduce", "backend": "custom_all_reduce", "channel": f"{family}.tp_all_reduce",
            "group": "tp", "counter": counter, "shape": list(input.shape),
            "dtype": str(input.dtype).removeprefix("torch."), "bytes": input.numel() * input.element_size(),
            "is_capturing": bool(self._IS_CAPTURING), "capturing": capturing, "path": path,
        })
        if path == "declined":
            return None
        if path in (CallPath.CAPTURED.value, CallPath.EAGER_WARMUP.value, CallPath.OUTSIDE_CAPTURE.value):
            session.agree_call(scope, f"all_reduce {list(input.shape)} {path} #{counter}")
        if path == CallPath.EAGER_WARMUP.value:
            return self.all_reduce(input, registered=False)
        if path == CallPath.PREPARE.value:
            state.prepare(self, input)
            return torch.zeros_like(input)
        return original(self, input)

    custom_all_reduce.__wrapped__ = original
    return custom_all_reduce


def _members(comm: Any) -> tuple[int, ...]:
    """The global ranks of the communicator's group (cached on it)."""
    members = getattr(comm, "_graphflow_members", None)
    if members is None:
        members = (dist.get_rank(),)
        with contextlib.suppress(RuntimeError, ValueError, AttributeError):
            members = tuple(sorted(dist.get_process_group_ranks(comm.group)))
        comm._graphflow_members = members
    return members
