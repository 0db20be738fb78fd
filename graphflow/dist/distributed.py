"""This process as one rank of a torch.distributed job: who it is, its device, its group.

torchrun (``torch.distributed.run``) starts one process per rank on every node and tells
each one, in its environment, who it is: ``RANK`` and ``WORLD_SIZE`` in the whole job,
``LOCAL_RANK`` on its node, ``MASTER_ADDR`` and ``MASTER_PORT`` for the job's store.
``joined()`` turns that into a ``RankContext`` — the same one ``graphflow.dist.launch`` hands
its function, which is how both launchers share one rank setup:

1. NVLink multicast is turned off (``NVLS_ENV``) before any communicator exists;
2. on NCCL, ``cuda:{LOCAL_RANK}`` becomes the current device and a stream created on it
   the current stream (capture on a non-default GPU needs a stream of that device).
   LOCAL_RANK, not RANK: on the second node of eight GPUs, rank 8 is that node's cuda:0;
3. the default process group starts through ``env://`` unless the caller made one; its
   store is the one the phase barriers and the trace agreement use (graphflow.dist.channels),
   so a job on several nodes agrees through the same service its collectives rendezvous on;
4. on leaving, the group is destroyed if ``joined`` made it.

Everything that goes wrong before the group exists is a ``ValueError`` saying which
variable to set, so the CLI can report it instead of a c10d traceback.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator, Mapping

import attrs

__all__ = ["NVLS_ENV", "RankContext", "identity", "in_job", "joined"]

#: NVLink SHARP / multicast off in every rank: NCCL, torch symmetric memory, NVSHMEM.
NVLS_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

BACKENDS = ("gloo", "nccl")


@attrs.frozen
class RankContext:
    """What a rank learns about itself. ``device`` is ``cuda:{LOCAL_RANK}`` on NCCL and
    ``cpu`` on gloo; ``stream`` is the rank's current stream on NCCL, None on gloo."""

    rank: int
    world_size: int
    backend: str
    device: object  # torch.device
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


def in_job(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process was started as a rank (torchrun sets RANK and WORLD_SIZE)."""
    environ = os.environ if environ is None else environ
    return "RANK" in environ and "WORLD_SIZE" in environ


@contextlib.contextmanager
def joined(backend: str | None = None, *, group_timeout_s: float = 60.0) -> Iterator[RankContext]:
    """This process as its rank of the job its environment names, for the ``with`` block.

    ``backend``: ``nccl`` or ``gloo``; None takes the existing group's, else NCCL when
    a GPU is present. ``group_timeout_s`` bounds the process group's own waits; the
    phase barriers have the plan's ``capture.barrier_timeout_s`` and end in a report.
    """
    os.environ.update(NVLS_ENV)
    import torch
    import torch.distributed as dist

    made = not dist.is_initialized()
    if made:
        rank, world_size = identity()
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    else:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        backend = backend or ("nccl" if "nccl" in str(dist.get_backend()) else "gloo")
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
    device, stream = torch.device("cpu"), None
    if backend == "nccl":
        device = _gpu(torch)
        torch.cuda.set_device(device)
        stream = torch.cuda.Stream(device=device)
        torch.cuda.set_stream(stream)
    if made:
        options = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=group_timeout_s), **options)
    try:
        yield RankContext(rank, world_size, backend, device, stream)
    finally:
        if made and dist.is_initialized():
            dist.destroy_process_group()


def identity() -> tuple[int, int]:
    """(RANK, WORLD_SIZE) of this process, checked, with the store's address present."""
    if not in_job():
        raise ValueError("RANK and WORLD_SIZE are not set: start the ranks with torchrun "
                         "(python -m torch.distributed.run) or graphflow launch")
    values = {}
    for name in ("RANK", "WORLD_SIZE"):
        try:
            values[name] = int(os.environ[name])
        except ValueError as err:
            raise ValueError(f"{name}={os.environ[name]!r} is not an integer") from err
    rank, world_size = values["RANK"], values["WORLD_SIZE"]
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK {rank} is outside the job's ranks 0..{world_size - 1} (WORLD_SIZE {world_size})")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise ValueError(f"{name} is not set: start the ranks with torchrun, which sets it, or set "
                             "MASTER_ADDR and MASTER_PORT to rank 0's host and a free port")
    return rank, world_size


def _gpu(torch):
    """``cuda:{LOCAL_RANK}``, checked against this node's GPUs."""
    count = torch.cuda.device_count()
    if count == 0:
        raise ValueError("the nccl backend needs a GPU per rank and torch sees none on this node — use gloo")
    text = os.environ.get("LOCAL_RANK")
    if text is None:
        raise ValueError("LOCAL_RANK is not set: start the ranks with torchrun, or set LOCAL_RANK to this "
                         "process's GPU on its node")
    try:
        local = int(text)
    except ValueError as err:
        raise ValueError(f"LOCAL_RANK={text!r} is not an integer") from err
    if not 0 <= local < count:
        raise ValueError(f"LOCAL_RANK {local} but this node has {count} GPU(s): start at most {count} "
                         "process(es) per node (--nproc-per-node)")
    return torch.device("cuda", local)
