"""graphflow: declarative CUDA-graph capture orchestration for PyTorch inference engines.

Layers, from data to GPU:

* ``graphflow.plan``: the capture plan as frozen attrs classes (no torch).
* ``graphflow.plan.loader``: YAML in and out, with ``for_each`` templating (no torch).
* ``graphflow.plan.decorators``: the same plan declared on the model's classes (no torch).
* ``graphflow.plan.rules``: the rule table run before any GPU work (no torch); its runner is
  ``graphflow.validate(plan)``.
* ``graphflow.engine``: the phase pipeline with rollback, over a CUDA or CPU backend.
* ``graphflow.runtime``: dispatch a batch to its captured descriptor and replay.
* ``graphflow.session``: the one way to compose a run (channels, trace, engine, runner).

Importing ``graphflow`` imports no torch; engine names load on first use.
"""

from __future__ import annotations

import importlib

from graphflow.plan.decorators import (
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
from graphflow.errors import CaptureError, DivergenceError, GraphflowError, InvalidPlanError, PlanError
from graphflow.plan.loader import dump_plan, load_plan, loads_plan
from graphflow.plan import Descriptor, Mode, Plan, Reference
from graphflow.plan.rules import validate

__version__ = "0.1.0"

#: Names that need torch, imported from their module on first access.
_LAZY = {
    "RunOptions": "graphflow.engine.options",
    "Runner": "graphflow.runtime",
    "Session": "graphflow.session",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'graphflow' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


#: What a user of YAML plans, decorators and the runtime needs; the plan's parts
#: (``graphflow.plan``), the rule table (``graphflow.plan.rules``) and the engine's phases
#: (``graphflow.engine``) are imported from their modules.
__all__ = [
    # plans: read, write, check
    "Descriptor", "Mode", "Plan", "dump_plan", "load_plan", "loads_plan", "validate",
    # plans declared on the model
    "Reference", "buffer", "channel", "eager_break", "plan_from_module", "position", "prewarm", "segment", "step",
    "stream",
    # capture and run
    *_LAZY,
    # errors
    "CaptureError", "DivergenceError", "GraphflowError", "InvalidPlanError", "PlanError",
]
