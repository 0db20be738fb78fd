"""``graphflow vllm check -- SERVE_ARGS...``: what vLLM will capture for a ``vllm serve`` line.

Before a deployment, without a GPU and without downloading the model: the argument list is
parsed by vLLM's own ``vllm serve`` parser (``make_arg_parser`` over a
``FlexibleArgumentParser``, then ``AsyncEngineArgs.from_cli_args``), so a flag vLLM
rejects is rejected here with vLLM's message (and a value vLLM's parser fails on with an
uncaught exception, which ``vllm serve`` prints as a traceback, with one line naming the
option); the speculative settings go through vLLM's own ``SpeculativeConfig`` where that
needs no model; the settings that decide capture are then handed to
``plan_from_vllm_config``, which applies vLLM 0.33's rules. The batch sizes the line
leaves out are vLLM's defaults for the GPU ``--gpu-memory-gib`` describes. The report lists the
descriptors per family and mode, what the prediction cannot know (``VllmPlan.unknowns``,
and here also the defaults vLLM picks from the GPU and the model's Hugging Face config
when it is not given), the plugin's settings as the environment sets them, and the
findings graphflow's rules would log before capture.

vLLM's parser reads the platform's device type for its defaults; on a machine without a
GPU that platform is undetermined and vLLM's parser cannot be built, so a CUDA platform
that answers only that is put in its place (nothing here touches a device).

The model's Hugging Face config is read only from a file: ``--hf-config PATH`` (a
``config.json`` or a directory holding one), or the served model when it is a local
directory. Without it, layers, experts, encoder-decoder and pooling are unknown and said so.

Exit status: 0 the plan is clean (warnings allowed); 1 graphflow's rules find an error,
so the plugin would refuse this capture; 2 vLLM is not importable, vLLM rejects the
arguments, or a setting or file cannot be read.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import importlib.util
import json
import os
import pathlib
import sys
import typing
from collections.abc import Iterator
from typing import Any

from graphflow.errors import GraphflowError
from graphflow.integrations.vllm.config import plan_from_vllm_config
from graphflow.integrations.vllm.descriptors import VllmPlan
from graphflow.integrations.vllm.schematic import FamilyFacts, family_facts, schematic_plan
from graphflow.integrations.vllm.settings import ENABLE_ENV, PluginSettings, SettingsError
from graphflow.plan.rules import Report, validate

__all__ = ["CheckError", "run"]


class CheckError(GraphflowError, ValueError):
    """The check cannot go on: vLLM is not importable here, vLLM refuses the arguments, or a
    setting or file cannot be read. ``str()`` is one line; ``graphflow vllm check`` prints it
    and exits 2 (the command line sits above this layer, so it translates)."""

#: ``vllm serve``'s batch defaults (``EngineArgs.get_batch_defaults``, API server context),
#: from the GPU's memory: (at least this many GiB, max_num_batched_tokens, max_num_seqs),
#: largest first. Below 160 GiB vLLM keeps the smallest tier for A100 (which it tells by
#: name; the check by its compute capability, 80) and GB10 (121) whatever their memory.
_BATCH_DEFAULTS = ((160, 16384, 1024), (70, 8192, 1024), (0, 2048, 256))
_SMALL_TIER_CAPABILITIES = (80, 121)
_DEFAULTS_NOTE = ("{name}: not given; vllm serve picks it from the GPU ({tiers}; doubled with --performance-mode "
                  "throughput{cap}): for a GPU of {gib:g} GiB and capability {capability} (--gpu-memory-gib, "
                  "--device-capability), assumed {value}")
_TIERS = {"max_num_batched_tokens": "16384 at 160 GiB or more (B200, B300), 8192 at 70 GiB or more (H100, H200) "
                                    "but 2048 on A100 and GB10, 2048 below",
          "max_num_seqs": "1024 at 70 GiB or more but 256 on A100 and GB10, 256 below"}
_CAPS = {"max_num_batched_tokens": ", at most max_num_seqs x max_model_len",
         "max_num_seqs": ", at most max_num_batched_tokens"}
#: Speculative methods whose proposer runs no model: vLLM's own checks of them need no model
#: config, so the check runs them (``_speculative``).
_MODEL_FREE = frozenset({"ngram", "ngram_gpu", "suffix"})


def run(args: argparse.Namespace) -> int:
    """The command, on the arguments ``graphflow.cli.vllm_cmd`` parsed; the exit status."""
    serve_args = list(args.serve_args)
    if serve_args[:1] == ["--"]:
        serve_args = serve_args[1:]
    if not serve_args:
        raise CheckError("vllm check: give the arguments of 'vllm serve' after '--' "
                           "(graphflow vllm check -- MODEL --max-num-seqs 256)")
    try:
        settings = PluginSettings.from_env()
    except SettingsError as error:
        raise CheckError(f"vllm check: {error} (the plugin would stay off)") from error
    engine_args = _engine_args(serve_args)
    hf, hf_note = _hf_config(args.hf_config, str(engine_args.model))
    inputs, unknowns = _inputs(engine_args, hf, gpu_memory_gib=args.gpu_memory_gib,
                               capability=args.device_capability)
    inputs["device_capability"] = args.device_capability
    if hf_note:
        unknowns.insert(0, hf_note)
    facts = family_facts("target", hf) if hf is not None else FamilyFacts("target", 1, 1)
    tp = int(engine_args.tensor_parallel_size or 1)
    model_plan = schematic_plan(f"vllm:{str(engine_args.model).rstrip('/').rsplit('/', 1)[-1]}", [facts], tp_size=tp,
                                warmup=settings.warmup)
    runner, runner_note = _runner()
    if runner_note:
        unknowns.append(runner_note)
    plan = plan_from_vllm_config(inputs, model_plan=model_plan, runner=runner,
                                 attention_support=args.attention_support)
    if settings.routed is not None:
        plan = _routed(plan, settings, tp, facts)
    # the plugin validates only a capture that has graphs (it lets vLLM run one without)
    report = validate(plan.plan, disable=settings.disable) if plan.descriptors else Report(plan.plan.name, ())
    if args.json:
        json.dump(_document(serve_args, plan, unknowns, settings, report), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _print(serve_args, plan, unknowns, settings, report)
    return 0 if report.ok else 1


def _engine_args(serve_args: list[str]) -> Any:
    """vLLM's ``AsyncEngineArgs`` for ``serve_args``, parsed as ``vllm serve`` parses them."""
    if importlib.util.find_spec("vllm") is None:
        raise CheckError("vllm check: vLLM is not installed here (pip install 'graphflow[vllm]'): "
                           "the check parses the arguments with vLLM's own parser")
    try:
        _ensure_platform()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.common.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except Exception as error:  # a broken vLLM install: one line, not its traceback
        raise CheckError(f"vllm check: vLLM cannot be imported ({type(error).__name__}: {error})") from error

    class Parser(FlexibleArgumentParser):
        """``vllm serve``'s parser, raising its error instead of exiting, and naming the
        option whose value vLLM's reading of it failed on with an exception argparse does not
        catch (an unknown name in ``-cc``'s JSON is a ``KeyError``)."""

        def error(self, message: str):
            raise CheckError(f"vllm serve: {message}")

        def _get_value(self, action, arg_string):
            try:
                return super()._get_value(action, arg_string)
            except (argparse.ArgumentError, CheckError):
                raise
            except Exception as error:
                option = "/".join(action.option_strings) or action.dest
                raise CheckError(f"vllm serve: argument {option}: invalid value {arg_string!r}: "
                                   f"{_reason(error)}") from error

    with _plugin_kept_off():  # building the parser loads the general plugins
        parser = make_arg_parser(Parser(prog="vllm serve"))
    parsed = parser.parse_args(serve_args)
    if getattr(parsed, "model_tag", None):
        parsed.model = parsed.model_tag  # what 'vllm serve' itself does with the positional
    try:
        return AsyncEngineArgs.from_cli_args(parsed)
    except Exception as error:
        raise CheckError(f"vllm serve: {_reason(error)}") from error


