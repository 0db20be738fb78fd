"""Map a vLLM ``CompilationConfig`` onto a plan's capture settings.

vLLM decides what to capture with three fields (``vllm/config/compilation.py`` and
``VllmConfig._set_cudagraph_sizes``):

* ``cudagraph_mode``: ``NONE``; ``PIECEWISE`` (graphs between attention splits);
  ``FULL`` (one graph per step, every batch); ``FULL_DECODE_ONLY`` (FULL graphs for
  uniform decode batches, mixed batches eager); ``FULL_AND_PIECEWISE`` (FULL for
  decode, PIECEWISE for mixed batches; vLLM's default at optimization level O2).
* ``cudagraph_capture_sizes``: the batch sizes, de-duplicated and sorted ascending.
* ``max_cudagraph_capture_size``: without explicit sizes, the sizes are
  ``[1, 2, 4] + range(8, 256, 8) + range(256, max + 1, 16)`` cut at ``max``; with them,
  ``max`` must equal the largest size, else vLLM refuses the config.

A graphflow plan describes one step (a decode step), so ``FULL`` and
``FULL_DECODE_ONLY`` both capture it as FULL, and ``FULL_AND_PIECEWISE`` captures both
modes (the runtime prefers FULL, like vLLM's dispatcher). ``NONE`` captures nothing:
the plan keeps its segments with no modes and no sizes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from graphflow.errors import PlanError
from graphflow.plan import Mode, Plan

__all__ = ["VLLM_MODES", "plan_from_vllm_config"]

#: vLLM's ``CUDAGraphMode`` names and the graphflow modes each captures for a decode step.
VLLM_MODES: Mapping[str, tuple[Mode, ...]] = {
    "NONE": (),
    "PIECEWISE": (Mode.PIECEWISE,),
    "FULL": (Mode.FULL,),
    "FULL_DECODE_ONLY": (Mode.FULL,),
    "FULL_AND_PIECEWISE": (Mode.PIECEWISE, Mode.FULL),
}

#: vLLM's mode when ``cudagraph_mode`` is unset (optimization level O2).
DEFAULT_MODE = "FULL_AND_PIECEWISE"

#: vLLM's ceiling on the derived maximum capture size.
_MAX_DERIVED_SIZE = 512


def plan_from_vllm_config(
    compilation_config: Any,
    *,
    model_plan: Plan,
    max_num_seqs: int | None = None,
    num_speculative_tokens: int = 0,
    max_num_batched_tokens: int | None = None,
) -> Plan:
    """``model_plan`` with the modes and sizes vLLM would capture under this config.

    ``compilation_config`` is a mapping (``{"cudagraph_mode": "PIECEWISE", ...}``), a
    vLLM ``CompilationConfig``, or a ``VllmConfig`` (its scheduler and speculative
    configs then supply the keyword arguments). ``max_num_seqs`` and
    ``num_speculative_tokens`` derive the maximum size as vLLM does when neither
    sizes nor a maximum are given; ``max_num_batched_tokens`` drops larger sizes.
    """
    if not isinstance(compilation_config, Mapping) and hasattr(compilation_config, "compilation_config"):
        scheduler = getattr(compilation_config, "scheduler_config", None)
        speculative = getattr(compilation_config, "speculative_config", None)
        max_num_seqs = getattr(scheduler, "max_num_seqs", max_num_seqs)
        max_num_batched_tokens = getattr(scheduler, "max_num_batched_tokens", max_num_batched_tokens)
        num_speculative_tokens = getattr(speculative, "num_speculative_tokens", None) or num_speculative_tokens
        compilation_config = compilation_config.compilation_config
    mode = _mode_name(_field(compilation_config, "cudagraph_mode"))
    if mode == "NONE":
        sizes: tuple[int, ...] = ()
    else:
        sizes = _capture_sizes(
            _field(compilation_config, "cudagraph_capture_sizes"),
            _field(compilation_config, "max_cudagraph_capture_size"),
            max_num_seqs, num_speculative_tokens, max_num_batched_tokens,
        )
    capture = attrs.evolve(model_plan.capture, modes=VLLM_MODES[mode], sizes=sizes)
    return attrs.evolve(model_plan, capture=capture)


def _field(config: Any, name: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(name)
    return getattr(config, name, None)


def _mode_name(value: Any) -> str:
    """The mode's name from a string or a ``CUDAGraphMode`` member (``.name``)."""
    if value is None:
        return DEFAULT_MODE
    name = getattr(value, "name", value)
    if not isinstance(name, str) or name.upper() not in VLLM_MODES:
        raise PlanError(f"unknown vLLM cudagraph_mode {name!r}: expected one of {', '.join(VLLM_MODES)}",
                        element="cudagraph_mode")
    return name.upper()


def _capture_sizes(
    sizes: Sequence[int] | None,
    maximum: int | None,
    max_num_seqs: int | None,
    num_speculative_tokens: int,
    max_num_batched_tokens: int | None,
) -> tuple[int, ...]:
    """The sizes ``VllmConfig._set_cudagraph_sizes`` computes, ascending."""
    if maximum is not None:
        _check_size(maximum, "max_cudagraph_capture_size")
    limit = maximum
    if limit is None and sizes is None:
        if max_num_seqs is None:
            raise PlanError("neither cudagraph_capture_sizes nor max_cudagraph_capture_size is set: give one, "
                            "or pass max_num_seqs so the maximum is derived as vLLM does",
                            element="cudagraph_capture_sizes")
        limit = min(max_num_seqs * (1 + num_speculative_tokens) * 2, _MAX_DERIVED_SIZE)
    if max_num_batched_tokens is not None and limit is not None:
        limit = min(limit, max_num_batched_tokens)
    if sizes is not None:
        if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or not sizes:
            raise PlanError(f"expected a non-empty list of batch sizes, got {sizes!r}",
                            element="cudagraph_capture_sizes")
        for size in sizes:
            _check_size(size, "cudagraph_capture_sizes")
        cap = max_num_batched_tokens if max_num_batched_tokens is not None else max(sizes)
        result = tuple(sorted(size for size in set(sizes) if size <= cap))
        if maximum is not None and result and maximum != result[-1]:
            raise PlanError(f"max_cudagraph_capture_size ({maximum}) must equal the largest of "
                            f"cudagraph_capture_sizes ({result[-1]}), as vLLM requires",
                            element="max_cudagraph_capture_size")
    else:
        result = tuple(s for s in (1, 2, 4, *range(8, 256, 8), *range(256, limit + 1, 16)) if s <= limit)
    if not result:
        raise PlanError(f"no capture size fits within {limit} tokens", element="cudagraph_capture_sizes")
    return result


def _check_size(value: Any, element: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PlanError(f"expected a batch size >= 1, got {value!r}", element=element)
