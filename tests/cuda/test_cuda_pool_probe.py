"""The pool probe (``Backend.pool_probe``) while another thread routes its allocations to a
pool of its own, as a capture does: the allocator then counts a capture underway.

A probe's pool given back as a ``torch.cuda.MemPool`` is destroyed, destroying empties it,
and emptying asserts that no capture is underway in the process: in a destructor the
assertion aborts the process (it did on the H200, in this suite: "captures_underway.empty()
INTERNAL ASSERT FAILED" in ``~MemPool``). The probe's pool is a graph pool given back as a
graph's is, its blocks freed by the next emptying with nothing underway.
"""

import threading

import pytest
import torch

pytestmark = pytest.mark.cuda

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from graphflow.engine.backend import CudaBackend


def test_a_probe_ended_while_another_thread_allocates_to_a_pool_aborts_nothing_and_leaves_nothing():
    device = torch.device("cuda", torch.cuda.current_device())
    began, end, failures = threading.Event(), threading.Event(), []
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved(device)
    # The other thread's pool is a bare pool id, routed to as torch.cuda.graph's capture
    # does: no MemPool whose destructor could itself abort should anything stay open.
    other = torch.cuda.graph_pool_handle()

    def routed() -> None:
        try:
            torch._C._cuda_beginAllocateCurrentThreadToPool(device.index, other)
            try:
                began.set()
                end.wait(30)
            finally:
                torch._C._cuda_endAllocateToPool(device.index, other)
                torch._C._cuda_releasePool(device.index, other)
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            failures.append(exc)
            began.set()

    thread = threading.Thread(target=routed)
    thread.start()
    try:
        assert began.wait(30)
        with CudaBackend().pool_probe(device) as probe, probe.route():
            block = torch.empty(1 << 20, device=device)  # 4 MiB: a 20 MiB segment of the probe's pool
            del block
        assert probe.bytes is not None and probe.bytes >= 4 << 20
    finally:
        end.set()
        thread.join(30)
    assert not failures, failures
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved(device) == reserved  # the probe's pool freed by the next emptying
