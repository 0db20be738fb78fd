"""The rollback stack: LIFO, every undo runs, all failures reported together."""

import pytest

from graphflow.engine.rollback import UndoError, UndoStack


class TestUnwind:
    def test_runs_undos_last_in_first_out(self):
        stack, ran = UndoStack(), []
        for name in ("pool", "buffers", "graph"):
            stack.push(name, lambda name=name: ran.append(name))
        assert stack.unwind() is None
        assert ran == ["graph", "buffers", "pool"]
        assert len(stack) == 0

    def test_every_undo_runs_when_some_raise(self):
        stack, ran = UndoStack(), []
        stack.push("first", lambda: ran.append("first"))
        stack.push("broken", lambda: (_ for _ in ()).throw(OSError("device lost")))
        stack.push("middle", lambda: ran.append("middle"))
        stack.push("also broken", lambda: (_ for _ in ()).throw(ValueError("bad handle")))
        group = stack.unwind()
        assert ran == ["middle", "first"]
        assert isinstance(group, UndoError) and isinstance(group, ExceptionGroup)
        assert [type(e) for e in group.exceptions] == [ValueError, OSError]
        assert group.exceptions[0].__notes__ == ["while undoing: also broken"]
        assert group.exceptions[1].__notes__ == ["while undoing: broken"]
        assert str(group).startswith("2 undo step(s) failed (while undoing: also broken, while undoing: broken)")

    def test_keyboard_interrupt_in_an_undo_does_not_stop_the_rest(self):
        stack, ran = UndoStack(), []
        stack.push("last", lambda: ran.append("last"))
        stack.push("interrupted", lambda: (_ for _ in ()).throw(KeyboardInterrupt()))
        group = stack.unwind()
        assert ran == ["last"]
        (wrapped,) = group.exceptions
        assert isinstance(wrapped, RuntimeError) and isinstance(wrapped.__cause__, KeyboardInterrupt)


class TestRunNow:
    def test_runs_one_undo_early_and_forgets_it(self):
        stack, ran = UndoStack(), []
        stack.push("pool", lambda: ran.append("pool"))
        gc_undo = stack.push("unfreeze", lambda: ran.append("unfreeze"))
        stack.push("graph", lambda: ran.append("graph"))
        stack.run_now(gc_undo)
        assert ran == ["unfreeze"]
        assert stack.names() == ("pool", "graph")
        stack.unwind()
        assert ran == ["unfreeze", "graph", "pool"]

    def test_unknown_undo_raises(self):
        stack = UndoStack()
        other = UndoStack().push("x", lambda: None)
        with pytest.raises(ValueError):
            stack.run_now(other)
