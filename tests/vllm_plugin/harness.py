"""A vLLM V1 model runner whose GPU work is a tiny CPU model, for the real capture code.

``StandInRunner`` subclasses vLLM's ``GPUModelRunner`` and keeps its ``capture_model``,
``_capture_cudagraphs``, ``_warmup_and_capture``, ``_check_and_update_cudagraph_mode``
and its real ``CudagraphDispatcher``; it replaces what needs a GPU: ``__init__`` (no
model loading, KV cache or attention metadata) and ``_dummy_run`` (dispatch, forward
context and the model through vLLM's ``CUDAGraphWrapper``s, nothing else). Its capture
fails at a chosen descriptor when asked, inside the graph capture, as a CUDA error would.

``TinyMoE`` is a decode step with tensor parallelism: per layer an attention-like
projection whose partial sums are all-reduced, then top-1 routing over experts, then the
experts' outputs all-reduced. In eager runs (the warmup) it loops over the experts that
received tokens, one all-reduce each: which and how large depend on the routing, as
data-dependent kernel selection does in real MoE code; while the stream captures it takes
the static path (every expert, masked, one all-reduce). All-reduces go through vLLM's TP
``GroupCoordinator``.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

HIDDEN = 64
EXPERTS = 4


def engine_config(model: str = "llama-tiny", **kwargs: Any):
    """A post-init ``VllmConfig`` from a local tiny HF config (no download, no weights)."""
    from vllm.engine.arg_utils import EngineArgs

    from standins import TINY_MODELS

    return EngineArgs(model=str(TINY_MODELS / model), skip_tokenizer_init=True, **kwargs).create_engine_config()


def init_distributed(config, *, rank: int = 0, world: int = 1, port: int, tp: int = 1) -> None:
    """vLLM's own distributed initialization, over gloo on 127.0.0.1."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    ps.init_distributed_environment(world_size=world, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                    local_rank=rank, backend="gloo")
    with set_current_vllm_config(config):
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    ps.get_tp_group().use_custom_op_call = False  # the custom op is registered for CUDA tensors only


class _Backend:
    """An attention backend as ``_check_and_update_cudagraph_mode`` reads it."""

    support = None

    @classmethod
    def get_builder_cls(cls):
        return cls

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
        return cls.support


def attention_backend(support: str = "ALWAYS") -> type:
    from vllm.v1.attention.backend import AttentionCGSupport

    return type(f"StandIn{support.title().replace('_', '')}Backend", (_Backend,),
                {"support": AttentionCGSupport[support]})


