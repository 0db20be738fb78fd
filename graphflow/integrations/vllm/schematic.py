"""graphflow's plan of a vLLM model: one family per graph owner, their channels, their layers.

vLLM's model code is opaque to graphflow, but what the validator's channel rules need is
not: which families capture graphs (the target model, the drafter of speculative
decoding, the vision encoder), which communicate over the tensor-parallel group's
all-reduce (every family, once per attention and once per MLP block when TP > 1), with
which warmup policy, and which layers route tokens by value (MoE top-k). This module
turns those facts into a plan whose DAG has one segment per attention and per MLP block
and one channel per family, so rules such as GF503 (a placeholder warmup output that
reaches data-dependent routing) name the family, the layer and the channel.

vLLM's TP group has one custom all-reduce that every family calls; graphflow gives each
family its own channel id because each family captures its own graphs into it (the
trace names the family of every call).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from graphflow.plan import (
    Buffer,
    BufferRole,
    CaptureSettings,
    Channel,
    ChannelKind,
    Family,
    Plan,
    Prewarm,
    Segment,
    SegmentKind,
    Stream,
    WarmupPolicy,
)

__all__ = ["FamilyFacts", "PREPARE_HOOK", "family_facts", "schematic_plan"]

#: The prewarm hook a ``prepare`` channel names: the plugin's prepare step (its registered
#: hooks, then a rank-identical zero output).
PREPARE_HOOK = "custom_all_reduce.prepare"

#: HF config fields that count routed experts (DeepSeek, Qwen-MoE, Mixtral, ERNIE...).
_EXPERT_FIELDS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")


@attrs.frozen
class FamilyFacts:
    """What the plan needs to know about one graph family's model.

    ``routed_layers`` are the layers whose MLP routes tokens by value (MoE top-k).
    """

    name: str
    layers: int
    hidden_size: int
    dtype: str = "bfloat16"
    routed_layers: frozenset[int] = attrs.field(default=frozenset(), converter=frozenset)


def family_facts(name: str, hf_config: Any, *, dtype: Any = None, layers: int | None = None) -> FamilyFacts:
    """A family's facts read off its Hugging Face config (an object or a dict)."""

    def get(key: str, default: Any = None) -> Any:
        if isinstance(hf_config, Mapping):
            return hf_config.get(key, default)
        return getattr(hf_config, key, default)

    text = get("text_config")
    if text is not None and get("num_hidden_layers") is None:
        return family_facts(name, text, dtype=dtype, layers=layers)
    count = int(layers if layers is not None else get("num_hidden_layers", 1) or 1)
    experts = max((int(get(f) or 0) for f in _EXPERT_FIELDS), default=0)
    routed: frozenset[int] = frozenset()
    if experts > 1:
        dense = int(get("first_k_dense_replace", 0) or 0)
        routed = frozenset(range(min(dense, count), count))
    return FamilyFacts(name, count, int(get("hidden_size", 1) or 1), _dtype_name(dtype or get("torch_dtype")), routed)


def schematic_plan(
    name: str,
    families: Sequence[FamilyFacts],
    *,
    tp_size: int = 1,
    device: str = "cuda:0",
    warmup: Mapping[str, WarmupPolicy] | None = None,
    capture: CaptureSettings | None = None,
) -> Plan:
    """The plan of ``families``: per family an embedding, then per layer ``attn`` and ``mlp``.

    With ``tp_size > 1`` each family has an ``all_reduce`` channel on group ``tp`` (ids
    1, 2, 3 in family order) that its attention and MLP segments use, with the family's
    ``warmup`` policy (default ``placeholder``, what vLLM does). Segments are graph
    segments: vLLM captures attention in FULL graphs and splits at it in PIECEWISE ones
    by itself, which the plan need not repeat.
    """
    warmup = dict(warmup or {})
    buffers: list[Buffer] = []
    channels: list[Channel] = []
    segments: list[Segment] = []
    streams: list[Stream] = []
    prewarm: list[Prewarm] = []
    for index, facts in enumerate(families):
        fam = facts.name
        stream = f"{fam}.stream"
        streams.append(Stream(stream, device))
        tokens, hidden = f"{fam}.tokens", f"{fam}.hidden"
        buffers += [Buffer(tokens, ("B",), "int64", device, BufferRole.INPUT),
                    Buffer(hidden, ("B", facts.hidden_size), facts.dtype, device, BufferRole.OUTPUT)]
        used: tuple[str, ...] = ()
        if tp_size > 1:
            policy = warmup.get(fam, WarmupPolicy.PLACEHOLDER)
            channel = f"{fam}.tp_all_reduce"
            hook = PREPARE_HOOK if policy is WarmupPolicy.PREPARE else None
            if hook and not any(p.name == hook for p in prewarm):
                prewarm.append(Prewarm(hook, "graphflow_prepare", per_size=True))
            channels.append(Channel(channel, ChannelKind.ALL_REDUCE, "tp", index + 1, fam, policy, prewarm=hook))
            used = (channel,)
        segments.append(Segment(f"{fam}.embed", SegmentKind.GRAPH, "embed", reads=(tokens,), writes=(hidden,),
                                stream=stream, family=fam, channels=used))
        for layer in range(facts.layers):
            for part in ("attn", "mlp"):
                segments.append(Segment(
                    f"{fam}.L{layer}.{part}", SegmentKind.GRAPH, f"layers.{layer}.{part}", reads=(hidden,),
                    writes=(hidden,), stream=stream, family=fam, channels=used,
                    data_dependent=part == "mlp" and layer in facts.routed_layers))
    return Plan(
        name,
        buffers=buffers,
        streams=streams,
        channels=channels,
        segments=segments,
        families=[Family(f.name) for f in families],
        prewarm=prewarm,
        capture=capture or CaptureSettings(),
        world_size=tp_size,
    )


def _dtype_name(dtype: Any) -> str:
    name = str(dtype or "bfloat16").removeprefix("torch.")
    return {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(name, name)
