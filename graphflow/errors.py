"""graphflow's exceptions: small classes that subclass a meaningful built-in.

Each keeps the pieces of its message as attributes, so tools and tests read the
element, phase or rank instead of parsing text.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import traceback
from collections.abc import Callable
from types import TracebackType

import attrs

from graphflow.events import Phase

__all__ = ["TRACEBACK_NOTE", "CaptureError", "DivergenceError", "FieldError", "FieldTypeError", "FieldValueError",
           "GraphflowError", "InvalidPlanError", "OptionError", "PlanError", "OptionFix", "UserFrame", "did_you_mean",
           "record_user_frames", "user_frames"]


#: How the note that keeps an error's traceback as text begins (the error itself keeps
#: no traceback after rollback: see ``graphflow.engine.pipeline``).
TRACEBACK_NOTE = "raised at (most recent call last):"


@attrs.frozen
class UserFrame:
    """A frame of the user's own code in an error's traceback: what they can open and fix.

    Plain strings and an int, so an error may keep it after rollback (nothing of the
    frame's locals stays alive) and across processes (it pickles).
    """

    file: str
    line: int
    function: str
    source: str

    def where(self) -> str:
        """``file:line``, the file relative to the current directory when it is under it."""
        path = self.file
        if os.path.isabs(path):
            relative = os.path.relpath(path)
            path = path if relative.startswith(os.pardir) else relative
        return f"{path}:{self.line}"


#: The attribute an error keeps its user frames in once its traceback is dropped.
_USER_FRAMES = "graphflow_user_frames"


def _library_dirs() -> tuple[str, ...]:
    """Folders whose code is not the user's: graphflow, the standard library, installed
    packages (site-packages: PyYAML's parser, transformers' modeling code), and torch
    when it is loaded (an error raised in torch's code means torch was loaded)."""
    paths = sysconfig.get_paths()
    dirs = [os.path.dirname(os.path.abspath(__file__)),
            *(paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib"))]
    torch = sys.modules.get("torch")
    if getattr(torch, "__file__", None):
        dirs.append(os.path.dirname(torch.__file__))
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs)


def _is_user_file(file: str) -> bool:
    """The one rule of what a user frame is: code that is neither graphflow's, torch's,
    an installed package's nor the standard library's (nor the interpreter's frozen
    modules, nor a compiled extension's source such as ``yaml/_yaml.pyx``)."""
    return (not file.startswith("<") and not file.endswith(".pyx")
            and not os.path.realpath(file).startswith(_library_dirs()))


def _frames(tb: TracebackType | None) -> tuple[UserFrame, ...]:
    return tuple(UserFrame(f.filename, f.lineno or 0, f.name, (f.line or "").strip())
                 for f in traceback.extract_tb(tb) if _is_user_file(f.filename))


def record_user_frames(error: BaseException) -> None:
    """Keep the user frames of ``error``'s traceback on it, before the traceback is dropped."""
    try:
        setattr(error, _USER_FRAMES, _frames(error.__traceback__))
    except (AttributeError, TypeError):  # an exception class that refuses new attributes
        pass


def user_frames(error: BaseException) -> list[tuple[BaseException, tuple[UserFrame, ...]]]:
    """Each error of ``error``'s chain that has user frames, with them, root cause first
    (the order Python prints a chain in): the last frame of the first is where the
    user's code failed. Frames kept by rollback are used, else the live traceback."""
    found: list[tuple[BaseException, tuple[UserFrame, ...]]] = []
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        frames = getattr(current, _USER_FRAMES, None)
        frames = _frames(current.__traceback__) if frames is None else frames
        if frames:
            found.append((current, frames))
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    return found[::-1]


@attrs.frozen
class OptionFix:
    """A ``RunOptions`` field and the value an error's fix sets it to, kept as data so
    that each caller says it in its own terms: ``str()`` gives ``RunOptions(sizes=...)``,
    the command line its flag (``graphflow.cli.flag``). ``value`` is ``...`` where the
    caller picks it."""

    field: str
    value: object = ...

    def __str__(self) -> str:
        return f"RunOptions({self.field}={'...' if self.value is ... else repr(self.value)})"


def _said(hint: str | None, settings: tuple[OptionFix, ...], spell: Callable[[OptionFix], str]) -> str | None:
    """``hint`` with ``{0}``, ``{1}``... each setting as ``spell`` says it."""
    if hint is None or not settings:
        return hint
    return hint.format(*(spell(setting) for setting in settings))


class GraphflowError(Exception):
    """Base of every error graphflow raises on purpose."""

    def describe(self, spell: Callable[[OptionFix], str] = str) -> str:
        """The message, each ``RunOptions`` setting its fix names said by ``spell``."""
        return str(self)


class PlanError(GraphflowError, ValueError):
    """A plan cannot be read: bad YAML, an unknown key, a wrong type, a bad template.

    ``str()`` gives ``file:line: element: message`` so the CLI prints it as is.
    """

    def __init__(self, message: str, *, file: str | None = None, line: int | None = None, element: str | None = None):
        self.message = message
        self.file = file
        self.line = line
        self.element = element
        super().__init__(str(self))

    def __str__(self) -> str:
        where = ""
        if self.file is not None:
            where = f"{self.file}:{self.line}: " if self.line is not None else f"{self.file}: "
        elem = f"{self.element}: " if self.element else ""
        return f"{where}{elem}{self.message}"


class FieldError(GraphflowError):
    """A plan element built in Python holds a value its field does not allow.

    The message follows attrs' template, ``'warmup_iters' must be >= 1 (got 0)``; the
    pieces stay as attributes: ``field`` (the attribute, with an index or key for an
    item: ``'ranks[1]'``), ``expected``, ``value`` and ``suggestions``, the allowed values
    the one given most likely meant (``bf16``: ``bfloat16``), said after it.
    """

    def __init__(self, field: str, expected: str, value, suggestions: tuple[str, ...] = ()):
        self.field = field
        self.expected = expected
        self.value = value
        self.suggestions = tuple(suggestions)
        # The pieces, as attrs raises them (and pickling needs).
        super().__init__(field, expected, value, *((self.suggestions,) if self.suggestions else ()))

    def __str__(self) -> str:
        return f"'{self.field}' must be {self.expected} (got {self.value!r}{did_you_mean(self.suggestions, '; ')})"


def did_you_mean(suggestions: tuple[str, ...], before: str = " ") -> str:
    """``did you mean 'a' or 'b'?`` after ``before``, or nothing without suggestions."""
    if not suggestions:
        return ""
    return f"{before}did you mean {' or '.join(repr(s) for s in suggestions)}?"


class FieldTypeError(FieldError, TypeError):
    """A field holds a value of the wrong type (``'id'`` given ``'1'``)."""


class FieldValueError(FieldError, ValueError):
    """A field holds a value of the right type outside its range or choices."""


class InvalidPlanError(GraphflowError, ValueError):
    """A plan the validator rejects: refused before any model is built or GPU touched.

    ``report`` is the ``graphflow.plan.rules.Report`` with every diagnostic.
    """

    def __init__(self, report):
        self.report = report
        errors = report.errors
        shown = "; ".join(str(d) for d in errors[:3]) + (f"; and {len(errors) - 3} more" if len(errors) > 3 else "")
        super().__init__(f"plan {report.plan_name!r} has {len(errors)} validation error(s): {shown} — "
                         "fix them before capture (graphflow validate lists them all)")


class OptionError(GraphflowError, ValueError):
    """A ``RunOptions`` value this process cannot honour (the cuda backend with no GPU):
    ``hint_text`` says which values can, ``{0}``, ``{1}``... standing for its ``settings``."""

    def __init__(self, message: str, *, hint: str, settings: tuple[OptionFix, ...] = ()):
        self.message = message
        self.hint_text = hint
        self.settings = tuple(settings)
        super().__init__(str(self))

    def __str__(self) -> str:
        return self.describe()

    def describe(self, spell: Callable[[OptionFix], str] = str) -> str:
        return f"{self.message} — {_said(self.hint_text, self.settings, spell)}"


class CaptureError(GraphflowError, RuntimeError):
    """The capture pipeline failed and was rolled back.

    Names the phase, descriptor, segment and rank where it failed, and what to do:
    ``hint_text``, whose ``{0}``, ``{1}``... stand for its ``settings`` (the ``RunOptions``
    values that fix it, as data), said ``RunOptions(sizes=...)`` by ``hint`` and
    ``str()``, and in a caller's own terms by ``describe``; a ``hint`` set afterwards is
    plain text and names none.
    ``phase`` is a ``Phase`` whenever it names one of the pipeline's phases, however it
    was given (callers that predate ``Phase`` pass its value); a phase of another
    lifecycle (an integration's own, vLLM's ``validate``) stays the name it was given.
    ``undo_error`` is set by rollback: the ``UndoError`` (an ``ExceptionGroup``) of the
    undo steps that failed after this error, None when every one ran.
    """

    message: str
    descriptor: object
    segment: str | None
    rank: int | None
    hint: str | None
    undo_error: BaseExceptionGroup | None

    def __init__(self, message: str, *, phase: Phase | str | None = None, descriptor=None,
                 segment: str | None = None, rank: int | None = None, hint: str | None = None,
                 settings: tuple[OptionFix, ...] = ()):
        self.message = message
        self.phase = phase
        self.descriptor = descriptor
        self.segment = segment
        self.rank = rank
        self.hint_text = hint
        self.settings = tuple(settings)
        self.undo_error = None
        super().__init__(str(self))

    @property
    def hint(self) -> str | None:
        return _said(self.hint_text, self.settings, str)

    @hint.setter
    def hint(self, value: str | None) -> None:
        self.hint_text, self.settings = value, ()

    @property
    def phase(self) -> Phase | str | None:
        return self._phase

    @phase.setter
    def phase(self, value: Phase | str | None) -> None:
        # Rollback fills in a missing phase by assignment: it is converted there too.
        self._phase = _phase(value)

    def __str__(self) -> str:
        return self.describe()

    def describe(self, spell: Callable[[OptionFix], str] = str) -> str:
        where = [f"{k}={v}" for k, v in (("phase", self.phase), ("descriptor", self.descriptor),
                                           ("segment", self.segment), ("rank", self.rank)) if v is not None]
        text = f"[{' '.join(where)}] {self.message}" if where else self.message
        hint = _said(self.hint_text, self.settings, spell)
        return f"{text} — {hint}" if hint else text


def _phase(value: Phase | str | None) -> Phase | str | None:
    if value is None or isinstance(value, Phase):
        return value
    try:
        return Phase(value)
    except ValueError:
        return value


class DivergenceError(CaptureError):
    """Ranks disagreed at a barrier or did not reach it in time.

    ``ranks`` lists the ranks that differ (or never arrived); ``event`` is the first
    differing trace event, as a dict, when one is known.
    """

    def __init__(self, message: str, *, ranks=(), event: dict | None = None, **kwargs):
        self.ranks = tuple(ranks)
        self.event = event
        super().__init__(message, **kwargs)