@contextlib.contextmanager
def _plugin_kept_off() -> Iterator[None]:
    """``GRAPHFLOW_VLLM`` unset while vLLM loads the general plugins in this process: the
    plugin would wrap vLLM in a process that only plans (without a GPU it cannot, and would
    say so). The settings the check prints were read before, from the environment as it is."""
    value = os.environ.pop(ENABLE_ENV, None)
    try:
        yield
    finally:
        if value is not None:
            os.environ[ENABLE_ENV] = value


def _reason(error: BaseException) -> str:
    """What an exception from vLLM's reading of the arguments says, on one line. An unknown
    name looked up in an enum (vLLM reads ``cudagraph_mode`` so) names the enum's members."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    owner = tb.tb_frame.f_locals.get("cls") if tb is not None else None
    if isinstance(error, KeyError) and isinstance(owner, enum.EnumMeta):
        return f"unknown {owner.__name__} {error.args[0]!r}: expected one of {', '.join(owner.__members__)}"
    errors = getattr(error, "errors", None)  # pydantic's ValidationError: one entry per field
    if callable(errors):
        return "; ".join(" ".join(f"{'.'.join(map(str, e.get('loc', ())))} {e.get('msg', '')}".split())
                         for e in errors())
    return " ".join(str(error).split()) or type(error).__name__


def _ensure_platform() -> None:
    """vLLM's platform, or, where none is detected (no GPU), a CUDA one that only names its
    device type: vLLM's parser builds its defaults from it, and nothing here runs on it."""
    import vllm.platforms as platforms
    from vllm.platforms.interface import Platform, PlatformEnum

    if platforms._current_platform is not None or \
            not platforms.resolve_current_platform_cls_qualname().endswith("UnspecifiedPlatform"):
        return

    class PlanningPlatform(Platform):
        _enum = PlatformEnum.CUDA
        device_name = device_type = "cuda"
        dispatch_key = "CUDA"
        ray_device_key = "GPU"
        dist_backend = "nccl"
        device_control_env_var = "CUDA_VISIBLE_DEVICES"

    platforms._current_platform = PlanningPlatform()


