"""The store barrier: agreement, disagreement and absence become errors, never hangs.

Ranks are threads sharing one in-memory c10d ``HashStore``: the barrier only uses the
store API, so this is the same code path as over a TCPStore between processes
(tests/test_multirank.py runs that).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from graphflow.dist.barrier import StoreBarrier
from graphflow.errors import DivergenceError
from graphflow.dist.trace import TraceLog
from rank_threads import run_threads


def _log(rank, events):
    log = TraceLog(rank)
    for e in events:
        log.record(e)
    return log


def _run_ranks(store, world, body, *, timeout_s=5.0, namespace="t"):
    """Run ``body(rank, barrier)`` on one thread per rank; return each rank's exception or None."""

    def rank_body(rank):
        body(rank, StoreBarrier(store, rank, range(world), timeout_s=timeout_s, namespace=namespace))

    return run_threads(world, rank_body, timeout_s=timeout_s)


EVENTS = [{"event": "phase_begin", "phase": "warmup"}, {"event": "collective", "channel": "tp_ar", "shape": [2, 4]}]


class TestAgreement:
    def test_equal_traces_pass_every_barrier(self):
        store = dist.HashStore()

        def body(rank, barrier):
            log = TraceLog(rank)
            for event in EVENTS:
                log.record(event)
                barrier.arrive(event["event"], log.state())

        assert _run_ranks(store, 3, body) == {0: None, 1: None, 2: None}

    def test_a_passed_barrier_deletes_the_ranks_key_of_the_one_before(self):
        store = dist.HashStore()

        def body(rank, barrier):
            log = _log(rank, EVENTS)
            for i in range(3):
                barrier.arrive(f"b{i}", log.state())

        _run_ranks(store, 2, body)
        assert [store.check([f"t/{seq}/0"]) for seq in range(3)] == [False, False, True]

    def test_single_member_needs_no_store(self):
        barrier = StoreBarrier(None, 0, [0], namespace="solo")
        barrier.arrive("x", _log(0, EVENTS).state())
        assert barrier.seq == 1

    def test_rank_outside_members_is_refused(self):
        with pytest.raises(ValueError, match=r"rank 3 is not a member of barrier 'ns' \(members \[0, 1\]\)"):
            StoreBarrier(dist.HashStore(), 3, [0, 1], namespace="ns")


class TestDisagreement:
    def test_every_rank_raises_naming_the_minority_and_the_first_differing_event(self):
        store = dist.HashStore()

        def body(rank, barrier):
            last = ({"event": "descriptor_end", "descriptor": "FULL(B=67)"} if rank == 0 else
                    {"event": "collective", "channel": "ep_ar", "shape": [67, 4]})
            log = _log(rank, [*EVENTS, last])
            barrier.arrive("next", log.state(), phase="warmup", descriptor="FULL(B=67)")

        results = _run_ranks(store, 3, body)
        assert all(isinstance(e, DivergenceError) for e in results.values())
        for rank, error in results.items():
            assert error.ranks == (0,)
            assert error.rank == rank and error.phase == "warmup" and error.descriptor == "FULL(B=67)"
            assert error.event["event"] == "descriptor_end" and error.event["n"] == 2
            lines = error.message.splitlines()
            assert lines[0] == "ranks diverged at barrier 'next' (#0): rank(s) 0 differ from rank(s) 1, 2"
            assert lines[1] == "first differing event (index 2 in this scope):"
            assert lines[2] == "  rank 0: #2 descriptor_end descriptor=FULL(B=67)"
            assert lines[3] == "  rank 1: #2 collective channel=ep_ar shape=[67, 4]"

    def test_a_shorter_trace_differs_where_it_ends(self):
        store = dist.HashStore()

        def body(rank, barrier):
            barrier.arrive("b", _log(rank, EVENTS if rank else EVENTS[:1]).state())

        results = _run_ranks(store, 2, body)
        error = results[1]
        assert error.ranks == (1,)  # a tie: the group of the lowest rank counts as the majority
        assert "  rank 0: (no event: the trace ends here)" in error.message.splitlines()

    def test_differing_labels_with_equal_traces_still_disagree(self):
        store = dist.HashStore()

        def body(rank, barrier):
            barrier.arrive("phase_end" if rank else "all_reduce tp_ar", _log(rank, EVENTS).state())

        results = _run_ranks(store, 2, body)
        assert all(isinstance(e, DivergenceError) for e in results.values())
        assert "the first differing event is older than the published windows" in results[0].message


