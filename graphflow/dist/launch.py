"""Run a function on N ranks of this machine, started by torch.distributed's own launcher.

``launch(fn, nproc, backend)`` runs ``fn(RankContext, *args)`` once per rank and returns
one ``RankResult`` per rank, for tests, benchmarks and integrations that drive
``run_pipeline`` themselves. The processes are torchrun's business: ``launch`` is a front
end to ``torch.distributed.launcher.api.elastic_launch``, the API ``torchrun`` runs, which
starts the ranks, holds the rendezvous (c10d on 127.0.0.1, a port the OS picks, so
launches never clash) and stops every rank as soon as one fails. There are no restarts:
a capture that failed is reported, not retried. Around it graphflow adds only what
elastic lacks:

- each rank joins through ``graphflow.dist.distributed.joined`` (NVLink multicast off;
  ``cuda:{rank}`` and its own stream on NCCL; the process group over env://), the same
  setup as a rank that torchrun starts for ``graphflow run``;
- a result for every rank even when one failed: elastic returns the ranks' values only
  when all of them succeeded, so each rank also leaves its ``RankResult`` (its value, or
  its error and traceback) in the launch's directory, and a rank that left none is
  explained by how it ended (its exit code or signal, or stopped because another failed);
- a deadline: elastic waits for its workers without one, so a watchdog kills the ranks
  still running at ``timeout_s`` (each rank writes its pid first) and elastic then stops
  the others: a launch never hangs its caller. On a loaded machine a rank may start only
  after the deadline; it finds the watchdog's mark and leaves without running, so no rank
  runs past the deadline it was given.

Start methods: NCCL ranks are spawned (a fresh interpreter per GPU; CUDA is never
forked). gloo ranks come from a forkserver that imported torch once, so a CPU launch
costs a fork per rank rather than an interpreter and a torch import each. A forkserver's
children inherit the environment of the moment it started, not of this call, so each
rank is handed the caller's environment and keeps on top of it what elastic set for it.
They inherit its stderr too: what ranks print goes where the first launch's stderr went.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import os
import pickle
import signal
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import attrs

from graphflow.dist.distributed import BACKENDS, NVLS_ENV, RankContext

__all__ = ["NVLS_ENV", "RankContext", "RankResult", "launch"]

#: The signals elastic's agent takes over in the launching process and does not give back.
_AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")

#: Loggers of elastic's agent: what they report of a failed rank, its RankResult says too.
_AGENT_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")

#: The file the watchdog leaves in the launch's directory at the deadline.
_EXPIRED = "deadline.passed"

#: The environment the gloo forkserver inherited when it started (None: not started yet).
_forkserver_env: dict[str, str] | None = None


@attrs.frozen
class RankResult:
    """One rank's return value, or its error (``Type: message``) with the traceback."""

    rank: int
    value: object = None
    error: str | None = None
    traceback: str | None = None
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


