"""The plan of a running vLLM engine, read off its resolved objects.

By the time a worker captures, vLLM has settled everything a config alone cannot tell:
the attention backends' FULL-graph support, the speculative rounding, LoRA cases,
micro-batching twins. Its capture descriptors are the truth; this module reads them:

* model runner V1: ``runner.cudagraph_dispatcher.get_capture_descs()`` (the target) and
  ``runner.drafter.cudagraph_dispatcher`` (the drafter), ``runner.encoder_cudagraph_manager``;
* model runner V2: ``runner.cudagraph_manager._capture_descs`` (the target), every
  ``CudaGraphManager`` the speculator holds (the drafter), the encoder runner's manager.
  Two of the speculator's lists are not what V2 captures, and are read as V2 will use
  them: with one speculative step it never captures the draft decode graphs
  (``capture`` returns after the prefill ones), and under dynamic speculative decoding
  (``num_speculative_tokens_per_batch_size``) with fused draft decodes its
  ``SpeculatorCudaGraphManager.capture`` rewrites the decode list while capturing, one
  graph per descriptor and draft width (every width the schedule picks, but 0 and 1).
  The target's list needs nothing: its manager lists each width's decode graphs when
  it is built.

No vLLM import: the objects are read by attribute, so the same code reads the real
engine and a test's.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import attrs

from graphflow.errors import PlanError
from graphflow.integrations.vllm.descriptors import VllmDescriptor, VllmPlan, capture_order, descriptor_from_vllm, \
    sizes_by_mode
from graphflow.integrations.vllm.schematic import FamilyFacts, family_facts, schematic_plan
from graphflow.plan import CaptureSettings, WarmupPolicy

__all__ = ["engine_descriptors", "graph_managers", "plan_from_engine", "runner_kind", "speculative_widths"]


def runner_kind(runner: Any) -> str:
    """``"v1"`` for ``vllm.v1.worker.gpu_model_runner.GPUModelRunner``, ``"v2"`` for
    ``vllm.v1.worker.gpu.model_runner.GPUModelRunner``."""
    if hasattr(runner, "cudagraph_dispatcher"):
        return "v1"
    if hasattr(runner, "cudagraph_manager"):
        return "v2"
    raise TypeError(f"{type(runner).__qualname__} is not a vLLM GPU model runner (it has neither a "
                    "cudagraph_dispatcher nor a cudagraph_manager)")


def engine_descriptors(runner: Any) -> tuple[VllmDescriptor, ...]:
    """Every graph ``runner`` will capture, all families, in capture order."""
    found: dict[VllmDescriptor, None] = {}
    for family, mode, desc, q, *width in _raw_descriptors(runner):
        found[descriptor_from_vllm(family, mode, desc, uniform_query_len=q,
                                   num_speculative_tokens=width[0] if width else None)] = None
    return capture_order(found)


def _raw_descriptors(runner: Any) -> Iterator[tuple]:
    """(family, mode, vLLM's descriptor, uniform query length[, draft width]) of each graph."""
    if runner_kind(runner) == "v1":
        yield from _v1_descriptors(runner)
        encoder = getattr(runner, "encoder_cudagraph_manager", None)
    else:
        for family, manager in graph_managers(runner):
            widths = _draft_widths(runner, manager)
            if widths == ():
                continue
            for mode, descs in getattr(manager, "_capture_descs", {}).items():
                for desc in descs:
                    if widths is None:
                        yield family, mode, desc, 1
                    else:
                        yield from ((family, mode, desc, 1, k) for k in widths)
        encoder_runner = getattr(getattr(runner, "model_state", None), "encoder_runner", None)
        encoder = getattr(encoder_runner, "cudagraph_manager", None)
    if encoder is not None:
        for budgets in getattr(encoder, "path_token_budgets", {"default": getattr(encoder, "token_budgets", [])}).values():
            for budget in budgets:
                if budget:
                    yield "encoder", "FULL", _Budget(int(budget)), 1


def _v1_descriptors(runner: Any) -> Iterator[tuple[str, Any, Any, int]]:
    """The target's and the drafter's keys that V1 really captures, not all its dispatchers list.

    Under stock ``torch.compile`` V1's ``load_model`` returns before wrapping the model in
    a ``CUDAGraphWrapper``, so its dispatcher's keys capture nothing. The drafter has no
    capture loop of its own: ``_dummy_run`` runs it with graphs only inside the target's
    PIECEWISE captures, padded by the drafter's dispatcher, so under FULL (no PIECEWISE
    target graphs) the drafter's PIECEWISE keys capture nothing either.
    """
    if _name(getattr(runner.vllm_config.compilation_config, "mode", None)) in ("STOCK_TORCH_COMPILE", "1"):
        return
    target = runner.cudagraph_dispatcher
    q = getattr(target, "uniform_decode_query_len", 1)
    piecewise: set[int] = set()
    for mode, descs in target.get_capture_descs():
        for desc in descs:
            if _name(mode) == "PIECEWISE":
                piecewise.add(int(desc.num_tokens))
            yield "target", mode, desc, q
    drafter = getattr(getattr(runner, "drafter", None), "cudagraph_dispatcher", None)
    if drafter is None or not piecewise:
        return
    q = getattr(drafter, "uniform_decode_query_len", 1)
    captured = {_padded(drafter, size) for size in piecewise}
    for mode, descs in drafter.get_capture_descs():
        for desc in descs:
            if int(desc.num_tokens) in captured:
                yield "drafter", mode, desc, q


def _draft_widths(runner: Any, manager: Any) -> tuple[int, ...] | None:
    """How V2 captures ``manager``'s list: None as listed, ``()`` not at all, else once per
    draft width in the tuple (``SpeculatorCudaGraphManager.capture(specialize_spec_tokens=True)``)."""
    speculator = getattr(runner, "speculator", None)
    if speculator is None or manager is not getattr(speculator, "decode_cudagraph_manager", None):
        return None
    if getattr(speculator, "num_speculative_steps", None) == 1:
        return ()
    spec = getattr(runner.vllm_config, "speculative_config", None)
    schedule = getattr(spec, "num_speculative_tokens_per_batch_size", None)
    if schedule is None or not getattr(speculator, "supports_decode_metadata_update", False):
        return None
    return speculative_widths(schedule, int(manager.max_num_reqs), int(runner.vllm_config.num_speculative_tokens))


def speculative_widths(schedule: Any, max_num_seqs: int, num_speculative_tokens: int) -> tuple[int, ...]:
    """The draft widths V2 captures decode graphs for, widest first: every width
    ``build_dynamic_sd_schedule_lookup`` gives a batch size up to ``max_num_seqs``, each
    capped at ``num_speculative_tokens``, but 0 and 1. ``schedule`` is vLLM's
    ``num_speculative_tokens_per_batch_size``: ``(first, last, width)`` ranges of batch
    sizes, the first starting at 1; a range starting past ``max_num_seqs`` is never reached.
    """
    reached = {min(num_speculative_tokens, int(k)) for first, _, k in schedule if int(first) <= max_num_seqs}
    return tuple(sorted(reached - {0, 1}, reverse=True))


def _padded(dispatcher: Any, num_tokens: int) -> int:
    """The token count ``dispatcher`` runs ``num_tokens`` at, as the drafter's ``dummy_run`` asks it."""
    return int(dispatcher.dispatch(num_tokens)[1].num_tokens)


def _name(value: Any) -> str:
    return str(getattr(value, "name", value)).upper()


@attrs.frozen
class _Budget:
    """An encoder graph's key: its token budget (the encoder captures one FULL graph per budget)."""

    num_tokens: int


def graph_managers(runner: Any) -> Iterator[tuple[str, Any]]:
    """V2's ``CudaGraphManager``s: the runner's (target), then the speculator's (drafter)."""
    if runner.cudagraph_manager is not None:
        yield "target", runner.cudagraph_manager
    speculator = getattr(runner, "speculator", None)
    if speculator is not None:
        for value in vars(speculator).values():
            if hasattr(value, "_capture_descs") and hasattr(value, "graphs"):
                yield "drafter", value


def plan_from_engine(
    runner: Any,
    *,
    warmup: Mapping[str, WarmupPolicy] | None = None,
    data_dependent: Mapping[str, bool] | None = None,
    barrier_timeout_s: float = 60.0,
) -> VllmPlan:
    """The plan of what ``runner`` (a vLLM GPU model runner, V1 or V2) will capture.

    Families and their facts come from the post-init ``VllmConfig`` (the target's and
    the drafter's Hugging Face configs, the TP size), the descriptors from the runner's
    own dispatcher or managers. ``warmup`` gives each family's custom all-reduce warmup
    policy (default ``placeholder``, vLLM's). ``data_dependent`` overrides, per family,
    whether its MLPs route tokens by value (default: read off the HF config's expert
    count).
    """
    config = runner.vllm_config
    descriptors = engine_descriptors(runner)
    families = list(_families(config, descriptors))
    overrides = dict(data_dependent or {})
    families = [attrs.evolve(f, routed_layers=range(f.layers) if overrides[f.name] else ())
                if f.name in overrides else f for f in families]
    sizes = sizes_by_mode(descriptors)
    warmups = max(int(getattr(config.compilation_config, "cudagraph_num_of_warmups", 1) or 0), 0)
    if sizes and warmups < 1:
        raise PlanError("vLLM would capture with no warmup run before each graph "
                        "(compilation_config.cudagraph_num_of_warmups = 0): lazy initialization and JIT kernels "
                        "would first run inside capture — set cudagraph_num_of_warmups to 1 or more",
                        element="compilation_config.cudagraph_num_of_warmups")
    capture = CaptureSettings(modes=tuple(sizes), sizes=(), mode_sizes=sizes, warmup_iters=warmups,
                              barrier_timeout_s=barrier_timeout_s) if sizes else \
        CaptureSettings(modes=(), sizes=(), barrier_timeout_s=barrier_timeout_s)
    device = getattr(runner, "device", None)
    index = getattr(device, "index", None) or 0
    plan = schematic_plan(_model_name(config), families, tp_size=config.parallel_config.tensor_parallel_size,
                          device=f"cuda:{index}", warmup=warmup, capture=capture)
    mode = getattr(config.compilation_config.cudagraph_mode, "name", str(config.compilation_config.cudagraph_mode))
    return VllmPlan(plan, descriptors, mode, runner_kind(runner), 1 + int(getattr(config, "num_speculative_tokens", 0)))


def _families(config: Any, descriptors: tuple[VllmDescriptor, ...]) -> Iterator[FamilyFacts]:
    present = {d.family for d in descriptors} | {"target"}
    model = config.model_config
    dtype = getattr(model, "dtype", None)
    yield family_facts("target", getattr(model, "hf_text_config", None) or model.hf_config, dtype=dtype)
    draft = getattr(getattr(config, "speculative_config", None), "draft_model_config", None)
    if "drafter" in present and draft is not None:
        yield family_facts("drafter", getattr(draft, "hf_text_config", None) or draft.hf_config, dtype=dtype)
    elif "drafter" in present:
        yield FamilyFacts("drafter", 1, _hidden(model))
    if "encoder" in present:
        vision = getattr(model.hf_config, "vision_config", None)
        yield family_facts("encoder", vision, dtype=dtype) if vision is not None else \
            FamilyFacts("encoder", 1, _hidden(model))


def _hidden(model: Any) -> int:
    config = getattr(model, "hf_text_config", None) or model.hf_config
    return int(getattr(config, "hidden_size", 1) or 1)


def _model_name(config: Any) -> str:
    model = str(getattr(config.model_config, "served_model_name", None) or config.model_config.model)
    return f"vllm:{model.rstrip('/').rsplit('/', 1)[-1]}"

