"""The capture engine: a phase pipeline with rollback, over a CUDA or CPU backend.

``run_pipeline(plan, RunOptions(...))`` returns a committed ``Engine`` (or rolls back
and raises); ``graphflow.engine.pipeline`` holds the lifecycle, step by step. Each phase
is a module of its own: ``allocate``, ``warmup`` (warmup and prewarm), ``capture``,
``verify``, and ``engine`` (commit and the committed ``Engine``). ``execute`` runs
segments over their streams for all of them; ``backend`` captures and replays one
region; ``rollback`` is the undo stack; ``locus`` says where the pipeline is.
"""

from graphflow.engine.backend import Backend, BackendKind, CpuBackend, CudaBackend, Graph, make_backend
from graphflow.engine.engine import Engine, Outcome, PhaseResult, PipelineReport
from graphflow.engine.options import RunOptions
from graphflow.engine.pipeline import run_pipeline
from graphflow.engine.rollback import UndoError, UndoStack
from graphflow.engine.verify import VerifyResult

__all__ = [
    "Backend", "BackendKind", "CpuBackend", "CudaBackend", "Engine", "Graph", "Outcome", "PhaseResult",
    "PipelineReport", "RunOptions", "UndoError", "UndoStack", "VerifyResult", "make_backend", "run_pipeline",
]
