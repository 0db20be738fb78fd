"""graphflow: declarative CUDA-graph capture orchestration for PyTorch inference engines.

Layers, from data to GPU:

* ``graphflow.plan``: the capture plan as frozen attrs classes (no torch).
* ``graphflow.loader``: YAML in and out, with ``for_each`` templating (no torch).
* ``graphflow.decorators``: the same plan declared on the model's classes (no torch).
* ``graphflow.validate``: the rule table run before any GPU work (no torch).
* ``graphflow.engine``: the phase pipeline with rollback, over a CUDA or CPU backend.
* ``graphflow.runtime``: dispatch a batch to its captured descriptor and replay.

Importing ``graphflow`` imports no torch; engine names load on first use.
"""

from __future__ import annotations

import importlib

from graphflow.decorators import (
    buffer,
    channel,
    eager_break,
    plan_from_module,
    position,
    prewarm,
    segment,
    step,
    stream,
)
from graphflow.errors import CaptureError, DivergenceError, GraphflowError, PlanError
from graphflow.loader import dump_plan, load_plan, loads_plan
from graphflow.plan import (
    Buffer,
    BufferRole,
    CaptureRegion,
    CaptureSettings,
    Channel,
    ChannelKind,
    Compile,
    Descriptor,
    Family,
    Mode,
    Plan,
    Prewarm,
    Segment,
    SegmentKind,
    Stream,
    WarmupPolicy,
)
from graphflow.validate import Diagnostic, Report, Severity, validate

__version__ = "0.1.0"

#: Names that need torch, imported from their module on first access.
_LAZY = {
    "Engine": "graphflow.engine",
    "run_pipeline": "graphflow.engine",
    "Runner": "graphflow.runtime",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'graphflow' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "Buffer", "BufferRole", "CaptureError", "CaptureRegion", "CaptureSettings", "Channel",
    "ChannelKind", "Compile", "Descriptor", "Diagnostic", "DivergenceError", "Family", "GraphflowError",
    "Mode", "Plan", "PlanError", "Prewarm", "Report", "Segment", "SegmentKind", "Severity",
    "Stream", "WarmupPolicy", "dump_plan", "load_plan", "loads_plan", "validate",
    "buffer", "channel", "eager_break", "plan_from_module", "position", "prewarm", "segment", "step",
    "stream",
    *_LAZY,
]
