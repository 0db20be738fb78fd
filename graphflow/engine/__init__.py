"""The capture engine: a phase pipeline with rollback, over a CUDA or CPU backend.

``run_pipeline(plan, RunOptions(...))`` returns a committed ``Engine`` (or rolls back
and raises); ``graphflow.engine.pipeline`` holds the lifecycle, step by step. Each phase
is a module of its own: ``allocate``, ``warmup`` (warmup and prewarm), ``capture``,
``verify``, and ``engine`` (commit and the committed ``Engine``). ``execute`` runs
segments over their streams for all of them; ``backend`` captures and replays one
region; ``rollback`` is the undo stack; ``schedule`` derives fork/join from the plan.

The names below load on first use: ``schedule`` and ``rollback`` import no torch, so a
picture of a plan (``graphflow.view.picture``) can use the engine's schedule without it.
"""

import importlib

#: Public names and the module each lives in.
_NAMES = {
    "Backend": "backend", "BackendKind": "backend", "CpuBackend": "backend", "CudaBackend": "backend",
    "Graph": "backend", "make_backend": "backend",
    "Engine": "engine", "Outcome": "phase", "PhaseResult": "phase", "PipelineReport": "engine",
    "RunOptions": "options", "run_pipeline": "pipeline", "UndoError": "rollback", "UndoStack": "rollback",
    "Verify": "options", "VerifyResult": "verify",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str):
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'graphflow.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f"graphflow.engine.{module}"), name)
