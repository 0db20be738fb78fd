"""graphflow under ``transformers serve``, transformers' own OpenAI-compatible server.

With ``--continuous-batching`` the server runs every chat, completion and response request
on one ``ContinuousBatchingManager``, which it makes itself at the first request
(``CBGenerateManager.init_cb``: ``init_continuous_batching`` with that request's
generation config, then ``start()``). transformers offers no callback or setting that
reaches that manager, so ``install`` wraps two methods of the class, for the whole process:

* ``ContinuousBatchingManager.start`` attaches graphflow (``serve``) first: every manager
  passes through it once its settings are resolved and before its thread runs a step, and
  ``serve`` must come before that thread (it builds the batch processor the thread then
  adopts; a foreground capture must be done before the first step).
* ``ContinuousBatchingManager.stop`` closes graphflow once the engine's thread has ended
  (graphs are never freed under a step) and logs the coverage table (logger
  ``graphflow.serving``).

The engine is left as the server configured it, except asynchronous batching: graphflow
serves the synchronous engine, and the server has no flag for it (transformers turns it on
by itself with CUDA graphs and flash attention), so an attached manager runs without it,
and the log says so. A manager on the CPU backend is served lazily even when a foreground
capture was asked for: that backend captures no graph (each key's "graph" replays the
same calls), so capturing every key before the first step (hundreds, each run and
checked) would only keep the server from answering for minutes.

``python -m graphflow.integrations.hf.batching.server [transformers serve arguments]``
is ``transformers serve`` with the hook installed (``GRAPHFLOW_SERVE=lazy|foreground``,
default lazy; ``GRAPHFLOW_GRAPHS=DIR``: the server saves its FULL keys' graphs into DIR
when it stops, and a foreground server started later serves from them,
``Serving.save_graphs`` and ``serve(..., graphs_from=...)``). It refuses bad arguments
and says what it starts before it imports transformers and the model (seconds; torch has
loaded with this package). transformers' server leaves its manager's thread running when
it shuts down (which keeps the process alive after Ctrl-C); this entry point stops it, so
the coverage is logged and the process exits: 130 after Ctrl-C, 143 after SIGTERM (128 and
the signal's number, as a shell reports a process the signal ended). A process started
with SIGINT ignored (a script's background job) keeps it ignored while it loads; once
serving, uvicorn stops on it all the same, and the process then exits 0.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from graphflow.integrations.hf.batching.serving import Serving

__all__ = ["ENV", "GRAPHS_ENV", "MODES", "Installed", "install", "main"]

log = logging.getLogger("graphflow.serving")

#: The environment variable that picks the capture mode of the entry point.
ENV = "GRAPHFLOW_SERVE"
#: Its values: whether ``serve`` captures lazily.
MODES = {"lazy": True, "foreground": False}
#: The environment variable naming the directory a server's graphs are saved to and served from.
GRAPHS_ENV = "GRAPHFLOW_GRAPHS"

_installed: Installed | None = None


class Installed:
    """The hook in place (``install``): the managers it serves now, by manager."""

    def __init__(self, options: dict, graphs: str | None = None) -> None:
        from transformers.generation.continuous_batching.continuous_api import (
            ContinuousBatchingManager,
        )

        self.options = options
        #: Where each manager's FULL keys are saved when it stops, and served from when a
        #: foreground one starts (``install(graphs=...)``).
        self.graphs = graphs
        self.serving: dict[object, Serving] = {}
        self._lock = threading.Lock()
        self._cls = ContinuousBatchingManager
        self._start, self._stop = ContinuousBatchingManager.start, ContinuousBatchingManager.stop
        stop_signature = inspect.signature(self._stop)
        installed = self

        def start(manager) -> None:
            if not manager.is_running() and manager not in installed.serving:
                installed._attach(manager)
            installed._start(manager)

        def stop(manager, *args, **kwargs) -> None:
            installed._stop(manager, *args, **kwargs)
            bound = stop_signature.bind(manager, *args, **kwargs)
            bound.apply_defaults()
            if not bound.arguments["keep_for_next_session"]:  # a kept manager keeps its graphs too
                installed._detach(manager)

        start.__doc__ = f"{self._start.__doc__} (graphflow attached first: graphflow.integrations.hf.batching.server)"
        stop.__doc__ = f"{self._stop.__doc__} (graphflow closed after: graphflow.integrations.hf.batching.server)"
        self._cls.start, self._cls.stop = start, stop

    def _attach(self, manager) -> None:
        import torch

        from graphflow.integrations.hf.batching.serving import serve

        config = manager.continuous_batching_config
        if manager.batch_processor is None and config.use_async_batching:
            config.use_async_batching = False
            log.info("graphflow: asynchronous batching off (graphflow serves the engine's synchronous batching)")
        device = manager.model.device
        options = self.options
        if not options["lazy"] and _on_the_cpu_backend(options.get("backend", "auto")):
            options = {**options, "lazy": True}
            log.info("graphflow: the CPU backend captures no graph, so no key is captured before serving: serving "
                     "at once, keys recorded beside it (GRAPHFLOW_SERVE=foreground captures first on a GPU)")
        if self.graphs is not None and not options["lazy"] and _holds_graphs(self.graphs):
            options = {**options, "graphs_from": self.graphs}
        try:
            # The first request's handler thread starts the manager: the model's device, as
            # the engine's own thread sets it.
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                serving = serve(manager, **options)
        except Exception as exc:
            # The server would queue requests on a manager that never starts: marked dead,
            # its requests and /health answer 503 with why.
            manager.background_thread_status.record_fatal_error(exc)
            log.error("graphflow could not serve this engine: %s", exc)
            raise
        with self._lock:
            self.serving[manager] = serving

    def _detach(self, manager) -> None:
        with self._lock:
            serving = self.serving.pop(manager, None)
        if serving is None:
            return
        if not manager.is_running():
            _close(serving, self.graphs)
            return
        # transformers' stop waited a bounded time and the engine still runs a step:
        # close once its thread has ended.
        threading.Thread(target=_close_after, args=(manager, serving, self.graphs),
                         name="graphflow-serving-close").start()

    def stop_all(self) -> None:
        """Stop every manager still served, failing its pending requests (the server's exit:
        no client is left to read them); each logs its coverage."""
        with self._lock:
            managers = list(self.serving)
        for manager in managers:
            manager.stop(block=True, hard_stop=True)

    def uninstall(self) -> None:
        """Put transformers' own ``start`` and ``stop`` back (the managers served now stay
        served until they stop)."""
        global _installed
        self._cls.start, self._cls.stop = self._start, self._stop
        _installed = None


def install(*, lazy: bool = True, graphs: str | os.PathLike | None = None, **options) -> Installed:
    """graphflow attached to every ``ContinuousBatchingManager`` this process starts (see
    the module docstring); ``lazy`` and ``options`` (``verify``, ``backend``, ``longest``,
    ``keys``) go to ``serve``, ``lazy`` always on the CPU backend. ``graphs``: a directory
    each manager saves its FULL keys' graphs into when it stops, and a foreground one
    serves from when it starts, once a manager saved there."""
    global _installed
    if _installed is not None:
        raise RuntimeError("graphflow is already installed in transformers' continuous batching "
                           "(uninstall() the first one)")
    _installed = Installed({"lazy": lazy, **options}, None if graphs is None else os.fspath(graphs))
    return _installed


def _holds_graphs(directory: str) -> bool:
    """Whether a server saved graphs into ``directory`` (the first server finds none)."""
    from graphflow.engine.restart.store import MANIFEST

    return os.path.isfile(os.path.join(directory, MANIFEST))


def _on_the_cpu_backend(backend) -> bool:
    """Whether ``serve`` will run on the CPU backend: asked for, or automatic on a machine
    with no GPU (``graphflow.engine.backend.make_backend``)."""
    import torch

    kind = getattr(backend, "value", backend)
    return kind == "cpu" or (kind == "auto" and not torch.cuda.is_available())


def _close(serving: Serving, graphs: str | None) -> None:
    log.info("graphflow coverage of %s:\n%s", serving.plan.name, serving.report())
    try:
        if graphs is not None:
            _save(serving, graphs)
    finally:
        serving.close()


def _save(serving: Serving, graphs: str) -> None:
    """The FULL keys' graphs saved for the next server; a save that fails is said, and
    the server stops as it would have."""
    try:
        saved = serving.save_graphs(graphs)
    except Exception as exc:  # noqa: BLE001 - the next server captures instead
        log.warning("graphflow: the graphs were not saved to %s: %s", graphs, exc)
        return
    log.info("graphflow: %d FULL keys' graphs saved to %s in %.2f s%s", saved.saved, graphs, saved.seconds,
             f" ({len(saved.left_out)} left out: {saved.left_out[0]}, ...)" if saved.left_out else "")


def _close_after(manager, serving: Serving, graphs: str | None) -> None:
    manager.join(time.perf_counter())
    _close(serving, graphs)


def main(argv: list[str] | None = None) -> None:
    """``transformers serve`` with graphflow installed, in this process: the arguments
    checked and the first line said before transformers and the model load."""
    argv = sys.argv[1:] if argv is None else argv
    mode = os.environ.get(ENV, "lazy")
    if mode not in MODES:
        print(f"{ENV}={mode!r}: expected one of {', '.join(MODES)}", file=sys.stderr)
        raise SystemExit(2)
    helping = "--help" in argv
    if not helping and not _continuous_batching(argv):
        print("graphflow serves transformers' continuous batching: add --continuous-batching to the serve arguments",
              file=sys.stderr)
        raise SystemExit(2)
    _log_to_stderr()
    if not helping:
        log.info("graphflow: starting transformers serve, graphs captured %s; loading transformers and the model",
                 "in the background" if MODES[mode] else "before serving")
    graphs = os.environ.get(GRAPHS_ENV) or None
    if graphs is not None and not helping:
        log.info("graphflow: the FULL keys' graphs are saved to %s when the server stops%s", graphs,
                 ", and served from there when it starts" if not MODES[mode] else
                 " (a foreground server, GRAPHFLOW_SERVE=foreground, serves from them when it starts)")
    installed = install(lazy=MODES[mode], graphs=graphs)
    # uvicorn shuts down on SIGINT and SIGTERM, then raises the signal again with the
    # handler it found: an exit, not click's "Aborted!" (status 1) or the default kill,
    # so that the managers below are stopped and the status says which signal it was.
    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler):
            signal.signal(sig, _exit_on_signal)
    from transformers.cli.transformers import app

    try:
        app(["serve", *argv], prog_name="python -m graphflow.integrations.hf.batching.server")
    finally:
        installed.stop_all()


def _continuous_batching(argv: list[str]) -> bool:
    flags = [arg for arg in argv if arg in ("--continuous-batching", "--no-continuous-batching")]
    return bool(flags) and flags[-1] == "--continuous-batching"


def _log_to_stderr() -> None:
    """graphflow's lines on stderr: the server configures only uvicorn's and transformers'
    loggers, which would leave graphflow's INFO lines (what it serves, its coverage) unseen."""
    logger = logging.getLogger("graphflow")
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    main()