class TestAbsence:
    def test_a_rank_that_never_arrives_is_named_within_the_timeout(self):
        store = dist.HashStore()

        def body(rank, barrier):
            if rank == 2:
                return  # this rank went another way and never reaches the barrier
            barrier.arrive("phase_end capture", _log(rank, EVENTS).state(), phase="capture")

        start = time.monotonic()
        results = _run_ranks(store, 3, body, timeout_s=0.5)
        assert time.monotonic() - start < 5
        assert results[2] is None
        for rank in (0, 1):
            error = results[rank]
            assert isinstance(error, DivergenceError)
            assert error.ranks == (2,) and error.phase == "capture"
            assert error.message.startswith("rank(s) 2 did not reach barrier 'phase_end capture' (#0) within 0.5 s; "
                                            f"rank {rank}'s last event: #1 collective channel=tp_ar shape=[2, 4]")

    def test_an_abandoning_rank_fails_the_others_at_once(self):
        store = dist.HashStore()

        def body(rank, barrier):
            log = _log(rank, EVENTS)
            if rank == 1:
                log.record({"event": "rollback"})
                barrier.abandon("RuntimeError: injected", log.state())
                return
            barrier.arrive("collective", log.state())

        start = time.monotonic()
        results = _run_ranks(store, 3, body, timeout_s=30)
        assert time.monotonic() - start < 10  # not the 30 s timeout
        for rank in (0, 2):
            error = results[rank]
            assert error.ranks == (1,)
            assert "rank 1 abandoned the pipeline: RuntimeError: injected" in error.message
            assert "  rank 1: #2 rollback" in error.message

    def test_a_rank_arriving_after_the_others_gave_up_raises_instead_of_passing(self):
        store = dist.HashStore()
        gave_up = threading.Barrier(3)

        def body(rank, barrier):
            log = _log(rank, EVENTS)
            try:
                if rank != 2:
                    barrier.arrive("all_reduce tp_ar", log.state(), phase="warmup")
            finally:
                gave_up.wait()
            if rank == 2:  # stalled past the timeout: comes back to a barrier the others left
                barrier.arrive("all_reduce tp_ar", log.state(), phase="warmup")

        results = _run_ranks(store, 3, body, timeout_s=0.5)
        assert [results[r].ranks for r in range(3)] == [(2,), (2,), (2,)]
        assert all(results[r].message.startswith("rank(s) 2 did not reach barrier") for r in (0, 1))
        late = results[2]
        assert isinstance(late, DivergenceError) and late.phase == "warmup"
        assert late.message.startswith("rank 2 reached barrier 'all_reduce tp_ar' (#0) too late: rank ")
        assert late.message.endswith("had given up waiting for it after 0.5 s, so every rank abandons the pipeline")

    def test_a_rank_still_waiting_raises_as_soon_as_another_gives_up(self):
        store = dist.HashStore()

        def body(rank, barrier):
            if rank == 2:
                return
            if rank == 1:  # waits ten times longer than rank 0
                barrier.timeout *= 10
            barrier.arrive("b", _log(rank, EVENTS).state())

        start = time.monotonic()
        results = _run_ranks(store, 3, body, timeout_s=0.5)
        assert time.monotonic() - start < 4  # rank 1 did not wait its own 5 s
        assert results[1].ranks == (2,) and results[1].message.startswith("rank(s) 2 did not reach barrier 'b'")
