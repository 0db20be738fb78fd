"""Stand-ins for what vLLM needs a GPU for, so its real capture code runs on a CPU.

Only the GPU is replaced; vLLM's classes are the real ones:

* ``libcuda.so.1``: ``vllm.platforms.cuda`` links a library that needs the driver. A
  stub with the driver entry points it links against, each answering "no device", is
  built from ``libcuda_stub.c`` with gcc and loaded RTLD_GLOBAL first.
* the platform: vLLM's own ``NonNvmlCudaPlatform``, answering as an H100 (capability
  9.0), whose device communicator is ``GlooCudaCommunicator`` and whose graph pool is a
  handle object.
* ``torch.cuda`` streams, graphs and ``torch.accelerator``: ``CpuCuda`` keeps a current
  stream and a capturing flag per thread; ``torch.cuda.graph`` runs its body with the
  flag set (CPU kernels run instead of being recorded, as graphflow's CPU backend does)
  and hands out a graph that replays nothing.
* the custom all-reduce's IPC kernel: ``GlooCustomAllreduce`` keeps vLLM's
  ``custom_all_reduce``, ``all_reduce`` and ``capture`` and replaces the kernel by a sum
  over gloo (eager) or nothing (while capturing: a captured kernel does not run), and
  ``register_graph_buffers``' IPC calls by stand-in handles around vLLM's collective.
* ``weak_ref_tensors`` (a CUDA kernel making a graph output's weak reference): the
  output itself.
* the caching allocator's reuse of freed blocks: ``FreedBlocks`` hands the most recently
  released block of a shape to ``torch.empty_like``, as the CUDA caching allocator does,
  so vLLM's placeholder holds a rank's own earlier values.

``setup()`` must run before anything imports ``vllm.platforms``.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import pathlib
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from typing import Any
from unittest import mock

HERE = pathlib.Path(__file__).resolve().parent
TINY_MODELS = HERE / "models"

_STUB: ctypes.CDLL | None = None


def build_libcuda_stub(directory: pathlib.Path | None = None) -> pathlib.Path:
    """Compile ``libcuda_stub.c`` into ``libcuda.so.1`` (gcc), in a temporary directory."""
    directory = directory or pathlib.Path(tempfile.mkdtemp(prefix="graphflow-libcuda-"))
    target = directory / "libcuda.so.1"
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(target),
                    str(HERE / "libcuda_stub.c")], check=True, capture_output=True, text=True)
    return target


def setup() -> None:
    """Make ``vllm.platforms.cuda`` importable and the current platform an H100 stand-in."""
    global _STUB
    if _STUB is not None:
        return
    # No GPU here: an empty CUDA_VISIBLE_DEVICES is vLLM's own "devices not visible yet"
    # case, in which it keeps Triton (and so model runner V2, its default on a GPU).
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    _STUB = ctypes.CDLL(str(build_libcuda_stub()), mode=ctypes.RTLD_GLOBAL)
    import vllm.platforms as platforms
    from vllm.platforms.cuda import NonNvmlCudaPlatform
    from vllm.platforms.interface import DeviceCapability

    class H100(NonNvmlCudaPlatform):
        """vLLM's CUDA platform, answering as one H100 per rank."""

        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(9, 0)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return "NVIDIA H100 80GB HBM3 (CPU stand-in)"

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return 80 << 30

        @classmethod
        def get_device_communicator_cls(cls) -> str:
            return "standins.GlooCudaCommunicator"

        @classmethod
        def graph_pool_handle(cls) -> Any:
            return GraphPool()

    platforms._current_platform = H100()


# -- torch.cuda on the CPU ------------------------------------------------------------------------
class GraphPool:
    """A graph memory pool handle (the CUDA one is a pair of ints)."""

    def __repr__(self) -> str:
        return f"GraphPool({id(self):#x})"


