"""Variants of the bundled dsv4 plans: another size of model, other batch sizes.

A plan's buffer shapes follow from its ``model_args`` (``expected_shapes``), so a
variant rewrites the YAML document before loading it: ``model_args`` overridden, the
layer range set to ``n_layers``, the descriptor sizes replaced, and every model buffer
reshaped to match. The result goes through the ordinary loader, so it is validated and
expanded exactly like a file.
"""

from __future__ import annotations

import pathlib

import yaml

from graphflow.integrations.dsv4.config import DSV4Config
from graphflow.integrations.dsv4.model import expected_shapes
from graphflow.plan.loader import loads_plan
from graphflow.plan import Plan

__all__ = ["plan_variant"]


def plan_variant(path: str | pathlib.Path, *, sizes: tuple[int, ...] | None = None, world_size: int | None = None,
                 **model_args) -> Plan:
    """The plan at ``path`` with ``model_args`` overridden and, if given, descriptor ``sizes``.

    ``world_size`` makes it a tensor-parallel plan (``plans/dsv4_tp_*.yaml``) for that many
    ranks: the heads of ``q`` and ``o`` are split among them (``tp.tp_shapes``).
    """
    from graphflow.integrations.dsv4.tp import tp_shapes

    path = pathlib.Path(path)
    doc = yaml.safe_load(path.read_text())
    args = {**doc.get("model_args", {}), **model_args}
    config = DSV4Config(**args)
    doc["model_args"] = args
    doc["for_each"] = {**doc.get("for_each", {}), "layer": f"range({config.n_layers})"}
    if world_size is not None:
        doc["world_size"] = world_size
    if sizes is not None:
        doc["symbols"] = {**doc.get("symbols", {}), "B": sorted(sizes)}
    shapes = expected_shapes(config) if world_size is None else tp_shapes(config, world_size)
    for name, buffer in doc["buffers"].items():
        stem = name.replace("{layer}", "")
        if stem in shapes:
            buffer["shape"] = list(shapes[stem])
        if buffer.get("role") == "input" and stem == "tokens":
            buffer["values"] = [0, config.vocab_size]
        if buffer.get("role") == "input" and stem in ("positions", "positions_host"):
            buffer["values"] = [0, config.max_len]
        if buffer.get("dtype") in ("float32", "bfloat16", "float16") and stem != "logits":
            buffer["dtype"] = config.dtype
    where = f"{path} (variant)" if world_size is None else f"{path} (world_size {world_size})"
    return loads_plan(yaml.safe_dump(doc, sort_keys=False), file=where)
