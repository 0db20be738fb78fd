"""What vLLM will capture, predicted from its config, without vLLM.

``plan_from_vllm_config`` applies the rules vLLM 0.33 applies, in its order:

1. **Mode.** ``enforce_eager`` captures nothing; an unset ``cudagraph_mode`` follows the
   optimization level (``-O0`` NONE, ``-O1`` PIECEWISE, ``-O2``/``-O3``, the default,
   FULL_AND_PIECEWISE); a compilation mode other than VLLM_COMPILE drops the piecewise
   half (FULL_AND_PIECEWISE becomes FULL_DECODE_ONLY); pooling models capture PIECEWISE
   instead of FULL, encoder-decoder models FULL_DECODE_ONLY. Stock ``torch.compile``
   (compilation mode 1, STOCK_TORCH_COMPILE) captures nothing on either runner: V2's
   post-init sets NONE (``_disable_cudagraphs_for_v2_stock_torch_compile``), and V1's
   ``load_model`` compiles the model and returns before wrapping it in a
   ``CUDAGraphWrapper``, so the FULL keys its dispatcher still lists capture no graph.
2. **Sizes** (``VllmConfig._set_cudagraph_sizes``): without explicit sizes, ``[1, 2, 4]``,
   multiples of 8 below 256, multiples of 16 from 256, up to ``min(max_num_seqs * q * 2,
   512)`` (1024 on Blackwell), ``q = 1 + speculative tokens``; then ``max_num_seqs``
   when there is no speculation, the uniform-decode sizes ``n * q`` with speculation,
   and ``max_num_batched_tokens`` when it fits; ``performance_mode="interactivity"``
   captures every size 1..32. Everything is cut at ``max_num_batched_tokens``.
3. **Attention support**, known only once the engine has picked its attention backends:
   a backend that supports FULL graphs for uniform batches only turns FULL into
   FULL_AND_PIECEWISE, one that supports none drops FULL. This function applies it when
   told (``attention_support``); otherwise it assumes full support and says so.
4. **Speculative rounding**: model runner V1 with FULL decode graphs and ``q > 1``
   rounds every size up to a multiple of ``q``.
5. **Descriptors**: FULL decode graphs exist only for ``q <= tokens <= q * max_num_seqs``
   (V2 rounds each size up to a multiple of ``q`` instead of dropping it), so PIECEWISE and
   FULL capture different sizes. With the default FULL_AND_PIECEWISE at 256 sequences:
   51 PIECEWISE and 35 FULL graphs.

6. **The drafter** (``speculative_method``): V1 runs every model-running drafter with
   graphs only inside the target's PIECEWISE captures, PIECEWISE at the same sizes; V2's
   EAGLE speculator captures its draft prefill as the target (mode, sizes, query length)
   and, with more than one step and FULL target decode graphs, its draft decodes FULL at
   query length 1; V2's draft-model and hidden-state speculators, and proposers that run
   no model, capture none.

A post-init ``VllmConfig`` has applied rules 1 and 2 already (all but V1's stock
``torch.compile``, which this function applies to it); only 3 to 6 are left.
A drafter vLLM picks from the draft model's config (V2's MTP and DFlash variants) or from
code it loads (a custom proposer) is not predicted. Dynamic speculative decoding
(``num_speculative_tokens_per_batch_size``) is not modelled either: V2 lists the
target's decode graphs once per draft width, and its drafter's ``capture`` rewrites the
decode list while capturing, once per width. Those, and run-time downgrades this function cannot see,
are listed in ``VllmPlan.unknowns``;
``graphflow.integrations.vllm.plan_from_engine`` reads what a running engine resolved.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from graphflow.errors import PlanError
from graphflow.integrations.vllm.descriptors import VllmDescriptor, VllmPlan, capture_order, sizes_by_mode
from graphflow.plan import Mode, Plan

__all__ = ["ATTENTION_SUPPORT", "VLLM_MODES", "plan_from_vllm_config"]

#: vLLM's ``CUDAGraphMode`` names: (decode mode, mixed-batch mode) of each.
_ROUTINES: Mapping[str, tuple[str, str]] = {
    "NONE": ("NONE", "NONE"),
    "PIECEWISE": ("PIECEWISE", "PIECEWISE"),
    "FULL": ("FULL", "FULL"),
    "FULL_DECODE_ONLY": ("FULL", "NONE"),
    "FULL_AND_PIECEWISE": ("FULL", "PIECEWISE"),
}
_SEPARATE = frozenset({"FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"})

#: The graphflow modes each vLLM mode captures, in capture order.
VLLM_MODES: Mapping[str, tuple[Mode, ...]] = {
    name: tuple(Mode(m) for m in dict.fromkeys((mixed, decode)) if m != "NONE")
    for name, (decode, mixed) in _ROUTINES.items()
}

#: vLLM's ``AttentionCGSupport``, weakest first (the attention backends' FULL-graph support).
ATTENTION_SUPPORT = ("NEVER", "UNIFORM_SINGLE_TOKEN_DECODE", "UNIFORM_BATCH", "ALWAYS")

_OPTIMIZATION_MODES = {0: "NONE", 1: "PIECEWISE", 2: "FULL_AND_PIECEWISE", 3: "FULL_AND_PIECEWISE"}
_COMPILATION_MODES = {0: "NONE", 1: "STOCK_TORCH_COMPILE", 2: "DYNAMO_TRACE_ONCE", 3: "VLLM_COMPILE"}
_ASSUMED_SUPPORT = ("attention backends' FULL-graph support: assumed ALWAYS (FA3, FlashInfer); a backend "
                    "with less turns FULL into FULL_AND_PIECEWISE or drops it at run time (pass attention_support)")
_RUNTIME_UNKNOWNS = (
    "LoRA, micro-batching (DBO), KV connectors that need PIECEWISE and "
    "models without a compiled or breakable piecewise path change the graphs at run time",
)
#: ``speculative_config.method``s whose proposer runs no model, so captures no drafter graph.
_MODEL_FREE_METHODS = frozenset({"ngram", "ngram_gpu", "suffix"})
#: Model runner V1: the methods whose drafter ``GPUModelRunner._dummy_run`` runs with graphs
#: inside the target's PIECEWISE captures (``use_eagle``, ``uses_draft_model``,
#: ``uses_extract_hidden_states``), keyed PIECEWISE at the target's sizes by the drafter's
#: ``initialize_cudagraph_keys``. MTP model types (``deepseek_mtp``...) are read as ``mtp``.
_V1_GRAPH_DRAFTERS = frozenset({"eagle", "eagle3", "mtp", "dflash", "dspark", "draft_model", "extract_hidden_states"})
#: Model runner V2 (``init_speculator``): EAGLE's ``EagleSpeculator`` keeps the managers
#: ``TargetDependentARSpeculator.init_cudagraph_manager`` makes: the draft prefill's, of the
#: target's mode, sizes and query length, and the draft decodes', FULL at query length 1
#: when the target's decode graphs are FULL, captured only with more than one step.
_V2_EAGLE = frozenset({"eagle", "eagle3"})
#: V2 speculators that capture no graph (their ``init_cudagraph_manager`` makes none).
_V2_NO_GRAPHS = frozenset({"draft_model", "extract_hidden_states"})
#: Why a drafter's graphs cannot be predicted from the settings, per method (V2, and V1's custom class).
_UNKNOWN = {
    "mtp": "vLLM picks the MTP drafter (one module, several modules, Gemma 4's) from the draft model's config",
    "dflash": "vLLM picks the DFlash drafter (DFlash, DFlash2, XPress, LiLiCorr) from the draft model's architectures",
    "dspark": "DSpark's drafter keeps graph managers of its own, not modelled here",
    "custom_class": "a custom proposer class captures what it chooses",
}


def plan_from_vllm_config(
    config: Any,
    *,
    model_plan: Plan,
    runner: str | None = None,
    attention_support: str | None = None,
    **inputs: Any,
) -> VllmPlan:
    """What vLLM will capture for ``config``: ``model_plan`` with vLLM's modes and sizes.

    ``config`` is a post-init ``VllmConfig``, a ``CompilationConfig`` or a mapping of
    vLLM's settings; keyword ``inputs`` add to or override it. The keys (vLLM's names):
    ``cudagraph_mode``, ``cudagraph_capture_sizes``, ``max_cudagraph_capture_size``,
    ``optimization_level`` (0-3), ``compilation_mode`` (``VLLM_COMPILE``...),
    ``enforce_eager``, ``max_num_seqs``, ``max_num_batched_tokens``,
    ``num_speculative_tokens``, ``speculative_method`` (``eagle``, ``ngram``...),
    ``num_speculative_tokens_per_batch_size`` (dynamic speculative decoding: named in
    ``unknowns``, not modelled), ``performance_mode``, ``pooling``,
    ``encoder_decoder``, ``device_capability`` (90 for Hopper; 100 raises the default
    maximum to 1024). ``runner`` is ``"v1"`` or ``"v2"`` (default: the config's, else
    V2, vLLM 0.33's default on a GPU). ``attention_support`` is one of
    ``ATTENTION_SUPPORT`` when known.

    The returned plan's ``capture`` gives each mode the target family's sizes; its
    ``descriptors`` are vLLM's full keys, the drafter's too where they follow from the
    settings. Raises PlanError for a config vLLM refuses.
    """
    settings = _Inputs.read(config, inputs)
    if runner is None:
        runner = settings.runner or "v2"
    if runner not in ("v1", "v2"):
        raise PlanError(f"unknown model runner {runner!r}: expected 'v1' or 'v2'", element="runner")
    unknowns = list(settings.unknowns)
    if attention_support is None:
        unknowns.append(_ASSUMED_SUPPORT)
        attention_support = "ALWAYS"
    elif str(attention_support).upper() not in ATTENTION_SUPPORT:
        raise PlanError(f"unknown attention_support {attention_support!r}: expected one of "
                        f"{', '.join(ATTENTION_SUPPORT)}", element="attention_support")
    unknowns.extend(_RUNTIME_UNKNOWNS)

    if settings.compilation_mode == "STOCK_TORCH_COMPILE":  # V1's post-init keeps the mode; its runner captures none
        mode, sizes = "NONE", ()
    else:
        mode, sizes = (settings.mode, settings.sizes) if settings.resolved else settings.resolve()
    mode = _resolve_at_run_time(mode, str(attention_support).upper(), settings)
    dynamic = bool(settings.speculative_schedule and settings.num_speculative_tokens and mode != "NONE")
    if dynamic:
        unknowns.append(_dynamic_unknown(settings))
    q = settings.q
    if mode != "NONE" and runner == "v1" and _ROUTINES[mode][0] == "FULL" and q > 1:
        sizes = _round_for_speculation(sizes, q)
    descriptors = _descriptors(mode, sizes, settings, runner)
    drafter, why = _drafter(mode, sizes, settings, runner, descriptors, dynamic)
    if why:
        unknowns.append(f"not predicted: drafter graphs ({settings.speculative_method or 'speculative decoding'} "
                        f"with {settings.num_speculative_tokens} speculative tokens), number unknown: {why}; "
                        "plan_from_engine reads them")
    descriptors = capture_order((*descriptors, *drafter))
    modes = sizes_by_mode(descriptors)
    capture = attrs.evolve(model_plan.capture, modes=tuple(modes), sizes=(), mode_sizes=modes) if modes else \
        attrs.evolve(model_plan.capture, modes=(), sizes=(), mode_sizes={})
    return VllmPlan(attrs.evolve(model_plan, capture=capture), descriptors, mode, runner, q, unknowns)


@attrs.frozen
class _Inputs:
    """vLLM's settings that decide capture, read from a config object or a mapping."""

    resolved: bool  # a post-init VllmConfig: mode and sizes are final
    mode: str | None
    sizes: tuple[int, ...] | None
    maximum: int | None
    optimization_level: int
    compilation_mode: str
    enforce_eager: bool
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    num_speculative_tokens: int
    speculative_method: str
    performance_mode: str
    pooling: bool
    encoder_decoder: bool
    device_capability: int
    runner: str | None
    speculative_schedule: tuple[tuple[int, int, int], ...] | None = None
    unknowns: tuple[str, ...] = ()

    @property
    def q(self) -> int:
        """Query tokens per request in a uniform decode step."""
        return 1 + self.num_speculative_tokens

    @classmethod
    def read(cls, config: Any, overrides: Mapping[str, Any]) -> _Inputs:
        if isinstance(config, Mapping):
            values = dict(config)
            resolved = False
        elif hasattr(config, "compilation_config") and hasattr(config, "scheduler_config"):
            values = _from_vllm_config(config)
            resolved = True
        else:
            values = {k: getattr(config, k) for k in ("cudagraph_mode", "cudagraph_capture_sizes",
                                                      "max_cudagraph_capture_size") if hasattr(config, k)}
            if hasattr(config, "mode") and getattr(config, "mode") is not None:
                values["compilation_mode"] = config.mode
            resolved = False
        values.update(overrides)
        unknown = set(values) - _KEYS
        if unknown:
            raise PlanError(f"unknown vLLM setting(s) {', '.join(sorted(unknown))}: expected some of "
                            f"{', '.join(sorted(_KEYS))}", element=sorted(unknown)[0])
        resolved = resolved and not ({"cudagraph_mode", "cudagraph_capture_sizes"} & set(overrides))
        sizes = values.get("cudagraph_capture_sizes")
        return cls(
            resolved=resolved,
            mode=_mode_name(values.get("cudagraph_mode")),
            sizes=None if sizes is None else () if resolved and not sizes else _size_list(sizes),
            maximum=_size(values.get("max_cudagraph_capture_size"), "max_cudagraph_capture_size", zero=resolved),
            optimization_level=_level(values.get("optimization_level", 2)),
            compilation_mode=_compilation_mode(values.get("compilation_mode")),
            enforce_eager=bool(values.get("enforce_eager", False)),
            max_num_seqs=_size(values.get("max_num_seqs"), "max_num_seqs"),
            max_num_batched_tokens=_size(values.get("max_num_batched_tokens"), "max_num_batched_tokens"),
            num_speculative_tokens=_count(values.get("num_speculative_tokens") or 0, "num_speculative_tokens"),
            speculative_method=str(values.get("speculative_method") or ""),
            performance_mode=str(values.get("performance_mode") or "balanced"),
            pooling=bool(values.get("pooling", False)),
            encoder_decoder=bool(values.get("encoder_decoder", False)),
            device_capability=int(values.get("device_capability", 90)),
            runner=values.get("runner"),
            speculative_schedule=_schedule(values.get("num_speculative_tokens_per_batch_size")),
            unknowns=() if values.get("max_num_batched_tokens") is not None or resolved else (
                "max_num_batched_tokens: not given, so no size is cut at it and none is appended",),
        )

    def resolve(self) -> tuple[str, tuple[int, ...]]:
        """Rules 1 and 2 of the module docstring: the mode and sizes after vLLM's post-init."""
        mode = self.mode or _OPTIMIZATION_MODES[self.optimization_level]
        compilation = self.compilation_mode or ("NONE" if self.optimization_level == 0 else "VLLM_COMPILE")
        if compilation != "VLLM_COMPILE" and _ROUTINES[mode][1] == "PIECEWISE":  # no piecewise split without it
            mode = {"PIECEWISE": "NONE", "FULL_AND_PIECEWISE": "FULL_DECODE_ONLY"}[mode]
        if self.pooling and mode in ("FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"):
            mode = "PIECEWISE"
        elif self.encoder_decoder and mode not in ("NONE", "FULL_DECODE_ONLY"):
            mode = "FULL_DECODE_ONLY"
        if self.enforce_eager or mode == "NONE":
            return "NONE", ()
        return mode, self._sizes()

    def _sizes(self) -> tuple[int, ...]:
        """``VllmConfig._set_cudagraph_sizes`` (without dynamic speculative decoding)."""
        maximum = self.maximum
        decode_sizes: list[int] = []
        if maximum is None and self.sizes is not None:
            maximum = max(self.sizes)  # explicit sizes: vLLM's maximum is their largest
        elif maximum is None:
            if self.max_num_seqs is None:
                raise PlanError("neither cudagraph_capture_sizes nor max_cudagraph_capture_size is set: give one, "
                                "or pass max_num_seqs so the maximum is derived as vLLM does",
                                element="cudagraph_capture_sizes")
            ceiling = 1024 if self.device_capability // 10 == 10 else 512
            maximum = min(self.max_num_seqs * self.q * 2, ceiling)
            if self.q > 1:
                decode_sizes = sorted({n * self.q for n in _request_counts(min(self.max_num_seqs, ceiling))
                                       if n * self.q <= maximum})
            elif self.max_num_seqs <= maximum:
                decode_sizes = [self.max_num_seqs]
        tokens = self.max_num_batched_tokens
        if tokens is not None:
            maximum = min(tokens, maximum)
        if self.sizes is not None:
            sizes = sorted(s for s in set(self.sizes) if tokens is None or s <= tokens)
        else:
            if self.performance_mode == "interactivity":
                sizes = list(range(1, min(maximum, 32) + 1))
            else:
                sizes = [s for s in (1, 2, 4) if s <= maximum]
            if maximum >= 8:
                sizes += range(8, min(maximum + 1, 256), 8)
            if maximum >= 256:
                sizes += range(256, maximum + 1, 16)
            if tokens is not None and tokens <= maximum and tokens not in sizes:
                sizes.append(tokens)
            sizes = sorted(set(sizes) | {s for s in decode_sizes if tokens is None or s <= tokens})
        if not sizes:
            raise PlanError(f"no capture size fits within {maximum} tokens", element="cudagraph_capture_sizes")
        if self.maximum is not None and self.sizes is not None and self.maximum != sizes[-1]:
            raise PlanError(f"max_cudagraph_capture_size ({self.maximum}) must equal the largest of "
                            f"cudagraph_capture_sizes ({sizes[-1]}), as vLLM requires",
                            element="max_cudagraph_capture_size")
        return tuple(sizes)


_KEYS = frozenset({
    "cudagraph_mode", "cudagraph_capture_sizes", "max_cudagraph_capture_size", "optimization_level",
    "compilation_mode", "enforce_eager", "max_num_seqs", "max_num_batched_tokens", "num_speculative_tokens",
    "speculative_method", "performance_mode", "pooling", "encoder_decoder", "device_capability", "runner",
    "num_speculative_tokens_per_batch_size",
})


def _from_vllm_config(config: Any) -> dict[str, Any]:
    """The settings of a post-init ``VllmConfig`` (mode and sizes already resolved)."""
    compilation = config.compilation_config
    scheduler = config.scheduler_config
    values: dict[str, Any] = {
        "cudagraph_mode": compilation.cudagraph_mode,
        "cudagraph_capture_sizes": list(compilation.cudagraph_capture_sizes or []),
        "max_cudagraph_capture_size": compilation.max_cudagraph_capture_size,
        "compilation_mode": compilation.mode,
        "max_num_seqs": scheduler.max_num_seqs,
        "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "num_speculative_tokens": getattr(config, "num_speculative_tokens", 0),
        "speculative_method": getattr(getattr(config, "speculative_config", None), "method", None),
        "num_speculative_tokens_per_batch_size": getattr(getattr(config, "speculative_config", None),
                                                         "num_speculative_tokens_per_batch_size", None),
    }
    use_v2 = getattr(config, "use_v2_model_runner", None)
    if use_v2 is not None:
        values["runner"] = "v2" if use_v2 else "v1"
    return values


def _resolve_at_run_time(mode: str, support: str, settings: _Inputs) -> str:
    """``CompilationConfig.resolve_cudagraph_mode_and_sizes``: the attention backends' say."""
    if mode == "NONE":
        return mode
    level = ATTENTION_SUPPORT.index(support)
    piecewise_ok = settings.compilation_mode in ("", "VLLM_COMPILE")
    decode, mixed = _ROUTINES[mode]
    if mixed == "FULL" and support != "ALWAYS":
        if support == "NEVER":
            raise PlanError(f"cudagraph_mode {mode} needs FULL graphs, which the attention backend does not support: "
                            "use PIECEWISE", element="cudagraph_mode")
        mode = "FULL_AND_PIECEWISE" if piecewise_ok else "FULL_DECODE_ONLY"
        decode, mixed = _ROUTINES[mode]
    if decode == "FULL" and support == "NEVER":
        mode = "PIECEWISE" if piecewise_ok else "NONE"
    elif decode == "FULL" and settings.q > 1 and level < ATTENTION_SUPPORT.index("UNIFORM_BATCH"):
        mode = "PIECEWISE" if piecewise_ok else "NONE"
    return mode


def _dynamic_unknown(settings: _Inputs) -> str:
    """What dynamic speculative decoding does to the graphs that this plan does not model."""
    widths = sorted({min(settings.num_speculative_tokens, k) for first, _, k in settings.speculative_schedule
                     if settings.max_num_seqs is None or first <= settings.max_num_seqs}, reverse=True)
    return ("not predicted: dynamic speculative decoding (num_speculative_tokens_per_batch_size, draft widths "
            f"{', '.join(map(str, widths))}): model runner V2 captures the target's FULL decode graphs once per "
            "width, and the drafter's decode graphs once per width but 0 and 1 while capturing; V1's post-init "
            "turns FULL into PIECEWISE; the graphs here are for the widest only, number unknown; "
            "plan_from_engine reads them")


def _schedule(value: Any) -> tuple[tuple[int, int, int], ...] | None:
    """vLLM's ``num_speculative_tokens_per_batch_size``: ``(first, last, width)`` batch-size ranges."""
    if value is None:
        return None
    try:
        ranges = tuple((int(a), int(b), int(k)) for a, b, k in value)
    except (TypeError, ValueError) as e:
        raise PlanError(f"expected a list of (first batch size, last batch size, draft width) ranges, got {value!r}",
                        element="num_speculative_tokens_per_batch_size") from e
    if not ranges:
        raise PlanError("expected at least one (first, last, width) range", element="num_speculative_tokens_per_batch_size")
    return ranges


def _round_for_speculation(sizes: Sequence[int], q: int) -> tuple[int, ...]:
    """``CompilationConfig.adjust_cudagraph_sizes_for_spec_decode`` (model runner V1)."""
    if not sizes:
        return ()
    maximum = max(sizes)
    rounded = sorted({-(-s // q) * q for s in sizes if -(-s // q) * q <= maximum})
    if not rounded and q <= maximum:
        rounded = [q]
    if not rounded:
        raise PlanError(f"no capture size is left after rounding to a multiple of {q} (num_speculative_tokens + 1): "
                        "lower num_speculative_tokens or raise max_cudagraph_capture_size",
                        element="cudagraph_capture_sizes")
    return tuple(rounded)


def _drafter(mode: str, sizes: Sequence[int], settings: _Inputs, runner: str, target: Sequence[VllmDescriptor],
             dynamic: bool) -> tuple[tuple[VllmDescriptor, ...], str | None]:
    """The drafter's graphs, or why they cannot be known from the settings (then none).

    V1 runs the drafter with graphs only inside the target's PIECEWISE captures
    (``GPUModelRunner._dummy_run``), at the drafter's key for each size: the same sizes. V2
    builds a speculator per method (``init_speculator``); EAGLE's graphs follow the
    settings, and some speculators capture none (``_V2_NO_GRAPHS``)."""
    method = settings.speculative_method
    method = "mtp" if method.endswith("mtp") else method
    if mode == "NONE" or not settings.num_speculative_tokens or method in _MODEL_FREE_METHODS:
        return (), None
    if dynamic:
        return (), "dynamic speculative decoding, above"
    if not method:
        return (), "the speculative method is not given"
    if runner == "v1":
        if method not in _V1_GRAPH_DRAFTERS:
            return (), _UNKNOWN.get(method, f"method {method!r} is not modelled")
        return tuple(attrs.evolve(d, family="drafter") for d in target if d.mode is Mode.PIECEWISE), None
    if method in _V2_NO_GRAPHS:
        return (), None
    if method not in _V2_EAGLE:
        return (), _UNKNOWN.get(method, f"method {method!r} is not modelled")
    prefill = _descriptors(mode, sizes, settings, runner, family="drafter")
    if settings.num_speculative_tokens == 1 or _ROUTINES[mode][0] != "FULL":
        return prefill, None
    return (*prefill, *_descriptors("FULL_DECODE_ONLY", sizes, settings, runner, family="drafter", q=1)), None


def _descriptors(mode: str, sizes: Sequence[int], settings: _Inputs, runner: str, *, family: str = "target",
                 q: int | None = None) -> tuple[VllmDescriptor, ...]:
    """One family's keys, ``q`` query tokens per decode request (default: the target's):
    V1's ``CudagraphDispatcher`` or V2's ``CudaGraphManager``."""
    if mode == "NONE" or not sizes:
        return ()
    decode, mixed = _ROUTINES[mode]
    q = settings.q if q is None else q
    separate = mode in _SEPARATE
    if decode == "FULL" and settings.max_num_seqs is None:
        raise PlanError(f"cudagraph_mode {mode} fixes the request count of FULL graphs (and caps decode graphs at "
                        "q * max_num_seqs tokens): pass max_num_seqs", element="max_num_seqs")
    seqs = settings.max_num_seqs
    found: dict[VllmDescriptor, None] = {}
    for size in sorted(sizes):
        if mixed == "PIECEWISE":
            found[VllmDescriptor(family, Mode.PIECEWISE, size)] = None
        elif mixed == "FULL":
            found[VllmDescriptor(family, Mode.FULL, size, num_reqs=min(size, seqs))] = None
        if not (separate and decode == "FULL"):
            continue
        if runner == "v1":
            if q <= size <= q * seqs:
                found[VllmDescriptor(family, Mode.FULL, size, min(size // q, seqs), q)] = None
        else:
            tokens = -(-size // q) * q
            if tokens <= q * seqs and tokens <= max(sizes) and tokens // q <= seqs:
                found[VllmDescriptor(family, Mode.FULL, tokens, tokens // q, q)] = None
    return capture_order(found)


def _request_counts(max_reqs: int) -> list[int]:
    counts = [n for n in (1, 2, 4) if n <= max_reqs]
    counts += range(8, min(max_reqs + 1, 256), 8)
    counts += range(256, max_reqs + 1, 16)
    return sorted(set(counts) | {max_reqs})


def _mode_name(value: Any) -> str | None:
    """The mode's name from a string or a ``CUDAGraphMode`` member (``.name``); None when unset."""
    if value is None:
        return None
    name = getattr(value, "name", value)
    if not isinstance(name, str) or name.upper() not in _ROUTINES:
        raise PlanError(f"unknown vLLM cudagraph_mode {name!r}: expected one of {', '.join(_ROUTINES)}",
                        element="cudagraph_mode")
    return name.upper()


def _compilation_mode(value: Any) -> str:
    if value is None:
        return ""
    name = getattr(value, "name", value)
    if isinstance(name, int) and not isinstance(name, bool):
        name = _COMPILATION_MODES.get(name, name)
    if not isinstance(name, str) or name.upper() not in _COMPILATION_MODES.values():
        raise PlanError(f"unknown vLLM compilation mode {value!r}: expected one of "
                        f"{', '.join(_COMPILATION_MODES.values())}", element="compilation_mode")
    return name.upper()


def _level(value: Any) -> int:
    name = getattr(value, "name", value)
    if isinstance(name, str) and name.upper().lstrip("-").startswith("O"):
        name = name.upper().lstrip("-")[1:]
    try:
        level = int(name)
    except (TypeError, ValueError):
        level = -1
    if level not in _OPTIMIZATION_MODES:
        raise PlanError(f"unknown vLLM optimization level {value!r}: expected 0, 1, 2 or 3",
                        element="optimization_level")
    return level


def _size_list(sizes: Any) -> tuple[int, ...]:
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or not sizes:
        raise PlanError(f"expected a non-empty list of batch sizes, got {sizes!r}", element="cudagraph_capture_sizes")
    return tuple(_size(s, "cudagraph_capture_sizes") for s in sizes)


def _size(value: Any, element: str, *, zero: bool = False) -> int | None:
    if value is None or (zero and value == 0):
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PlanError(f"expected a batch size >= 1, got {value!r}", element=element)
    return value


def _count(value: Any, element: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise PlanError(f"expected a count >= 0, got {value!r}", element=element)
    return value
