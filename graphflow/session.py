"""One capture session: the channel runtime, the trace, the engine and the runner, together.

A capture is more than ``run_pipeline``: a multi-rank or traced run needs a channel
runtime listening to the pipeline (its handles go to the model, its barriers keep the
ranks in step, its tracer writes this rank's trace), and everything must close in the
right order — the engine (graphs) before the channels (communicators before their
process groups), the trace file last. ``Session`` is that composition, written once;
``graphflow run``, ``graphflow launch``, the benchmarks and the tests all use it::

    with Session(plan, RunOptions(verify=True), rank=0, world_size=1, trace="traces/") as session:
        engine = session.capture()              # CaptureError (rolled back) on failure
        (logits,) = session.runner.run(tokens)  # views of static buffers: clone to keep

Construction is cheap: it builds the channel runtime (handles, no communication) when
the plan declares channels, runs on several ranks, or is traced, so a model factory can
take ``session.handles`` before ``capture``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from graphflow.engine import Engine, RunOptions, run_pipeline
from graphflow.engine.rollback import UndoStack
from graphflow.events import Listener
from graphflow.plan import Plan

__all__ = ["Session"]


class Session:
    """See the module docstring. ``trace`` is a directory for ``rank{N}.jsonl`` (or a
    ``.jsonl`` path); without it, ``GRAPHFLOW_TRACE`` decides. ``group_factory``,
    ``registry``, ``store``, ``families`` and ``namespace`` go to the channel runtime
    (``graphflow.dist.channels.ChannelRuntime``): the process groups, the id registry shared
    by the families of one process, the c10d store of the barriers."""

    def __init__(self, plan: Plan, options: RunOptions = RunOptions(), *, rank: int = 0, world_size: int = 1,
                 listeners: Sequence[Listener] = (), trace: str | None = None,
                 group_factory: Callable | None = None, registry=None, store=None,
                 families: Iterable[str] | None = None, namespace: str | None = None):
        from graphflow.dist.trace import Tracer

        self.plan = plan
        self.options = options
        self.rank = rank
        self.world_size = world_size
        self.listeners = tuple(listeners)
        self._stack = UndoStack()
        self._engine: Engine | None = None
        self._runner = None
        tracer = Tracer(trace, rank) if trace is not None else Tracer.from_env(rank)
        self.channels = None
        if plan.channels or world_size > 1 or tracer is not None:
            from graphflow.dist.channels import ChannelRuntime

            self.channels = ChannelRuntime(plan, rank=rank, world_size=world_size, tracer=tracer or False,
                                           group_factory=group_factory, registry=registry, store=store,
                                           families=families, namespace=namespace)
            self._stack.push("close the channel runtime", self.channels.close)

    @property
    def handles(self) -> dict:
        """The channel handles a model communicates through (empty without channels)."""
        return self.channels.handles if self.channels is not None else {}

    @property
    def tracer(self):
        return self.channels.tracer if self.channels is not None else None

    def capture(self, model: object | None = None, *, backend=None) -> Engine:
        """Run the pipeline (``graphflow.engine.run_pipeline``) with this session's channels
        and listeners; the committed engine closes with the session."""
        if self._engine is not None:
            raise RuntimeError("this session already captured its plan: open a new Session to capture again")
        try:
            engine = run_pipeline(self.plan, self.options, backend=backend, model=model, rank=self.rank,
                                  world_size=self.world_size, listeners=self.listeners, channels=self.channels)
        except BaseException:
            del model  # the error's traceback keeps this frame, which must not keep the model
            raise
        self._engine = engine
        self._stack.push("close the engine", self._close_engine)
        return engine

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise RuntimeError("nothing captured yet: call session.capture() first")
        return self._engine

    @property
    def runner(self):
        """A ``graphflow.runtime.Runner`` over the committed engine, made on first use."""
        if self._runner is None:
            from graphflow.runtime import Runner

            self._runner = Runner(self.engine)
        return self._runner

    def _close_engine(self) -> None:
        engine, self._engine, self._runner = self._engine, None, None
        engine.close()

    def close(self) -> None:
        """The engine, then the channels (their trace last); every step runs, and the
        failures are raised together (``graphflow.engine.UndoError``)."""
        failures = self._stack.unwind()
        if failures is not None:
            raise failures

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