def launch(fn: Callable[..., object], nproc: int, backend: str = "gloo", *, args: Sequence[object] = (),
           timeout_s: float = 300.0, group_timeout_s: float = 60.0) -> tuple[RankResult, ...]:
    """Run ``fn(RankContext, *args)`` in ``nproc`` processes; one ``RankResult`` per rank.

    ``fn``, ``args`` and the return values are pickled: ``fn`` must be a module-level
    function, and a script that calls ``launch`` must do so under
    ``if __name__ == "__main__":`` (the ranks import the script's module, as any spawned
    process does). A rank that raises stops the others (their results say so). Raises
    ``ValueError`` before starting anything when the request cannot work (unknown
    backend, fewer GPUs than ranks).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1 (got {nproc})")
    import torch

    if backend == "nccl" and torch.cuda.device_count() < nproc:
        raise ValueError(f"{nproc} NCCL ranks need {nproc} GPUs, this machine has {torch.cuda.device_count()} "
                         "— start fewer ranks (nproc) or use backend gloo")
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    method = "spawn" if backend == "nccl" else "forkserver"
    server_env = _start_forkserver() if method == "forkserver" else None
    with tempfile.TemporaryDirectory(prefix="graphflow-launch-") as tmp, _quiet_agent():
        folder = Path(tmp)
        config = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"graphflow-{uuid.uuid4().hex}",
            rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", local_addr="127.0.0.1",
            rdzv_configs={"join_timeout": max(1, math.ceil(timeout_s))}, max_restarts=0, start_method=method,
            logs_specs=DefaultLogsSpecs(log_dir=str(folder / "logs")))
        watchdog = _Watchdog(folder, nproc, timeout_s)
        handlers = _signal_handlers()
        failures: dict = {}
        try:
            watchdog.start()
            returned = elastic_launch(config, _rank_main)(fn, tuple(args), backend, group_timeout_s, timeout_s, tmp,
                                                          dict(os.environ), server_env)
        except ChildFailedError as err:
            returned, failures = {}, err.failures
        except SignalException as err:
            if err.sigval == signal.SIGINT:
                raise KeyboardInterrupt from err
            raise
        finally:
            watchdog.cancel()
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        results = {rank: returned.get(rank) or _saved(folder, rank) for rank in range(nproc)}
    first = min((r for r in failures if results.get(r) is None or not results[r].ok), default=None)
    for rank, result in results.items():
        if result is None:
            results[rank] = _ended(rank, failures.get(rank), first, results, watchdog.expired, timeout_s)
    return tuple(results[r] for r in range(nproc))


def _ended(rank: int, failure, first: int | None, results: Mapping[int, RankResult | None], expired: set[int],
           timeout_s: float) -> RankResult:
    """The result of a rank that left none: timed out, died, or stopped after another failed."""
    if rank in expired:
        return RankResult(rank, error=f"TimeoutError: rank {rank} did not finish within {timeout_s:g} s and was "
                                      "killed", elapsed_s=timeout_s)
    if failure is not None:
        code = failure.exitcode
        how = f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 else \
            f"exited with code {code}"
        return RankResult(rank, error=f"ProcessError: rank {rank} {how} without a result")
    cause = results.get(first)
    why = f" ({cause.error.splitlines()[0]})" if cause is not None and cause.error else ""
    return RankResult(rank, error=f"ProcessError: rank {rank} was stopped when rank {first} failed{why}")


def _rank_main(fn, args: tuple, backend: str, group_timeout_s: float, timeout_s: float, folder: str,
               environ: dict[str, str], server_env: dict[str, str] | None) -> RankResult:
    """One rank, started by elastic: join, run ``fn``, leave the result where ``launch`` finds it.

    An error is left too, then raised again, so elastic sees the rank fail and stops the others.
    """
    start = time.monotonic()
    # Elastic stops the ranks with SIGINT when the launcher is interrupted (Ctrl-C). A rank
    # started from a shell's background job inherits SIGINT ignored and would sit out the
    # agent's grace period until SIGKILL: take it as KeyboardInterrupt, so the rank rolls
    # back and leaves at once.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if server_env is not None:
        given = {k: v for k, v in os.environ.items() if server_env.get(k) != v}
        os.environ.clear()
        os.environ.update({**environ, **given})
    rank = int(os.environ["RANK"])
    folder = Path(folder)
    (folder / f"rank{rank}.pid").write_text(str(os.getpid()))
    from graphflow.dist.distributed import joined

    try:
        # The pid is written before the mark is read, and the watchdog marks before it
        # reads the pids: a rank either sees the deadline passed or is killed at it.
        if (folder / _EXPIRED).exists():
            raise TimeoutError(f"rank {rank} started after the {timeout_s:g} s deadline and did not run")
        with joined(backend, group_timeout_s=group_timeout_s) as ctx:
            value = fn(ctx, *args)
        result = RankResult(rank, value, elapsed_s=time.monotonic() - start)
        _leave(folder, result)
    except BaseException as e:
        _leave(folder, RankResult(rank, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(),
                                  elapsed_s=time.monotonic() - start))
        raise
    return result


def _leave(folder: Path, result: RankResult) -> None:
    """Write the result whole or not at all: ``launch`` may read it while elastic stops the rank."""
    data = pickle.dumps(result)
    part = folder / f"rank{result.rank}.part"
    part.write_bytes(data)
    os.replace(part, folder / f"rank{result.rank}.result")


def _saved(folder: Path, rank: int) -> RankResult | None:
    path = folder / f"rank{rank}.result"
    return pickle.loads(path.read_bytes()) if path.exists() else None


class _Watchdog:
    """Kills the ranks still running at the deadline; elastic sees them die and stops the rest."""

    def __init__(self, folder: Path, nproc: int, timeout_s: float):
        self.folder, self.nproc = folder, nproc
        self.expired: set[int] = set()
        self._timer = threading.Timer(timeout_s, self._expire)
        self._timer.daemon = True

    def start(self) -> None:
        self._timer.start()

    def cancel(self) -> None:
        self._timer.cancel()
        if self._timer.is_alive():
            self._timer.join()

    def _expire(self) -> None:
        (self.folder / _EXPIRED).write_text("")
        for rank in range(self.nproc):
            if (self.folder / f"rank{rank}.result").exists():
                continue
            self.expired.add(rank)
            try:
                pid = int((self.folder / f"rank{rank}.pid").read_text())
            except (OSError, ValueError):
                continue  # not started yet: it will find the mark and not run
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def _quiet_agent():
    """Elastic's agent logs a failed rank's traceback; ``launch`` returns it instead, once."""
    import logging

    loggers = [logging.getLogger(name) for name in list(logging.Logger.manager.loggerDict)
               if name.startswith(_AGENT_LOGGERS)]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _signal_handlers() -> dict:
    """The caller's handlers of the signals elastic takes over (only the main thread has any)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    handlers = {}
    for name in _AGENT_SIGNALS:
        sig = getattr(signal, name, None)
        if sig is not None and signal.getsignal(sig) is not None:
            handlers[sig] = signal.getsignal(sig)
    return handlers


def _start_forkserver() -> dict[str, str]:
    """Start the forkserver the gloo ranks come from, torch imported in it once; its environment.

    ``__main__`` is preloaded as spawn would import it, which also hands the server the
    caller's ``sys.path`` (a function of a test module must unpickle in the ranks).
    The server starts with SIGINT ignored, as Python keeps it: it ignores SIGINT itself
    only once the preload is done, and a Ctrl-C during the seconds torch takes to import
    printed its ``KeyboardInterrupt`` traceback under the launcher's own "interrupted".
    Its ranks take SIGINT back (``_rank_main``).
    """
    global _forkserver_env
    if _forkserver_env is None:
        from multiprocessing import forkserver

        multiprocessing.get_context("forkserver").set_forkserver_preload(
            ["__main__", "torch", "torch.distributed", "graphflow.dist.launch"])
        _forkserver_env = dict(os.environ)
        with _sigint_ignored():
            forkserver.ensure_running()
    return _forkserver_env


@contextlib.contextmanager
def _sigint_ignored():
    """SIGINT ignored in this process for the block, so the processes it starts inherit
    that (only the main thread may change a handler; elsewhere the block runs as is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
