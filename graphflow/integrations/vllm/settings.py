"""The plugin's settings, read from the environment (vLLM workers inherit it).

The switches are read as vLLM reads its own boolean flags (``VLLM_USE_PRECOMPILED``,
``VLLM_DISABLE_PYNCCL``): ``1`` or ``true`` in any case, spaces around ignored, is on;
anything else is off, so a deployment writes them as it writes vLLM's. The other settings
are checked only when the plugin is on; one that cannot be read is a ``SettingsError``
naming the variable and what it accepts, which ``register`` logs before staying off.

=============================  ==========================================================
variable                       meaning
=============================  ==========================================================
``GRAPHFLOW_VLLM``             ``1`` or ``true`` turns the plugin on; anything else: off
``GRAPHFLOW_VLLM_ANY_VERSION`` ``1`` or ``true``: install on a vLLM other than 0.33.x too
``GRAPHFLOW_VLLM_WARMUP``      the custom all-reduce's warmup policy while capture is open
                               but the stream is not capturing: ``placeholder`` (vLLM's),
                               ``real`` or ``prepare``; per family:
                               ``target=real,drafter=prepare`` (unnamed: ``placeholder``)
``GRAPHFLOW_VLLM_ON_FAILURE``  ``raise`` (a ``CaptureError``) or ``eager`` (log, serve
                               without graphs)
``GRAPHFLOW_VLLM_TIMEOUT_S``   the phase barrier timeout, seconds (default 60)
``GRAPHFLOW_VLLM_AGREE``       ``boundaries`` (default): barriers at phase boundaries;
                               ``calls``: also before every communicating collective
``GRAPHFLOW_VLLM_DISABLE``     rule codes the validation skips (``GF506,GF203``)
``GRAPHFLOW_VLLM_ROUTED``      families whose MLPs route by value (``target,drafter``), or
                               ``none``; default: read off each model's expert count
``GRAPHFLOW_VLLM_PREPARE``     prepare hooks, ``pkg.mod:function`` (comma separated),
                               called ``fn(communicator, tensor)`` once per shape
``GRAPHFLOW_TRACE``            a directory: write each rank's trace there
=============================  ==========================================================

Every rank of an engine must run with the same settings (but the trace directory and the
version opt-in, which are the node's business): ``agreed`` is what ranks compare before
their first barrier. Ray workers get only the variables vLLM copies to them;
``carry_to_ray_workers`` adds ``GRAPHFLOW_`` to vLLM's list.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import attrs

from graphflow.errors import GraphflowError
from graphflow.integrations.vllm.descriptors import FAMILIES
from graphflow.plan import WarmupPolicy
from graphflow.dist.trace import TRACE_ENV
from graphflow.plan.rules import RULES

__all__ = ["ANY_VERSION_ENV", "ENABLE_ENV", "RAY_PREFIXES_ENV", "PluginSettings", "SettingsError", "carry_to_ray_workers"]

ENABLE_ENV = "GRAPHFLOW_VLLM"
ANY_VERSION_ENV = "GRAPHFLOW_VLLM_ANY_VERSION"
#: vLLM's list of extra variable prefixes its Ray launcher copies from the driver to the
#: Ray actors it starts (``vllm.ray.ray_env.get_env_vars_to_copy``; vllm/envs.py).
RAY_PREFIXES_ENV = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"
#: The prefix of every variable the plugin reads.
PREFIX = "GRAPHFLOW_"
#: The variables a rank may set for itself: where its trace goes, whether it tries another vLLM.
_NODE_LOCAL = frozenset({TRACE_ENV, ANY_VERSION_ENV})

#: What vLLM's boolean flags take as on (compared lowercased and stripped).
_TRUE = ("1", "true")


class SettingsError(GraphflowError, ValueError):
    """A plugin setting cannot be read; ``str()`` names the variable and what it accepts."""


@attrs.frozen
class PluginSettings:
    enabled: bool = False
    warmup: Mapping[str, WarmupPolicy] = attrs.field(factory=dict)
    on_failure: str = "raise"
    timeout_s: float = 60.0
    agree_calls: bool = False
    disable: tuple[str, ...] = ()
    routed: Mapping[str, bool] | None = None
    prepare: tuple[Callable[[Any, Any], Any], ...] = ()
    trace_dir: str | None = None
    any_version: bool = False

    def policy(self, family: str) -> WarmupPolicy:
        return self.warmup.get(family, WarmupPolicy.PLACEHOLDER)

    def described(self) -> dict[str, str]:
        """Each variable and the value it took, as text (defaults filled in): what
        ``graphflow vllm check`` prints and, less the node-local ones, what ranks compare."""
        return {
            ENABLE_ENV: "1" if self.enabled else "0",
            "GRAPHFLOW_VLLM_WARMUP": ",".join(f"{f}={self.policy(f).value}" for f in FAMILIES),
            "GRAPHFLOW_VLLM_ON_FAILURE": self.on_failure,
            "GRAPHFLOW_VLLM_TIMEOUT_S": f"{self.timeout_s:g}",
            "GRAPHFLOW_VLLM_AGREE": "calls" if self.agree_calls else "boundaries",
            "GRAPHFLOW_VLLM_DISABLE": ",".join(self.disable),
            "GRAPHFLOW_VLLM_ROUTED": "auto" if self.routed is None else
            ",".join(f for f in FAMILIES if self.routed.get(f)) or "none",
            "GRAPHFLOW_VLLM_PREPARE": ",".join(f"{h.__module__}:{h.__qualname__}" for h in self.prepare),
            TRACE_ENV: self.trace_dir or "",
            ANY_VERSION_ENV: "1" if self.any_version else "0",
        }

    def agreed(self) -> dict[str, str]:
        """The settings every rank of an engine must share: a rank with another warmup
        policy or timeout would trace, refuse or wait differently from its peers."""
        return {name: value for name, value in self.described().items() if name not in _NODE_LOCAL}

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PluginSettings:
        env = os.environ if env is None else env
        if not _flag(env, ENABLE_ENV):
            return cls()
        return cls(
            enabled=True,
            warmup=_warmup(env.get("GRAPHFLOW_VLLM_WARMUP", "")),
            on_failure=_choice(env, "GRAPHFLOW_VLLM_ON_FAILURE", ("raise", "eager")),
            timeout_s=_seconds(env.get("GRAPHFLOW_VLLM_TIMEOUT_S", "60")),
            agree_calls=_choice(env, "GRAPHFLOW_VLLM_AGREE", ("boundaries", "calls")) == "calls",
            disable=_codes(env.get("GRAPHFLOW_VLLM_DISABLE", "")),
            routed=_routed(env.get("GRAPHFLOW_VLLM_ROUTED", "")),
            prepare=tuple(_hook(spec) for spec in _items(env.get("GRAPHFLOW_VLLM_PREPARE", ""))),
            trace_dir=env.get(TRACE_ENV) or None,
            any_version=_flag(env, ANY_VERSION_ENV),
        )


def carry_to_ray_workers(env: MutableMapping[str, str] | None = None) -> bool:
    """Add ``GRAPHFLOW_`` to ``VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY`` in ``env`` (the
    process's environment by default) unless a prefix there covers it already; whether it
    changed anything.

    vLLM's Ray launcher of data-parallel engines copies the driver's ``VLLM_*``, ``NCCL_*``,
    ``HF_*``... and the prefixes that variable lists (additive), nothing else: without
    this, ``GRAPHFLOW_*`` would not reach the engines it starts on Ray, so their workers
    would run without the plugin. The plugin runs in the driver (vLLM loads general
    plugins while it parses its arguments), before the launcher reads the variable.
    """
    env = os.environ if env is None else env
    prefixes = _items(env.get(RAY_PREFIXES_ENV, ""))
    if any(PREFIX.startswith(p) for p in prefixes):
        return False
    env[RAY_PREFIXES_ENV] = ",".join([*prefixes, PREFIX])
    return True


def _flag(env: Mapping[str, str], name: str) -> bool:
    """A boolean switch, on for ``1`` or ``true`` (any case), as vLLM reads its own."""
    return env.get(name, "").strip().lower() in _TRUE


def _items(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...]) -> str:
    value = env.get(name, "").strip().lower() or choices[0]
    if value not in choices:
        raise SettingsError(f"{name}={value!r}: expected one of {', '.join(choices)}")
    return value


def _warmup(value: str) -> dict[str, WarmupPolicy]:
    policies: dict[str, WarmupPolicy] = {}
    for item in _items(value):
        family, sep, name = item.rpartition("=")
        targets = [family.strip()] if sep else list(FAMILIES)
        if sep and family.strip() not in FAMILIES:
            raise SettingsError(f"GRAPHFLOW_VLLM_WARMUP: unknown family {family.strip()!r}: expected one of "
                                f"{', '.join(FAMILIES)}")
        try:
            policy = WarmupPolicy(name.strip().lower())
        except ValueError as e:
            raise SettingsError(f"GRAPHFLOW_VLLM_WARMUP: unknown policy {name.strip()!r}: expected one of "
                                f"{', '.join(p.value for p in WarmupPolicy)}") from e
        for target in targets:
            policies[target] = policy
    return policies


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError as e:
        raise SettingsError(f"GRAPHFLOW_VLLM_TIMEOUT_S={value!r}: expected a number of seconds") from e
    if seconds <= 0:
        raise SettingsError(f"GRAPHFLOW_VLLM_TIMEOUT_S={value!r}: expected a positive number of seconds")
    return seconds


def _codes(value: str) -> tuple[str, ...]:
    known = {rule.code for rule in RULES}
    codes = tuple(code.upper() for code in _items(value))
    unknown = [c for c in codes if c not in known]
    if unknown:
        raise SettingsError(f"GRAPHFLOW_VLLM_DISABLE: unknown rule code(s) {', '.join(unknown)} "
                            "(`graphflow rules` lists them)")
    return codes


def _routed(value: str) -> dict[str, bool] | None:
    items = _items(value)
    if not items or items == ["auto"]:
        return None
    if items == ["none"]:
        return {family: False for family in FAMILIES}
    unknown = [i for i in items if i not in FAMILIES]
    if unknown:
        raise SettingsError(f"GRAPHFLOW_VLLM_ROUTED: unknown family {unknown[0]!r}: expected some of "
                            f"{', '.join(FAMILIES)}, or none, or auto")
    return {family: family in items for family in FAMILIES}


def _hook(spec: str) -> Callable[[Any, Any], Any]:
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise SettingsError(f"GRAPHFLOW_VLLM_PREPARE: {spec!r} is not 'package.module:function'")
    try:
        target = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise SettingsError(f"GRAPHFLOW_VLLM_PREPARE: cannot load {spec!r}: {e}") from e
    if not callable(target):
        raise SettingsError(f"GRAPHFLOW_VLLM_PREPARE: {spec!r} is not callable")
    return target
