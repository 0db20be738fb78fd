"""The rollback stack: every acquired resource registers its undo, last in, first out.

Modelled on pytest's ``SetupState``: a step registers its undo only once it has
succeeded, so rollback never undoes what was never done; ``unwind`` runs *every* undo
even when earlier ones raise, and reports all failures together as one
``ExceptionGroup``. A committed engine keeps the same stack and unwinds it on
``close()``, so teardown and rollback share one home.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

__all__ = ["UndoStack", "Undo", "UndoError"]


class UndoError(ExceptionGroup):
    """Some undo steps raised during an unwind; the others still ran.

    Each member carries a note naming the undo step that raised it.
    """


@attrs.define(eq=False)
class Undo:
    """One registered undo; ``name`` says what it gives back (for error notes)."""

    name: str
    fn: Callable[[], None]


@attrs.define
class UndoStack:
    _undos: list[Undo] = attrs.field(factory=list)

    def push(self, name: str, fn: Callable[[], None]) -> Undo:
        """Register ``fn`` to undo a step that just succeeded."""
        undo = Undo(name, fn)
        self._undos.append(undo)
        return undo

    def run_now(self, undo: Undo) -> None:
        """Undo one step early (the gc unfreeze at the end of capture) and forget it."""
        self._undos.remove(undo)
        undo.fn()

    def adopt(self, other: UndoStack) -> None:
        """Move ``other``'s undos on top of this stack, in their order (``other`` empties):
        a step done on a stack of its own (a background descriptor) joins the whole."""
        self._undos.extend(other._undos)
        other._undos = []

    def __len__(self) -> int:
        return len(self._undos)

    def names(self) -> tuple[str, ...]:
        return tuple(u.name for u in self._undos)

    def unwind(self) -> UndoError | None:
        """Run every undo, newest first; return the failures as one group (None if none).

        ``BaseException`` from an undo (a second Ctrl-C) is collected as well: the rest
        of the stack must still run, or the process is left holding half the resources.
        """
        failures: list[BaseException] = []
        while self._undos:
            undo = self._undos.pop()
            try:
                undo.fn()
            except BaseException as exc:  # noqa: BLE001 - every undo must run; reported below
                exc.add_note(f"while undoing: {undo.name}")
                failures.append(exc)
        if not failures:
            return None
        exceptions = [e if isinstance(e, Exception) else _wrap(e) for e in failures]
        names = ", ".join(n for e in failures for n in getattr(e, "__notes__", ())[-1:])
        return UndoError(f"{len(failures)} undo step(s) failed ({names})", exceptions)


def _wrap(exc: BaseException) -> Exception:
    """ExceptionGroup holds only Exceptions: carry a KeyboardInterrupt as the cause."""
    wrapped = RuntimeError(f"{type(exc).__name__} during undo")
    wrapped.__cause__ = exc
    wrapped.__notes__ = list(getattr(exc, "__notes__", ()))
    return wrapped