def _hf_config(path: str | None, model: str) -> tuple[dict | None, str | None]:
    """The model's HF config from ``path`` or a local model directory, and the unknowns line
    when there is none."""
    if path is None and os.path.isfile(os.path.join(model, "config.json")):
        path = model
    if path is None:
        return None, ("the model's Hugging Face config: not read (pass --hf-config PATH or serve a local model "
                      "directory): layers, experts, encoder-decoder and pooling unknown; the plan has one layer")
    file = pathlib.Path(path)
    if file.is_dir():
        file = file / "config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise CheckError(f"vllm check: --hf-config {path}: cannot read {file} ({error})") from error
    if not isinstance(config, dict):
        raise CheckError(f"vllm check: --hf-config {path}: {file} is not a JSON object")
    return config, None


def _inputs(engine_args: Any, hf: dict | None, *, gpu_memory_gib: float,
            capability: int) -> tuple[dict[str, Any], list[str]]:
    """``plan_from_vllm_config``'s settings from vLLM's parsed arguments, and what was assumed."""
    compilation = engine_args.compilation_config
    spec = _speculative(engine_args)
    inputs: dict[str, Any] = {
        "cudagraph_mode": compilation.cudagraph_mode,
        "cudagraph_capture_sizes": compilation.cudagraph_capture_sizes,
        "max_cudagraph_capture_size": compilation.max_cudagraph_capture_size,
        "compilation_mode": compilation.mode,
        "optimization_level": engine_args.optimization_level,
        "enforce_eager": bool(engine_args.enforce_eager),
        "performance_mode": engine_args.performance_mode,
        "pooling": engine_args.runner == "pooling",
    }
    batch, unknowns = _batch_sizes(engine_args, gpu_memory_gib, capability)
    inputs.update(batch)
    if spec:
        inputs.update(num_speculative_tokens=spec.get("num_speculative_tokens"), speculative_method=spec.get("method"),
                      num_speculative_tokens_per_batch_size=spec.get("num_speculative_tokens_per_batch_size"))
    if hf is not None:
        inputs["encoder_decoder"] = bool(hf.get("is_encoder_decoder", False))
    return inputs, unknowns


