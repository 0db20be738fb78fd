"""Graph pools that outlive a failed capture.

Graphs captured one after another into one pool reuse its blocks, so a run captures into
one pool per device. A capture that fails part way may leave that pool unusable for
another: torch gives back the pool's use of an unended capture, and the next capture into
it trips the allocator's own accounting (``use_count > 0`` asserted, on the H100 and the
H200, for every capture after the first failure of a lazy engine). So after a failure
the next captures go to a fresh pool; the failed one is released at once when no graph
uses it (kept to the end, each failure held its pool's memory: 6.6 GiB on the H200 once
every lazy capture had failed), and at close otherwise.

Releasing a pool empties the allocator's cache, which CUDA refuses while any capture is
open: only the thread that captures calls ``failed`` and ``drop``.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable

import torch

from graphflow.engine.rollback import Undo, UndoStack

__all__ = ["PoolSet"]


class PoolSet:
    """The graph pools of one device (see the module docstring): captures go to
    ``current``; each pool is released by an undo on ``stack``."""

    def __init__(self, backend, device: torch.device, stack: UndoStack) -> None:
        self._backend, self._device, self._stack = backend, device, stack
        self._pools: list[tuple[object, Undo]] = []
        self._users: dict[Hashable, object] = {}  # whose graphs are in which pool
        self._new()

    @property
    def current(self) -> object:
        return self._pools[-1][0]

    def __iter__(self):
        return (pool for pool, _ in self._pools)

    def holds(self, user: Hashable) -> None:
        """``user``'s graphs were captured into the current pool."""
        self._users[user] = self.current

    def drop(self, user: Hashable) -> None:
        """``user``'s graphs are destroyed: a superseded pool no graph uses any more is released."""
        pool = self._users.pop(user, None)
        if pool is not None:
            self._release_if_unused(pool)

    def failed(self) -> None:
        """A capture into the current pool failed: the next go to a new one."""
        failed = self.current
        self._new()
        self._release_if_unused(failed)

    def nbytes(self) -> int | None:
        sizes = [self._backend.pool_bytes(pool) for pool in self]
        return None if None in sizes else sum(sizes)

    def _new(self) -> None:
        pool = self._backend.new_pool(self._device)
        undo = self._stack.push(f"release a graph pool on {self._device}",
                                functools.partial(self._release, pool))
        self._pools.append((pool, undo))

    def _release(self, pool: object) -> None:
        self._pools = [(p, u) for p, u in self._pools if p is not pool]
        self._backend.release_pool(pool)

    def _release_if_unused(self, pool: object) -> None:
        if pool is self.current or any(p is pool for p in self._users.values()):
            return
        undo = next(u for p, u in self._pools if p is pool)
        self._stack.run_now(undo)
