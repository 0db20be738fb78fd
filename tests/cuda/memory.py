"""Device memory as the CUDA rollback and close tests count it: whole, nothing left out.

graphflow lends each run streams the process keeps (``graphflow.engine.streams``), and
cuBLAS keeps one workspace per stream it ran a matmul on: that memory is graphflow's,
held for the life of the process, once. tests/cuda/test_cuda_cycles.py counts it from a
fresh process over 100 capture, rollback and lazy cycles and shows it does not grow.
Here, before a test's first count, the streams a test may take are warmed once, as a
long-lived process's are after its first capture, so that each test's count before a
run and after its rollback or close compares the same things.
"""

from __future__ import annotations

import functools
import gc

import torch

from graphflow.engine.streams import cuda_streams

#: Streams warmed before a test's first count: more than any one test holds at once.
WARM_STREAMS = 8


def allocated() -> int:
    """``torch.cuda.memory_allocated()`` after collecting garbage, counted whole."""
    _warm_streams()
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


@functools.cache
def _warm_streams() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    streams = [cuda_streams.take(device) for _ in range(WARM_STREAMS)]
    a = torch.ones(64, 64, device=device)
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            a @ a  # cuBLAS makes this stream's workspace
    torch.cuda.synchronize(device)
    for stream in reversed(streams):
        cuda_streams.give(stream)
