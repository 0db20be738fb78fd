"""What the vLLM plugin relies on that only CUDA shows, on a real GPU, without vLLM.

vLLM cannot be installed on the GPU machine, so these tests drive the plugin's own
transaction and session code (``graphflow.integrations.vllm.transaction`` and
``.session``, which take the objects to restore) with plain ``torch.cuda.graph`` captures
shaped like vLLM's (a wrapper keeping one entry per descriptor in a shared pool, entries
made before capture) and with graphflow's own ``CudaBackend``:

* a capture that fails after allocating in the pool keeps that memory alive through the
  error's traceback; the transaction's rollback gives it all back while the error lives;
* a capture invalidated mid-way (a host sync inside it) leaves no stream capturing, and
  the next capture on the same stream and pool works and replays right;
* the store barrier runs inside a real capture (``capture_error_mode="global"``), on two
  processes sharing the GPU: agreeing ranks capture graphs that replay right, diverging
  ranks both raise DivergenceError and roll back to their baseline memory.

Run on the device: ``bash scripts/gpu_check.sh`` (or pytest -m cuda on this file).
"""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from graphflow.integrations.vllm.transaction import CaptureTransaction

pytestmark = pytest.mark.cuda

MiB = 1 << 20


class Wrapper:
    """vLLM's ``CUDAGraphWrapper`` in miniature: an entry per key, made before capturing."""

    def __init__(self, fn, pool):
        self.fn, self.pool, self.entries = fn, pool, {}

    def capture(self, key, x, stream):
        entry = self.entries.setdefault(key, {"graph": None, "output": None})
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            output = self.fn(x)
        entry["graph"], entry["output"] = graph, output
        return output

    def clear(self):
        self.entries.clear()


def step(x, *, fail=False, sync=False):
    h = x @ x.T                      # allocates in the graph pool while capturing
    h = torch.relu(h) @ x
    if sync:
        h.sum().item()               # a host read: invalidates the capture
    if fail:
        raise RuntimeError("stand-in failure inside capture, after allocating")
    return h * 2


def transaction_for(wrapper, flags):
    txn = CaptureTransaction("test capture")

    def release():
        torch.cuda.synchronize()
        torch._C._cuda_clearCublasWorkspaces()  # cuBLAS keeps a workspace per stream it ran on
        torch.cuda.empty_cache()

    txn.on_rollback("device memory released", release)
    txn.keep_gc()
    txn.keep_attrs("capturing flag", flags, ("capturing",))
    txn.on_rollback("wrapper graphs", wrapper.clear)
    return txn


def capture_all(wrapper, sizes, stream, *, fail_at=None, sync_at=None):
    flags = type("Flags", (), {"capturing": False})()
    txn = transaction_for(wrapper, flags)
    flags.capturing = True
    gc.freeze()
    gc.disable()
    try:
        for size in sizes:
            x = torch.randn(size, 256, device="cuda")
            step(x)  # the warmup vLLM runs before each graph
            torch.cuda.synchronize()
            wrapper.fn = lambda t, size=size: step(t, fail=size == fail_at, sync=size == sync_at)
            wrapper.capture(size, x, stream)
    except BaseException as error:
        undo = txn.rollback(error)
        return flags, error, undo
    txn.commit()
    gc.unfreeze()
    gc.enable()
    return flags, None, None


@pytest.fixture
def baseline():
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


@pytest.mark.parametrize("fail_at", [512, 128, 16], ids=["first", "middle", "last"])
def test_a_failed_capture_gives_its_pool_memory_back_while_the_error_lives(baseline, fail_at):
    stream = torch.cuda.Stream()
    wrapper = Wrapper(step, torch.cuda.graph_pool_handle())
    frozen = gc.get_freeze_count()  # what the interpreter froze before (torch's import does)
    flags, error, undo = capture_all(wrapper, [512, 256, 128, 64, 16], stream, fail_at=fail_at)
    assert isinstance(error, RuntimeError) and undo is None
    assert error.__traceback__ is not None  # the error (a CaptureError's cause) is still alive
    assert wrapper.entries == {} and flags.capturing is False
    assert gc.isenabled() and gc.get_freeze_count() <= frozen
    with torch.cuda.stream(stream):
        assert not torch.cuda.is_current_stream_capturing()
    del wrapper
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    assert allocated <= baseline[0] + MiB, f"{(allocated - baseline[0]) / MiB:.1f} MiB still allocated"
    assert reserved <= baseline[1] + 4 * MiB, f"{(reserved - baseline[1]) / MiB:.1f} MiB still reserved"


def test_without_clearing_the_frames_the_failed_capture_keeps_its_memory(baseline):
    stream = torch.cuda.Stream()
    wrapper = Wrapper(step, torch.cuda.graph_pool_handle())
    x = torch.randn(512, 256, device="cuda")
    step(x)
    wrapper.fn = lambda t: step(t, fail=True)
    try:
        wrapper.capture(512, x, stream)
    except RuntimeError as e:
        error = e
    wrapper.clear()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    held = torch.cuda.memory_allocated() - baseline[0] - x.numel() * 4
    assert held > 0  # the traceback's frames still hold the capture's tensors and graph
    CaptureTransaction().rollback(error)
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()  # the capture stream's cuBLAS workspace is not the capture's
    torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated() - baseline[0] - x.numel() * 4 <= MiB