class Stream:
    def __init__(self, device: Any = None, priority: int = 0):
        self.device = device

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class Graph:
    """A captured graph: the CPU ran the body at capture; replay counts calls."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.replays = 0
        self.reset_called = False

    def replay(self) -> None:
        self.replays += 1

    def reset(self) -> None:
        self.reset_called = True


class CpuCuda:
    """``torch.cuda``'s streams, capture state and graphs, and ``torch.accelerator``, on a CPU.

    ``captures`` counts graph captures; ``fail`` (an exception) is raised by the next
    capture's body entry when set, as a CUDA capture error would be.
    """

    def __init__(self) -> None:
        self._tls = threading.local()
        self.default = Stream()
        self.captures = 0

    def current_stream(self, device: Any = None) -> Stream:
        return getattr(self._tls, "stream", None) or self.default

    def set_stream(self, stream: Stream) -> None:
        from vllm.utils import torch_utils

        self._tls.stream = stream
        torch_utils._current_stream_tls.value = stream

    def is_current_stream_capturing(self) -> bool:
        return bool(getattr(self._tls, "capturing", False))

    @contextlib.contextmanager
    def stream(self, stream: Stream | None) -> Iterator[None]:
        if stream is None:
            yield
            return
        before = self.current_stream()
        self.set_stream(stream)
        try:
            yield
        finally:
            self.set_stream(before)

    @contextlib.contextmanager
    def graph(self, cuda_graph: Any, pool: Any = None, stream: Any = None, capture_error_mode: str = "global",
              **kwargs: Any) -> Iterator[None]:
        self.captures += 1
        with self.stream(stream or Stream()):
            self._tls.capturing = True
            try:
                yield
            finally:
                self._tls.capturing = False

    @contextlib.contextmanager
    def installed(self) -> Iterator[CpuCuda]:
        import torch

        replacements = {
            (torch.cuda, "Stream"): Stream, (torch.cuda, "current_stream"): self.current_stream,
            (torch.cuda, "set_stream"): self.set_stream, (torch.cuda, "stream"): self.stream,
            (torch.cuda, "is_current_stream_capturing"): self.is_current_stream_capturing,
            (torch.cuda, "graph"): self.graph, (torch.cuda, "CUDAGraph"): Graph,
            (torch.cuda, "graph_pool_handle"): GraphPool, (torch.cuda, "synchronize"): lambda *a, **k: None,
            (torch.accelerator, "synchronize"): lambda *a, **k: None,
            (torch.accelerator, "empty_cache"): lambda *a, **k: None,
            (torch.accelerator, "get_memory_info"): lambda *a, **k: (40 << 30, 80 << 30),
        }
        with contextlib.ExitStack() as stack:
            for (owner, name), value in replacements.items():
                stack.enter_context(mock.patch.object(owner, name, value))
            from vllm.compilation import cuda_graph
            from vllm.utils import torch_utils

            stack.enter_context(mock.patch.object(torch_utils._current_stream_tls, "value", self.default,
                                                  create=True))
            # A weak reference to a graph's output is a CUDA kernel; on the CPU the output itself.
            stack.enter_context(mock.patch.object(cuda_graph, "weak_ref_tensors", lambda tensors: tensors))
            yield self


# -- the freed-block reuse of the CUDA caching allocator -----------------------------------------
class FreedBlocks:
    """``torch.empty_like`` served from released blocks of the same shape, newest first.

    On a GPU the caching allocator hands a new tensor the block a same-sized tensor just
    freed, with its contents: what makes vLLM's placeholder rank-local garbage.
    """

    def __init__(self) -> None:
        self._blocks: dict[tuple, list] = {}

    def release(self, tensor: Any) -> None:
        self._blocks.setdefault((tuple(tensor.shape), tensor.dtype), []).append(tensor)

    @contextlib.contextmanager
    def installed(self) -> Iterator[FreedBlocks]:
        import torch
        from torch.overrides import TorchFunctionMode

        blocks = self._blocks

        class Reuse(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func is torch.empty_like and args:
                    free = blocks.get((tuple(args[0].shape), args[0].dtype))
                    if free:
                        return free.pop()
                return func(*args, **(kwargs or {}))

        with Reuse():
            yield self


# -- a prepare hook (GRAPHFLOW_VLLM_PREPARE=standins:prepare_hook) --------------------------------
PREPARED: list[tuple[list[int], str]] = []


def prepare_hook(communicator: Any, tensor: Any) -> None:
    """Records what the ``prepare`` policy asked to prewarm, as a JIT all-reduce would compile it."""
    PREPARED.append((list(tensor.shape), str(tensor.dtype)))


# -- the custom all-reduce and its communicator, over gloo ---------------------------------------
@functools.cache
def _custom_allreduce_cls():
    import torch
    import torch.distributed as dist
    from vllm.distributed.device_communicators.custom_all_reduce import CustomAllreduce

    class GlooCustomAllreduce(CustomAllreduce):
        """vLLM's custom all-reduce with its IPC kernel replaced by a sum over gloo."""

        def __init__(self, group: Any, device: Any, max_size: int = 8 << 20):
            self.group = group
            self.device = device
            self.rank = dist.get_rank(group=group)
            self.world_size = dist.get_world_size(group=group)
            self.disabled = False
            self.fully_connected = True
            self.batch_invariant = False
            self.max_size = max_size
            self._IS_CAPTURING = False
            self._capture_registered = True
            self._ptr = 0
            self.buffer_ptrs = [0] * self.world_size
            self.captured_calls = 0
            self.registered: list = []

        def _all_reduce_chunk(self, inp: torch.Tensor, out: torch.Tensor, registered: bool) -> None:
            if torch.cuda.is_current_stream_capturing():
                self.captured_calls += 1  # recorded into the graph; runs at replay
                return
            out.copy_(inp)
            dist.all_reduce(out, group=self.group)

        def register_graph_buffers(self) -> None:
            # vLLM's collective, with stand-in IPC handles (the captured call count) for
            # ops.get_graph_buffer_ipc_meta / ops.register_graph_buffers.
            all_data = [[None, None] for _ in range(self.world_size)]
            all_data[self.rank] = [[self.rank], [self.captured_calls]]
            for i, rank in enumerate(sorted(dist.get_process_group_ranks(group=self.group))):
                dist.broadcast_object_list(all_data[i], src=rank, group=self.group, device="cpu")
            self.registered.append(all_data)

    return GlooCustomAllreduce


def __getattr__(name: str) -> Any:
    # The classes subclass vLLM's, so they are made on first use, after setup().
    if name == "GlooCustomAllreduce":
        return _custom_allreduce_cls()
    if name == "GlooCudaCommunicator":
        return _communicator_cls()
    raise AttributeError(name)


@functools.cache
def _communicator_cls():
    from vllm.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

    class GlooCudaCommunicator(CudaCommunicator):
        """vLLM's CUDA communicator whose only backend is the gloo custom all-reduce.

        ``all_reduce`` is vLLM's: it walks the backend order and reaches the custom
        all-reduce, as on a GPU without symmetric memory, quick-reduce or FlashInfer.
        """

        def __init__(self, cpu_group, device=None, device_group=None, unique_name="", use_all2all=False,
                     **kwargs):
            DeviceCommunicatorBase.__init__(self, cpu_group, device, device_group, unique_name)
            for name in ("pynccl_comm", "qr_comm", "fi_ar_comm", "fi_pcie_ipc_ar_comm", "aiter_ar_comm",
                         "symm_mem_comm"):
                setattr(self, name, None)
            self.use_aiter_allreduce = False
            self.ca_comm = _custom_allreduce_cls()(cpu_group, device)

    return GlooCudaCommunicator
