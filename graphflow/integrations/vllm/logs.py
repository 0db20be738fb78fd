"""The plugin's log: a child of vLLM's own logger, every line naming its rank.

vLLM configures only its ``vllm`` logger (its handler and format: level, time, process
name and pid, file and line) and stops it propagating, so a logger outside ``vllm.*``
prints nothing under ``vllm serve`` unless the user set logging up. As ``vllm.graphflow``
the plugin's lines go where vLLM's go, in vLLM's format, at ``VLLM_LOGGING_LEVEL``, and a
``VLLM_LOGGING_CONFIG_PATH`` that configures ``vllm`` configures them too.

vLLM's format names the process, not the rank: ``log`` starts each message with
``graphflow[rank N]``, the global rank once ``torch.distributed`` is up and ``-`` before
it (at plugin load), so ranks' lines can be told apart and sorted by their times.

**Start-up lines** (``startup``) need more. ``vllm serve`` loads general plugins while it
builds its argument parser, before it sets its logging up from the parsed arguments: a
line logged then has no handler, so Python drops it (INFO) or prints it bare (WARNING).
And a process vLLM forks (the engine core and workers of a library user, or of
``VLLM_WORKER_MULTIPROC_METHOD=fork``) inherits the plugin already loaded and never loads
general plugins again, so it would never say the plugin is on in it. So a start-up line
is logged at once only where vLLM's logging is set up in this process; otherwise it is held
and logged just before vLLM's first line after its set-up (a record-factory wrapper sees
that line being made), with that line's process name. A forked child holds the lines
again (all but those the first process alone logs), and logs them before its own first
vLLM line. A process that never logs after vLLM's set-up logs them at its first capture
(``release``).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable, MutableMapping
from typing import Any

__all__ = ["LOGGER", "forget_startup", "log", "release", "startup"]

LOGGER = "vllm.graphflow"


class _RankedLog(logging.LoggerAdapter):
    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        return f"graphflow[rank {_rank()}]: {msg}", kwargs


def _rank() -> str:
    """This process's global rank, read without importing torch (vLLM has imported it)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return str(dist.get_rank())
    return "-"


log = _RankedLog(logging.getLogger(LOGGER), {})

#: A start-up line: level, message, its arguments, and where ``startup`` was called
#: (file, line, function), which vLLM's format prints.
_Line = tuple[int, str, tuple, tuple[str, int, str]]

_lock = threading.Lock()
_held: list[_Line] = []  # this process's lines not logged yet
_every_process: list[_Line] = []  # the lines a forked child logs again
_fork_hook = False  # os.register_at_fork done (inherited by forked children, like the lists)


def startup(level: int, msg: str, *args: Any, every_process: bool = True) -> None:
    """Log a start-up line once vLLM's logging is set up in this process (at once if it is).

    ``every_process``: a process forked from this one logs it too (it runs the plugin as
    this one does); False for a line only this first process has cause to log.
    """
    caller = sys._getframe(1)
    line = (level, msg, args, (caller.f_code.co_filename, caller.f_lineno, caller.f_code.co_name))
    with _lock:
        if every_process:
            _every_process.append(line)
            _after_fork_hold_again()
        if not _vllm_logging_set_up():
            _held.append(line)
            _watch()
            return
    _emit(line)


def release() -> None:
    """Log the held start-up lines now: a capture is starting, and its lines must not
    come before the ones saying the plugin is on."""
    with _lock:
        lines, _held[:] = list(_held), []
    for line in lines:
        _emit(line)


def forget_startup() -> None:
    """Drop every start-up line, held or to be held again after a fork (``unregister``)."""
    with _lock:
        _held.clear()
        _every_process.clear()


def _emit(line: _Line) -> None:
    level, msg, args, (path, lineno, func) = line
    logger = logging.getLogger(LOGGER)
    if logger.isEnabledFor(level):
        text, _ = log.process(msg, {})
        logger.handle(logger.makeRecord(LOGGER, level, path, lineno, text, args, None, func))


def _vllm_logging_set_up() -> bool:
    """Whether vLLM has set its logging up in this process (or in the process that forked
    it, whose handlers this one inherited). Another vLLM without that record: assumed so,
    and the line is logged at once, as before vLLM kept it."""
    vllm_logger = sys.modules.get("vllm.logger")
    return vllm_logger is None or getattr(vllm_logger, "_last_configured_logging_config", True) is not None


class _Watch:
    """The record factory while lines are held: makes each record with the factory it
    wraps, and before the first one made after vLLM's logging set-up, logs the held lines
    (which vLLM's own record factory, wrapping this one, names as that record's process).
    Once nothing is held it only passes records through."""

    def __init__(self, wrapped: Callable[..., logging.LogRecord]):
        self.wrapped = wrapped
        self._releasing = threading.local()

    def __call__(self, *args: Any, **kwargs: Any) -> logging.LogRecord:
        record = self.wrapped(*args, **kwargs)
        if _held and not getattr(self._releasing, "on", False) and _vllm_logging_set_up():
            self._releasing.on = True
            try:
                release()
            finally:
                self._releasing.on = False
        return record


def _watch() -> None:
    """Put ``_Watch`` in the record-factory chain unless it is there (vLLM's own factory,
    set at its logging set-up, wraps the one it found and keeps it as ``_factory``)."""
    factory = logging.getLogRecordFactory()
    while factory is not None:
        if isinstance(factory, _Watch):
            return
        factory = getattr(factory, "_factory", None)
    logging.setLogRecordFactory(_Watch(logging.getLogRecordFactory()))


def _after_fork_hold_again() -> None:
    global _fork_hook
    if not _fork_hook:
        os.register_at_fork(after_in_child=_hold_again)
        _fork_hook = True


def _hold_again() -> None:
    """In a forked child: hold this process's lines again (its handlers, inherited, are
    vLLM's, so the child's first vLLM line releases them under the child's own name)."""
    global _lock
    _lock = threading.Lock()  # another thread may have held it at the fork
    _held[:] = list(_every_process)
    if _held:
        _watch()