def _batch_sizes(engine_args: Any, gib: float, capability: int) -> tuple[dict[str, int], list[str]]:
    """``max_num_batched_tokens`` and ``max_num_seqs`` as ``vllm serve`` sets those the line
    leaves out (``EngineArgs._set_default_max_num_seqs_and_batched_tokens_args``): its
    defaults for the GPU, doubled in throughput mode, the tokens at most ``max_num_seqs``
    times ``max_model_len`` (when the line gives it), the sequences at most the tokens; and
    a note for each value assumed so."""
    _, tokens, seqs = next(t for t in _BATCH_DEFAULTS if gib >= t[0] and (
        t[0] != 70 or capability not in _SMALL_TIER_CAPABILITIES))
    given_tokens, given_seqs = engine_args.max_num_batched_tokens, engine_args.max_num_seqs
    factor = 2 if engine_args.performance_mode == "throughput" else 1
    tokens = given_tokens if given_tokens is not None else tokens * factor
    seqs = given_seqs if given_seqs is not None else seqs * factor
    if given_tokens is None and isinstance(engine_args.max_model_len, int):
        tokens = min(seqs * engine_args.max_model_len, tokens)
    if given_seqs is None:
        seqs = min(seqs, tokens)
    values = {"max_num_batched_tokens": tokens, "max_num_seqs": seqs}
    notes = [_DEFAULTS_NOTE.format(name=name, tiers=_TIERS[name], cap=_CAPS[name], gib=gib, capability=capability,
                                   value=value)
             for name, value in values.items() if getattr(engine_args, name) is None]
    return values, notes


def _speculative(engine_args: Any) -> dict[str, Any]:
    """The line's speculative settings as vLLM's engine reads them
    (``EngineArgs.create_speculative_config``: ``--speculative-config`` with ``--spec-method``,
    ``--spec-model`` and ``--spec-tokens`` merged in); empty without speculation.

    For a method whose proposer runs no model (n-gram, suffix decoding) that builds vLLM's
    own ``SpeculativeConfig``: what the engine refuses at start-up (suffix decoding without
    Arctic Inference) is refused here in vLLM's words, and what it fills in (suffix
    decoding's speculative tokens) is used. A drafter model's checks need that model's
    config, which the check does not download: for those, only vLLM's merge of the flags and
    the method's name are checked, and the settings are read as given.
    """
    from vllm.config.speculative import SpeculativeConfig, SpeculativeMethod

    try:
        config = engine_args.create_speculative_config(target_model_config=None, target_parallel_config=None)
    except Exception as error:
        spec = dict(engine_args.speculative_config or {})
        merged = "target_model_config" in spec  # vLLM adds the model configs after merging, before building
        method = _method(spec, SpeculativeConfig)
        if not merged or method in _MODEL_FREE or method not in _names(SpeculativeMethod):
            raise CheckError(f"vllm serve: speculative decoding: {_reason(error)}") from error
        return {**spec, "method": method}
    if config is None:
        return {}
    return {"method": config.method, "num_speculative_tokens": config.num_speculative_tokens,
            "num_speculative_tokens_per_batch_size": config.num_speculative_tokens_per_batch_size}


def _method(spec: dict[str, Any], config_cls: Any) -> str:
    """The speculative method vLLM's ``SpeculativeConfig`` takes ``spec`` for: the one named
    (an MTP model type stands for ``mtp``), else what it infers from the model."""
    from vllm.config.speculative import MTPModelTypes

    method, model = spec.get("method"), spec.get("model")
    if method is None:
        if config_cls._is_custom_proposer_path(model):
            return "custom_class"
        return "ngram" if model in ("ngram", "[ngram]") else "draft_model"
    return "mtp" if method in _names(MTPModelTypes) else str(method)


