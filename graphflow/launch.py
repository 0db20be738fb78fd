"""Run a function on N ranks, one process each: gloo on CPUs, NCCL on one GPU per rank.

``launch(fn, nproc, backend)`` is the whole launcher, for tests, benchmarks and
integrations that drive ``run_pipeline`` themselves. Per rank, in this order:

1. the process starts (``fork`` for gloo, which keeps the parent's imported torch;
   ``spawn`` for NCCL, since CUDA cannot survive a fork) and sets ``NVLS_ENV``, so
   NVLink multicast stays off in every process whatever the parent's environment;
2. on NCCL: ``cuda:{rank}`` becomes the current device and a stream created on it the
   current stream (capture on a non-default GPU needs a stream of that device);
3. ``torch.distributed`` is initialized over a TCPStore the parent hosts (port chosen by
   the OS, so launches never clash), with ``group_timeout_s`` as the backstop. The
   parent opens the store's listening socket before it starts the ranks but the store
   (whose server is a thread) only after: a rank forked while that thread holds a lock
   can hang before it ever reaches the store (seen once in CI: one of three gloo ranks
   never registered);
4. ``fn(RankContext, *args)`` runs; its return value (picklable) or its error is sent
   back to the parent; the process group is destroyed.

The parent waits up to ``timeout_s`` in all, kills a rank that has not finished and
reports it as timed out: a launch never hangs its caller.
"""

from __future__ import annotations

import datetime
import multiprocessing
import multiprocessing.connection
import os
import socket
import time
import traceback
from collections.abc import Callable, Sequence

import attrs

__all__ = ["NVLS_ENV", "RankContext", "RankResult", "launch"]

#: NVLink SHARP / multicast off in every rank: NCCL, torch symmetric memory, NVSHMEM.
NVLS_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

_BACKENDS = ("gloo", "nccl")


@attrs.frozen
class RankContext:
    """What a launched function learns about its rank. ``stream`` is None on gloo."""

    rank: int
    world_size: int
    backend: str
    device: object  # torch.device: cuda:{rank} on NCCL, cpu on gloo
    stream: object = None

    def place(self, plan):
        """``plan`` with its ``cuda:0`` buffers and streams on this rank's device (NCCL only).

        Plans are written for one GPU; each rank runs the same plan on its own device.
        """
        if self.backend != "nccl":
            return plan
        here = str(self.device)

        def move(item):
            return attrs.evolve(item, device=here) if item.device == "cuda:0" else item

        return attrs.evolve(plan, buffers=[move(b) for b in plan.buffers], streams=[move(s) for s in plan.streams])


@attrs.frozen
class RankResult:
    """One rank's return value, or its error (``Type: message``) with the traceback."""

    rank: int
    value: object = None
    error: str | None = None
    traceback: str | None = None
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


def launch(fn: Callable[..., object], nproc: int, backend: str = "gloo", *, args: Sequence[object] = (),
           timeout_s: float = 300.0, group_timeout_s: float = 60.0) -> tuple[RankResult, ...]:
    """Run ``fn(RankContext, *args)`` in ``nproc`` processes; one ``RankResult`` per rank.

    ``fn`` and ``args`` must be picklable by reference for NCCL (spawn): a module-level
    function. Raises ``ValueError`` before starting anything when the request cannot work
    (unknown backend, fewer GPUs than ranks).
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {', '.join(_BACKENDS)}")
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1 (got {nproc})")
    import torch
    import torch.distributed as dist

    if backend == "nccl" and torch.cuda.device_count() < nproc:
        raise ValueError(f"{nproc} NCCL ranks need {nproc} GPUs, this machine has {torch.cuda.device_count()} "
                         "— lower --nproc or use backend gloo")
    listener = socket.create_server(("127.0.0.1", 0))  # bound and listening, and no thread yet
    port = listener.getsockname()[1]
    context = multiprocessing.get_context("spawn" if backend == "nccl" else "fork")
    readers, procs = [], []
    for rank in range(nproc):
        reader, writer = context.Pipe(duplex=False)
        proc = context.Process(target=_worker, args=(fn, tuple(args), rank, nproc, backend, port,
                                                     group_timeout_s, writer), name=f"graphflow-rank{rank}")
        proc.start()
        writer.close()
        readers.append(reader)
        procs.append(proc)
    # The store takes the socket over (and closes it with itself); ranks that connected
    # before it started wait in the socket's backlog.
    store = dist.TCPStore("127.0.0.1", port, nproc + 1, is_master=True, wait_for_workers=False,
                          master_listen_fd=listener.detach())
    results: dict[int, RankResult] = {}
    deadline = time.monotonic() + timeout_s
    pending = {reader: rank for rank, reader in enumerate(readers)}
    while pending and (left := deadline - time.monotonic()) > 0:
        for reader in multiprocessing.connection.wait(list(pending), timeout=left):
            rank = pending.pop(reader)
            try:
                results[rank] = reader.recv()
            except EOFError:
                procs[rank].join(5)
                results[rank] = RankResult(rank, error=f"ProcessError: rank {rank} exited without a result "
                                                       f"(exit code {procs[rank].exitcode})")
    for rank, proc in enumerate(procs):
        proc.join(max(0.0, deadline - time.monotonic()) if rank in results else 0)
        if proc.is_alive():
            proc.kill()
            proc.join()
        if rank not in results:
            results[rank] = RankResult(rank, error=f"TimeoutError: rank {rank} did not finish within {timeout_s:g} s "
                                                   "and was killed", elapsed_s=timeout_s)
    for reader in readers:
        reader.close()
    del store  # every rank has finished or been killed: the server thread can stop
    return tuple(results[r] for r in range(nproc))


def _worker(fn, args, rank: int, world_size: int, backend: str, port: int, group_timeout_s: float, writer) -> None:
    os.environ.update(NVLS_ENV)
    start = time.monotonic()
    import torch
    import torch.distributed as dist

    try:
        device, stream = torch.device("cpu"), None
        if backend == "nccl":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
            stream = torch.cuda.Stream(device=device)
            torch.cuda.set_stream(stream)
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False,
                              timeout=datetime.timedelta(seconds=group_timeout_s))
        options = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=group_timeout_s), **options)
        try:
            value = fn(RankContext(rank, world_size, backend, device, stream), *args)
        finally:
            dist.destroy_process_group()
        result = RankResult(rank, value, elapsed_s=time.monotonic() - start)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which decides
        result = RankResult(rank, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(),
                            elapsed_s=time.monotonic() - start)
    writer.send(result)
    writer.close()