def test_a_capture_invalidated_midway_leaves_nothing_capturing_and_the_next_capture_works(baseline):
    stream = torch.cuda.Stream()
    pool = torch.cuda.graph_pool_handle()
    wrapper = Wrapper(step, pool)
    flags, error, _ = capture_all(wrapper, [256, 64], stream, sync_at=64)
    assert error is not None and wrapper.entries == {}
    with torch.cuda.stream(stream):
        assert not torch.cuda.is_current_stream_capturing()
    again = Wrapper(step, pool)
    flags, error, _ = capture_all(again, [256, 64], stream)
    assert error is None and set(again.entries) == {256, 64}
    x = torch.randn(64, 256, device="cuda")
    expected = step(x)
    graph_input = torch.randn(64, 256, device="cuda")
    capture = Wrapper(step, pool)
    capture.capture("replay", graph_input, stream)
    graph_input.copy_(x)
    capture.entries["replay"]["graph"].replay()
    torch.cuda.synchronize()
    assert torch.equal(capture.entries["replay"]["output"], expected)


def test_graphflows_cuda_backend_ends_a_failed_capture_under_the_transaction(baseline):
    from graphflow.engine import CudaBackend

    backend = CudaBackend()
    device = backend.device("cuda:0")
    stream, pool = backend.new_stream(device), backend.new_pool(device)
    x = torch.randn(256, 256, device="cuda")
    step(x)
    graphs = []
    txn = CaptureTransaction("graphflow backend")
    txn.on_rollback("release pool", lambda: backend.release_pool(pool))
    txn.on_rollback("destroy graphs", lambda: [g.destroy() for g in graphs])
    graphs.append(backend.capture([lambda: step(x)], lambda: step(x), stream, pool))
    with pytest.raises(RuntimeError) as info:
        graphs.append(backend.capture([], lambda: step(x, sync=True), stream, pool))
    assert txn.rollback(info.value) is None
    assert not backend.is_capturing(stream)
    del x
    gc.collect()
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()  # cuBLAS's cache for the capture stream: not the pool's
    assert torch.cuda.memory_allocated() <= baseline[0] + MiB


WORKER = r"""
import datetime, json, sys, torch
import torch.distributed as dist
from graphflow.errors import DivergenceError
from graphflow.integrations.vllm.descriptors import VllmDescriptor
from graphflow.integrations.vllm.session import CaptureSession
from graphflow.integrations.vllm.transaction import CaptureTransaction
from graphflow.plan import Mode


def capture(session, x, stream, pool, graphs, rank, diverge):
    for size in (128, 64):
        d = VllmDescriptor("target", Mode.FULL, size, size, 1)
        with session.at(descriptor=d, mode="FULL", phase="capture"):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, stream=stream, capture_error_mode="global"):
                session.boundary("phase_begin")           # the store barrier, inside the capture
                y = (x[:size] @ x[:size].T).relu()
                shape = [size + 1 if diverge and rank == 1 else size, 256]
                session.record_call("world", {"op": "all_reduce", "shape": shape, "path": "captured"})
                session.boundary("phase_end")
            graphs.append((g, y, size))


def main():
    rank, port, diverge = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    session = CaptureSession(rank=rank, world=[0, 1], store=store, timeout_s=30, namespace="cuda")
    x = torch.randn(128, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    stream, pool, graphs = torch.cuda.Stream(), torch.cuda.graph_pool_handle(), []
    txn = CaptureTransaction("two ranks")
    txn.on_rollback("memory", lambda: (torch.cuda.synchronize(), torch.cuda.empty_cache()))
    txn.on_rollback("graphs", graphs.clear)
    with torch.cuda.stream(stream):  # the warmup vLLM runs first: cuBLAS's handle for this stream
        (x @ x.T).relu()
    torch.cuda.synchronize()
    # After the warmup: its cuBLAS workspace for the stream is the engine's, not the capture's.
    base = torch.cuda.memory_allocated() - x.numel() * x.element_size()
    result = {}
    try:
        capture(session, x, stream, pool, graphs, rank, diverge)
        for g, y, size in graphs:
            g.replay()
        torch.cuda.synchronize()
        result["replay_ok"] = all(torch.equal(y, (x[:s] @ x[:s].T).relu()) for g, y, s in graphs)
        result["outcome"] = "captured"
    except DivergenceError as e:
        txn.rollback(e)
        result.update(outcome="diverged", ranks=list(e.ranks), message=str(e))
    with torch.cuda.stream(stream):
        result["capturing"] = torch.cuda.is_current_stream_capturing()
    del x
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    result["leaked"] = torch.cuda.memory_allocated() - base if result["outcome"] == "diverged" else 0
    print(json.dumps(result))


main()
"""


@pytest.mark.parametrize("diverge", [False, True], ids=["agree", "diverge"])
def test_the_store_barrier_inside_a_real_capture_on_two_ranks(diverge):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(rank), str(port), "1" if diverge else "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for rank in (0, 1)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    results = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
    assert all(not r["capturing"] for r in results)
    if not diverge:
        assert [r["outcome"] for r in results] == ["captured", "captured"]
        assert all(r["replay_ok"] for r in results)
    else:
        assert [r["outcome"] for r in results] == ["diverged", "diverged"]
        assert all(r["ranks"] == [1] and "shape=[129, 256]" in r["message"] for r in results)
        assert all(r["leaked"] <= MiB for r in results)