def _names(literal: Any) -> set[str]:
    """The strings of a ``Literal`` type, nested ones included (vLLM's method names)."""
    args = typing.get_args(literal)
    return {a for a in args if isinstance(a, str)} | {n for a in args if not isinstance(a, str) for n in _names(a)}


def _runner() -> tuple[str | None, str | None]:
    """The model runner ``VLLM_USE_V2_MODEL_RUNNER`` forces, or None and what vLLM decides."""
    import vllm.envs as envs

    forced = envs.VLLM_USE_V2_MODEL_RUNNER
    if forced is not None:
        return ("v2" if forced else "v1"), None
    return None, ("model runner: V2 assumed, vLLM 0.33's default; it falls back to V1 for a feature V2 lacks "
                  "(VLLM_USE_V2_MODEL_RUNNER=0 forces V1)")


def _routed(plan: VllmPlan, settings: PluginSettings, tp: int, facts: FamilyFacts) -> VllmPlan:
    """``GRAPHFLOW_VLLM_ROUTED`` overrides the expert count, as in the plugin."""
    import attrs

    routed = frozenset(range(facts.layers)) if settings.routed.get("target") else frozenset()
    model = schematic_plan(plan.plan.name, [attrs.evolve(facts, routed_layers=routed)], tp_size=tp,
                           warmup=settings.warmup, capture=plan.plan.capture)
    return attrs.evolve(plan, plan=model)


def _groups(plan: VllmPlan) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str], list] = {}
    for d in plan.descriptors:
        groups.setdefault((d.family, d.mode.value), []).append(d)
    return [{"family": family, "mode": mode, "graphs": len(descs),
             "tokens": sorted({d.num_tokens for d in descs}),
             "uniform_query_len": sorted({d.uniform_query_len for d in descs if d.uniform_query_len is not None})}
            for (family, mode), descs in groups.items()]


def _document(serve_args: list[str], plan: VllmPlan, unknowns: list[str], settings: PluginSettings,
              report: Report) -> dict[str, Any]:
    return {
        "serve_args": serve_args,
        "runner": plan.runner,
        "cudagraph_mode": plan.cudagraph_mode,
        "uniform_decode_query_len": plan.uniform_decode_query_len,
        "graphs": len(plan.descriptors),
        "counts": {f"{family} {mode}": n for (family, mode), n in plan.counts().items()},
        "groups": _groups(plan),
        "descriptors": [str(d) for d in plan.descriptors],
        "unknowns": [*unknowns, *plan.unknowns],
        "settings": settings.described(),
        "findings": [str(d) for d in report.diagnostics],
        "ok": report.ok,
    }


def _print(serve_args: list[str], plan: VllmPlan, unknowns: list[str], settings: PluginSettings,
           report: Report) -> None:
    print(f"vllm serve {' '.join(serve_args)}")
    print(f"plan: model runner {plan.runner}, cudagraph_mode {plan.cudagraph_mode}, "
          f"uniform decode query length {plan.uniform_decode_query_len}: {len(plan.descriptors)} graphs")
    for group in _groups(plan):
        q = f", q={'/'.join(map(str, group['uniform_query_len']))}" if group["uniform_query_len"] else ""
        print(f"  {group['family']} {group['mode']}: {group['graphs']} graphs{q}, tokens "
              f"{', '.join(map(str, group['tokens']))}")
    print("cannot know:")
    for line in [*unknowns, *plan.unknowns]:
        print(f"  - {line}")
    print("plugin settings (environment):" + ("" if settings.enabled else " off (GRAPHFLOW_VLLM=1 turns it on)"))
    for name, value in settings.described().items():
        print(f"  {name}={value}")
    for diagnostic in report.diagnostics:
        print(diagnostic)
    print(f"findings: {len(report.errors)} error(s), {len(report.warnings)} warning(s)"
          + ("" if report.ok else ": the plugin would refuse this capture"))
