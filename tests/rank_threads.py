"""Ranks as threads: run one body per rank and hand each rank's exception to the test."""

from __future__ import annotations

import threading
from collections.abc import Callable


def run_threads(world: int, body: Callable[[int], None], *, timeout_s: float = 5.0) -> dict:
    """Run ``body(rank)`` on one thread per rank; return each rank's exception or None."""
    results: dict[int, BaseException | None] = {}

    def target(rank):
        try:
            body(rank)
            results[rank] = None
        except BaseException as e:  # handed to the test
            results[rank] = e

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s * 4)
    assert not any(t.is_alive() for t in threads), "a barrier hung"
    return results
