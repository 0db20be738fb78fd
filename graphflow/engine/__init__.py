"""The capture engine: a phase pipeline with rollback, over a CUDA or CPU backend.

``run_pipeline(plan, RunOptions(...))`` returns a committed ``Engine`` (or rolls back
and raises); ``graphflow.engine.pipeline`` holds the lifecycle, step by step. Each phase
is a module of its own: ``allocate``, ``warmup`` (warmup and prewarm), ``capture``,
``verify``, and ``engine`` (commit and the committed ``Engine``). ``execute`` runs
segments over their streams for all of them, in the order ``graphflow.plan.schedule``
derives from the plan; ``backend`` captures and replays one region; ``rollback`` is the
undo stack.

The names below load on first use, so importing this package imports no torch: only the
module that holds a name does, when that name is asked for.
"""

from graphflow.exports import lazy_names

#: Public names and the module each lives in.
_NAMES = {
    "Backend": "backend", "BackendKind": "backend", "CpuBackend": "backend", "CudaBackend": "backend",
    "Graph": "backend", "make_backend": "backend",
    "Engine": "engine", "Outcome": "phase", "PhaseResult": "phase", "PipelineReport": "report",
    "RunOptions": "options", "run_pipeline": "pipeline", "UndoError": "rollback", "UndoStack": "rollback",
    "Verify": "options", "VerifyResult": "verify",
}

__all__ = sorted(_NAMES)
__getattr__ = lazy_names(__name__, _NAMES)
