"""vLLM's capture descriptors, as graphflow reads them, and the plan built around them.

vLLM keys a captured graph by more than (mode, tokens): a FULL decode graph also fixes
the request count and the query length of every request (``q = 1 + speculative
tokens``), LoRA and micro-batching multiply the keys, and the drafter and the vision
encoder keep their own. graphflow's core plan keys descriptors by (mode, size) only, so
the integration keeps vLLM's full keys here (``VllmDescriptor``) and gives the core plan
the target family's sizes per mode (``CaptureSettings.mode_sizes``): the validator
checks those, the plugin captures and names the full keys.

This module imports neither vLLM nor torch: it reads vLLM's descriptor objects by
attribute (``BatchDescriptor`` of model runner V1, ``BatchExecutionDescriptor`` of V2).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from graphflow.plan import Mode, Plan

__all__ = ["FAMILIES", "VllmDescriptor", "VllmPlan", "descriptor_from_vllm"]

#: The graph families vLLM captures, in the order it captures them.
FAMILIES = ("target", "drafter", "encoder")


@attrs.frozen(order=True)
class VllmDescriptor:
    """One graph vLLM captures: its family, mode and full key.

    ``uniform_query_len`` is set on uniform-decode graphs (every request has exactly that
    many query tokens) and ``num_reqs`` on graphs that fix the request count (FULL); both
    are None on PIECEWISE graphs, which take any mix. Ordered by family, then mode, then
    tokens, so sorted lists compare equal whatever order vLLM listed them in.
    """

    family: str
    mode: Mode = attrs.field(order=lambda m: m.value)
    num_tokens: int
    num_reqs: int | None = attrs.field(default=None, order=lambda v: -1 if v is None else v)
    uniform_query_len: int | None = attrs.field(default=None, order=lambda v: -1 if v is None else v)
    num_active_loras: int = 0
    num_ubatches: int = 1
    max_query_len: int | None = attrs.field(default=None, order=lambda v: -1 if v is None else v)
    #: A V2 drafter's decode graph under dynamic speculative decoding: the draft width it
    #: was captured for (V2 captures one graph per width the schedule can pick).
    num_speculative_tokens: int | None = attrs.field(default=None, order=lambda v: -1 if v is None else v)

    def __str__(self) -> str:
        parts = [f"tokens={self.num_tokens}"]
        if self.num_reqs is not None:
            parts.append(f"reqs={self.num_reqs}")
        if self.uniform_query_len is not None:
            parts.append(f"q={self.uniform_query_len}")
        if self.max_query_len is not None:
            parts.append(f"max_q={self.max_query_len}")
        if self.num_speculative_tokens is not None:
            parts.append(f"k={self.num_speculative_tokens}")
        if self.num_active_loras:
            parts.append(f"loras={self.num_active_loras}")
        if self.num_ubatches != 1:
            parts.append(f"ubatches={self.num_ubatches}")
        return f"{self.family} {self.mode.value}({', '.join(parts)})"


def _mode(value: Any) -> Mode:
    name = getattr(value, "name", value)
    return Mode(str(name).upper())


def descriptor_from_vllm(family: str, mode: Any, desc: Any, *, uniform_query_len: int = 1,
                         num_speculative_tokens: int | None = None) -> VllmDescriptor:
    """A ``VllmDescriptor`` from vLLM's own descriptor object.

    V1's ``BatchDescriptor`` says ``uniform=True`` and leaves the query length to the
    dispatcher (``uniform_query_len``); V2's ``BatchExecutionDescriptor`` carries it as
    ``uniform_token_count`` and its mode as ``cg_mode``, and V2's drafter's
    ``SpeculatorBatchDescriptor`` its draft width as ``num_speculative_tokens`` (given
    here for a descriptor V2 will specialize while capturing).
    """
    if num_speculative_tokens is None:
        num_speculative_tokens = getattr(desc, "num_speculative_tokens", None)
    if hasattr(desc, "cg_mode"):
        mode = desc.cg_mode
        q = getattr(desc, "uniform_token_count", None)
    else:
        q = uniform_query_len if getattr(desc, "uniform", False) else None
    return VllmDescriptor(
        family=family,
        mode=_mode(mode),
        num_tokens=int(desc.num_tokens),
        num_reqs=None if getattr(desc, "num_reqs", None) is None else int(desc.num_reqs),
        uniform_query_len=None if q is None else int(q),
        num_active_loras=int(getattr(desc, "num_active_loras", 0) or 0),
        num_ubatches=int(getattr(desc, "num_ubatches", 1) or 1),
        max_query_len=getattr(desc, "max_query_len", None),
        num_speculative_tokens=None if num_speculative_tokens is None else int(num_speculative_tokens),
    )


@attrs.frozen
class VllmPlan:
    """What vLLM will capture, as graphflow plans it.

    ``plan`` is graphflow's plan (families, channels, segments; the target family's modes
    and per-mode sizes in ``plan.capture``), the thing the validator checks.
    ``descriptors`` are vLLM's full keys for every family, in capture order.
    ``cudagraph_mode`` is vLLM's resolved mode name, ``runner`` the model runner
    (``"v1"`` or ``"v2"``). ``unknowns`` says, in words, what this plan could not know
    and so may differ from what the engine captures (empty for a plan read off the
    engine's own objects).
    """

    plan: Plan
    descriptors: tuple[VllmDescriptor, ...] = attrs.field(converter=tuple)
    cudagraph_mode: str
    runner: str
    uniform_decode_query_len: int = 1
    unknowns: tuple[str, ...] = attrs.field(default=(), converter=tuple)

    def family(self, name: str) -> tuple[VllmDescriptor, ...]:
        return tuple(d for d in self.descriptors if d.family == name)

    def counts(self) -> dict[tuple[str, str], int]:
        """Graphs per (family, mode): ``{("target", "PIECEWISE"): 51, ("target", "FULL"): 35}``."""
        counts: dict[tuple[str, str], int] = {}
        for d in self.descriptors:
            key = (d.family, d.mode.value)
            counts[key] = counts.get(key, 0) + 1
        return counts

    def summary(self) -> str:
        """``target PIECEWISE=51 (largest 512), target FULL=35 (largest 256)``."""
        parts = []
        for (family, mode), n in self.counts().items():
            largest = max(d.num_tokens for d in self.descriptors if d.family == family and d.mode.value == mode)
            parts.append(f"{family} {mode}={n} (largest {largest})")
        return ", ".join(parts) or "no graphs"


def sizes_by_mode(descriptors: Iterable[VllmDescriptor], family: str = "target") -> dict[Mode, tuple[int, ...]]:
    """The token counts each mode captures for ``family``, ascending (the core plan's sizes)."""
    sizes: dict[Mode, set[int]] = {}
    for d in descriptors:
        if d.family == family:
            sizes.setdefault(d.mode, set()).add(d.num_tokens)
    order = [m for m in (Mode.PIECEWISE, Mode.FULL) if m in sizes]
    return {m: tuple(sorted(sizes[m])) for m in order}


def capture_order(descriptors: Iterable[VllmDescriptor]) -> tuple[VllmDescriptor, ...]:
    """vLLM's capture order: family by family, PIECEWISE before FULL, largest first."""
    rank: Mapping[str, int] = {f: i for i, f in enumerate(FAMILIES)}
    return tuple(sorted(descriptors, key=lambda d: (rank.get(d.family, len(rank)), d.mode is Mode.FULL,
                                                   -d.num_tokens, -d.num_active_loras, -d.num_ubatches)))
