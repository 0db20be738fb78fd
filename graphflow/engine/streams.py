"""The process's CUDA streams for graphflow runs: lent to one run at a time, kept for life.

cuBLAS keeps a workspace (32 MiB on Hopper) per handle and stream it has run on, and
nothing frees one stream's workspace: torch's only call clears every stream's at once,
which would pull memory from under every other live graph that ran a matmul (another
engine's, torch.compile's, the user's). A run that took fresh streams from torch each
time therefore left a workspace behind per stream it used, at every capture, retry and
rollback: on the H200 a long-lived process held about 1 GiB that graphflow no longer
used before torch's pool of 32 streams per device came round again.

So runs borrow their streams here and give them back when they close or roll back: N
captures one after another cost what one does, and only runs alive at the same time (a
lazy engine beside a foreground one) hold streams of their own. A stream given back may
still have work queued; the next run's first use is ordered after it like any other
work on that stream.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import torch

__all__ = ["StreamPool", "cuda_streams"]


class StreamPool:
    """Streams per device, made by ``make`` when none is free and kept once given back."""

    def __init__(self, make: Callable[[torch.device], object]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._free: dict[torch.device, list[object]] = {}
        self.made = 0  # streams made over the process's life: what the pool holds at most

    def take(self, device: torch.device) -> object:
        with self._lock:
            free = self._free.get(device)
            if free:
                return free.pop()
            self.made += 1
        return self._make(device)

    def give(self, stream: object) -> None:
        """Return a stream ``take`` lent; the last given back is the next taken, so a run
        that gives its streams back in the reverse of the order it took them meets the
        same stream in the same place next time."""
        with self._lock:
            self._free.setdefault(stream.device, []).append(stream)

    def forget(self) -> None:
        """Drop every stream (a forked child: the parent's streams are not its own)."""
        with self._lock:
            self._free.clear()
            self.made = 0


#: The process's one pool of CUDA streams (``CudaBackend.new_stream``).
cuda_streams = StreamPool(lambda device: torch.cuda.Stream(device=device))
os.register_at_fork(after_in_child=cuda_streams.forget)
