"""The plugin's vLLM-free parts: the capture transaction and the per-rank session.

Ranks are threads sharing one in-memory c10d ``HashStore`` (the session only uses the
store); the plugin's hooks against real vLLM are tests/vllm_plugin.
"""

import gc
import weakref

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from graphflow.engine.rollback import UndoError  # noqa: E402
from graphflow.errors import DivergenceError  # noqa: E402
from graphflow.integrations.vllm.descriptors import VllmDescriptor  # noqa: E402
from graphflow.integrations.vllm.session import CaptureSession  # noqa: E402
from graphflow.integrations.vllm.transaction import CaptureTransaction  # noqa: E402
from graphflow.plan import Mode  # noqa: E402
from rank_threads import run_threads  # noqa: E402


class Dispatcher:
    def __init__(self):
        self.cudagraph_keys = {"PIECEWISE": {1, 2}, "FULL": {1}}
        self.keys_initialized = True


class TestTransaction:
    def test_rollback_restores_clears_and_runs_newest_first(self):
        order, holder, dispatcher = [], type("Holder", (), {"pool": "A", "n": 1})(), Dispatcher()
        txn = CaptureTransaction()
        txn.on_rollback("first", lambda: order.append("first"))
        txn.keep_attrs("counter", holder, ("n",))
        txn.keep_each("pools", [holder], "pool")
        txn.clear_keys("keys", dispatcher)
        txn.on_rollback("last", lambda: order.append("last"))
        holder.pool, holder.n = "B", 5
        assert txn.rollback() is None
        assert order == ["last", "first"] and (holder.pool, holder.n) == ("A", 1)
        assert dispatcher.cudagraph_keys == {"PIECEWISE": set(), "FULL": set()} and not dispatcher.keys_initialized

    def test_every_undo_runs_when_one_raises(self):
        ran = []
        txn = CaptureTransaction()
        txn.on_rollback("a", lambda: ran.append("a"))
        txn.on_rollback("b", lambda: 1 / 0)
        error = txn.rollback()
        assert ran == ["a"] and isinstance(error, UndoError)
        assert "while undoing: b" in error.exceptions[0].__notes__

    def test_the_collector_comes_back_enabled_and_unfrozen(self):
        txn = CaptureTransaction()
        txn.keep_gc()
        gc.freeze()
        gc.disable()
        txn.rollback()
        assert gc.isenabled() and gc.get_freeze_count() == 0

    def test_commit_keeps_everything_and_finishes(self):
        holder = type("Holder", (), {"n": 1})()
        txn = CaptureTransaction()
        txn.keep_attrs("n", holder, ("n",))
        holder.n = 2
        txn.commit()
        assert txn.rollback() is None and holder.n == 2
        with pytest.raises(RuntimeError, match="finished"):
            txn.on_rollback("late", lambda: None)

    def test_rollback_frees_what_only_the_failed_frames_hold(self):
        class Graph:  # stands for a half-captured CUDA graph holding pool memory
            pass

        ref = None

        def capture():
            nonlocal ref
            graph = Graph()
            ref = weakref.ref(graph)
            raise RuntimeError("capture failed")

        txn = CaptureTransaction()
        try:
            capture()
        except RuntimeError as error:
            assert ref() is not None  # the traceback's frame holds it
            txn.rollback(error)
            assert ref() is None and error.__traceback__ is not None


def run_ranks(body, world=3, timeout_s=5.0):
    store = dist.HashStore()

    def rank_body(rank):
        body(rank, CaptureSession(rank=rank, world=range(world), store=store, timeout_s=timeout_s, namespace="t"))

    return run_threads(world, rank_body, timeout_s=timeout_s)


DESC = VllmDescriptor("target", Mode.FULL, 4, 4, 1)


def step(session, shapes):
    with session.at(family="target", descriptor=DESC, mode="FULL", phase="warmup"):
        session.boundary("phase_begin")
        for counter, shape in enumerate(shapes):
            session.record_call(session.scope(session.world), {"op": "all_reduce", "shape": shape, "counter": counter,
                                                                "path": "placeholder"})
        session.boundary("phase_end")


class TestSession:
    def test_ranks_that_make_the_same_calls_agree(self):
        assert run_ranks(lambda rank, s: step(s, [[4, 8], [2, 8]])) == {0: None, 1: None, 2: None}

    def test_a_rank_that_calls_differently_is_named_on_every_rank(self):
        results = run_ranks(lambda rank, s: step(s, [[4, 8], [3 if rank == 2 else 2, 8]]))
        assert all(isinstance(e, DivergenceError) for e in results.values())
        for error in results.values():
            assert error.ranks == (2,) and error.phase == "warmup" and error.descriptor == DESC
            assert error.event["shape"] == [3, 8] and "phase_end warmup target FULL(tokens=4, reqs=4, q=1)" in str(error)

    def test_an_abandoning_rank_fails_the_others_at_once(self):
        def body(rank, session):
            if rank == 1:
                session.abandon("capture failed at target FULL(tokens=4)")
                return
            step(session, [[4, 8]])

        results = run_ranks(body, timeout_s=30.0)
        for rank in (0, 2):
            assert isinstance(results[rank], DivergenceError) and "abandoned" in str(results[rank])

    def test_the_site_is_restored_after_a_block(self):
        session = CaptureSession(rank=0, world=[0])
        with session.at(family="drafter", phase="capture"):
            assert (session.site.family, session.site.phase) == ("drafter", "capture")
        assert (session.site.family, session.site.phase) == ("target", None)
        assert [session.count_call("c"), session.count_call("c"), session.count_call("d")] == [0, 1, 0]