class TinyMoE(nn.Module):
    """The decode step described in the module docstring; ``fail`` raises inside capture."""

    def __init__(self, *, layers: int = 2, rank: int = 0, world: int = 1, freed: Any = None):
        super().__init__()
        self.layers, self.world, self.freed = layers, world, freed
        self.fail: BaseException | None = None
        shard = torch.Generator().manual_seed(1000 + rank)
        shared = torch.Generator().manual_seed(7)
        self.attn = [torch.randn(HIDDEN, HIDDEN, generator=shard) / HIDDEN for _ in range(layers)]
        self.router = [torch.randn(HIDDEN, EXPERTS, generator=shared) for _ in range(layers)]
        self.experts = [[torch.randn(HIDDEN, HIDDEN, generator=shard) / HIDDEN for _ in range(EXPERTS)]
                        for _ in range(layers)]
        self.routes: list[list[int]] = []

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        from vllm.distributed import get_tp_group

        return get_tp_group().all_reduce(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        capturing = torch.cuda.is_current_stream_capturing()
        if self.fail is not None and capturing:
            raise self.fail
        for i in range(self.layers):
            partial = x @ self.attn[i]
            if self.freed is not None:
                self.freed.release(partial.clone())  # the block the next same-sized allocation reuses
            h = self._all_reduce(partial)
            route = (h @ self.router[i]).argmax(-1)
            out = torch.zeros_like(h)
            if capturing:
                for e in range(EXPERTS):
                    out += (route == e).unsqueeze(-1) * (h @ self.experts[i][e])
                out = self._all_reduce(out)
            else:
                self.routes.append(route.tolist())
                for e in range(EXPERTS):
                    rows = (route == e).nonzero().flatten()
                    if rows.numel():
                        out[rows] = self._all_reduce(h[rows] @ self.experts[i][e])
            x = x + out
        return x


class _Piece(nn.Module):
    """The part of the step a PIECEWISE graph holds (here: all of it, in one piece)."""

    def __init__(self, model: TinyMoE):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


def standin_runner_cls():
    from vllm.compilation.cuda_graph import CUDAGraphWrapper
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import set_forward_context
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.workspace import init_workspace_manager

    class StandInRunner(GPUModelRunner):
        """vLLM's V1 runner with its GPU work replaced (see the module docstring)."""

        def __init__(self, vllm_config, *, model: TinyMoE, attention: str = "ALWAYS"):
            self.vllm_config = vllm_config
            self.compilation_config = vllm_config.compilation_config
            self.parallel_config = vllm_config.parallel_config
            self.scheduler_config = vllm_config.scheduler_config
            self.speculative_config = vllm_config.speculative_config
            self.load_config = vllm_config.load_config
            self.lora_config = None
            self.device = torch.device("cuda:0")
            self.max_num_reqs = vllm_config.scheduler_config.max_num_seqs
            self.uniform_decode_query_len = vllm_config.uniform_decode_query_len
            self.kv_cache_config = None
            self.encoder_cudagraph_manager = None
            self.supports_mm_inputs = False
            self.cudagraph_dispatcher = CudagraphDispatcher(vllm_config)
            self.tiny = model
            self.piecewise = CUDAGraphWrapper(_Piece(model), vllm_config, CUDAGraphMode.PIECEWISE)
            self.full = CUDAGraphWrapper(self.piecewise, vllm_config, CUDAGraphMode.FULL)
            self.inputs = torch.randn(vllm_config.scheduler_config.max_num_batched_tokens, HIDDEN,
                                      generator=torch.Generator().manual_seed(3))
            self.fail_at: tuple[str, int] | None = None
            self.runs: list[tuple[str, Any]] = []
            init_workspace_manager(torch.device("cpu"))  # vLLM's runner makes it on its device
            self._check_and_update_cudagraph_mode([{attention_backend(attention)}],
                                                  [types.SimpleNamespace(kv_cache_spec=None)])

        def _create_encoder_cudagraph_manager(self):
            return None

        def _dummy_run(self, num_tokens, cudagraph_runtime_mode=None, force_attention=False,
                       uniform_decode=False, is_graph_capturing=False, **kwargs):
            valid = None if cudagraph_runtime_mode is None else {cudagraph_runtime_mode}
            mode, desc = self.cudagraph_dispatcher.dispatch(num_tokens, uniform_decode=uniform_decode,
                                                            valid_modes=valid)
            self.runs.append((mode.name, desc))
            failing = is_graph_capturing and self.fail_at == (mode.name, desc.num_tokens)
            self.tiny.fail = RuntimeError("CUDA error: operation not permitted when stream is capturing "
                                          "(stand-in capture failure)") if failing else None
            with set_forward_context(None, self.vllm_config, num_tokens=desc.num_tokens,
                                     cudagraph_runtime_mode=mode, batch_descriptor=desc):
                return self.full(self.inputs[:desc.num_tokens])

        def serve(self, num_tokens: int, uniform_decode: bool = True):
            """One serving step's dispatch and forward: (mode, descriptor, output)."""
            mode, desc = self.cudagraph_dispatcher.dispatch(num_tokens, uniform_decode=uniform_decode)
            with set_forward_context(None, self.vllm_config, num_tokens=desc.num_tokens,
                                     cudagraph_runtime_mode=mode, batch_descriptor=desc):
                return mode, desc, self.full(self.inputs[:desc.num_tokens])

    return StandInRunner


def standin_v2_runner_cls():
    """vLLM's model runner V2 with its GPU work replaced.

    Its ``capture_model`` is vLLM's, and so is the capture loop of its graph manager
    (``CudaGraphManager.capture``: warmup, then PIECEWISE through the wrappers or FULL in
    ``torch.cuda.graph``, the ``graphs`` dict, the counters); what the manager's model
    subclass prepares on the GPU (inputs, attention metadata) is replaced by running
    ``TinyMoE`` in vLLM's forward context.
    """
    from vllm.compilation.cuda_graph import CUDAGraphWrapper
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor, set_forward_context
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.worker.gpu import cudagraph_utils
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.workspace import init_workspace_manager

    class StandInModelCudaGraphManager(cudagraph_utils.CudaGraphManager):
        def capture(self, model, *args, **kwargs):
            runner = model

            def create_forward_fn(desc, warmup):
                def forward(cg_mode):
                    failing = runner.fail_at == (desc.cg_mode.name, desc.num_tokens) and not warmup or (
                        runner.fail_at == (desc.cg_mode.name, desc.num_tokens) and cg_mode == CUDAGraphMode.PIECEWISE)
                    runner.tiny.fail = RuntimeError("CUDA error: out of memory (stand-in capture failure)") \
                        if failing else None
                    runner.runs.append((cg_mode.name, desc))
                    batch = BatchDescriptor(num_tokens=desc.num_tokens) if cg_mode == CUDAGraphMode.PIECEWISE else None
                    with set_forward_context(None, runner.vllm_config, num_tokens=desc.num_tokens,
                                             cudagraph_runtime_mode=cg_mode, batch_descriptor=batch):
                        if cg_mode == CUDAGraphMode.PIECEWISE:
                            return runner.piecewise(runner.inputs[:desc.num_tokens])
                        return runner.tiny(runner.inputs[:desc.num_tokens])

                return forward

            super().capture(create_forward_fn)

    class StandInV2Runner(GPUModelRunner):
        def __init__(self, vllm_config, *, model: TinyMoE):
            self.vllm_config = vllm_config
            self.compilation_config = vllm_config.compilation_config
            self.lora_config = None
            self.device = torch.device("cuda:0")
            self.model_state = types.SimpleNamespace(supports_mm_inputs=False,
                                                     capture_inner_cudagraphs=lambda *a, **k: None)
            self.pcp_manager = None
            self.input_buffers = self.intermediate_tensors = self.block_tables = None
            self.attn_groups, self.kv_cache_config = [], None
            self.use_aux_hidden_state_outputs = False
            self.speculator = self.adaptive_verification = None
            self.kv_connector = types.SimpleNamespace(reset_capture_state=lambda: None)
            self.tiny = model
            self.piecewise = CUDAGraphWrapper(_Piece(model), vllm_config, CUDAGraphMode.PIECEWISE)
            self.inputs = torch.randn(vllm_config.scheduler_config.max_num_batched_tokens, HIDDEN,
                                      generator=torch.Generator().manual_seed(3))
            self.fail_at: tuple[str, int] | None = None
            self.runs: list = []
            init_workspace_manager(torch.device("cpu"))
            q = vllm_config.uniform_decode_query_len
            mode = vllm_config.compilation_config.resolve_cudagraph_mode_and_sizes(
                AttentionCGSupport.ALWAYS, "StandIn", q, use_v2_model_runner=True)
            self.cudagraph_manager = StandInModelCudaGraphManager(vllm_config, self.device, mode, q)

        @property
        def model(self):
            return self

    return StandInV2Runner
