"""``graphflow vllm check -- SERVE_ARGS...``: what vLLM will capture for a ``vllm serve`` line.

Before a deployment, without a GPU and without downloading the model: the argument list is
parsed by vLLM's own ``vllm serve`` parser (``make_arg_parser`` over a
``FlexibleArgumentParser``, then ``AsyncEngineArgs.from_cli_args``), so a flag vLLM
rejects is rejected here with vLLM's message; the settings that decide capture are then
handed to ``plan_from_vllm_config``, which applies vLLM 0.33's rules. The report lists the
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
import importlib.util
import json
import os
import pathlib
import sys
from typing import Any

from graphflow.cli import CommandError
from graphflow.integrations.vllm.config import plan_from_vllm_config
from graphflow.integrations.vllm.descriptors import VllmPlan
from graphflow.integrations.vllm.schematic import FamilyFacts, family_facts, schematic_plan
from graphflow.integrations.vllm.settings import PluginSettings, SettingsError
from graphflow.plan.rules import Report, validate

__all__ = ["run"]

#: What ``vllm serve`` picks on an H100/H200 (``EngineArgs.get_batch_defaults``, API server)
#: when the line does not say: assumed, and named in the unknowns.
_GPU_DEFAULTS = {"max_num_seqs": 1024, "max_num_batched_tokens": 8192}
_DEFAULTS_NOTE = ("{name}: not given; vLLM picks it from the GPU's memory ({value} on H100/H200 and larger, "
                  "smaller on smaller GPUs): assumed {value}")


def run(args: argparse.Namespace) -> int:
    """The command, on the arguments ``graphflow.cli.vllm_cmd`` parsed; the exit status."""
    serve_args = list(args.serve_args)
    if serve_args[:1] == ["--"]:
        serve_args = serve_args[1:]
    if not serve_args:
        raise CommandError("vllm check: give the arguments of 'vllm serve' after '--' "
                           "(graphflow vllm check -- MODEL --max-num-seqs 256)")
    try:
        settings = PluginSettings.from_env()
    except SettingsError as error:
        raise CommandError(f"vllm check: {error} (the plugin would stay off)") from error
    engine_args = _engine_args(serve_args)
    hf, hf_note = _hf_config(args.hf_config, str(engine_args.model))
    inputs, unknowns = _inputs(engine_args, hf)
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
        raise CommandError("vllm check: vLLM is not installed here (pip install 'graphflow[vllm]'): "
                           "the check parses the arguments with vLLM's own parser")
    try:
        _ensure_platform()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.common.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except Exception as error:  # a broken vLLM install: one line, not its traceback
        raise CommandError(f"vllm check: vLLM cannot be imported ({type(error).__name__}: {error})") from error

    class Parser(FlexibleArgumentParser):
        """``vllm serve``'s parser, raising its error instead of exiting."""

        def error(self, message: str):
            raise CommandError(f"vllm serve: {message}")

    parser = make_arg_parser(Parser(prog="vllm serve"))
    parsed = parser.parse_args(serve_args)
    if getattr(parsed, "model_tag", None):
        parsed.model = parsed.model_tag  # what 'vllm serve' itself does with the positional
    try:
        return AsyncEngineArgs.from_cli_args(parsed)
    except (TypeError, ValueError) as error:
        raise CommandError(f"vllm serve: {error}") from error


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
        raise CommandError(f"vllm check: --hf-config {path}: cannot read {file} ({error})") from error
    if not isinstance(config, dict):
        raise CommandError(f"vllm check: --hf-config {path}: {file} is not a JSON object")
    return config, None


def _inputs(engine_args: Any, hf: dict | None) -> tuple[dict[str, Any], list[str]]:
    """``plan_from_vllm_config``'s settings from vLLM's parsed arguments, and what was assumed."""
    compilation = engine_args.compilation_config
    spec = engine_args.speculative_config or {}
    unknowns: list[str] = []
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
    for name, value in _GPU_DEFAULTS.items():
        given = getattr(engine_args, name)
        if given is None:
            unknowns.append(_DEFAULTS_NOTE.format(name=name, value=value))
        inputs[name] = value if given is None else given
    if spec:
        inputs.update(num_speculative_tokens=spec.get("num_speculative_tokens"),
                      speculative_method=spec.get("method"),
                      num_speculative_tokens_per_batch_size=spec.get("num_speculative_tokens_per_batch_size"))
    if hf is not None:
        inputs["encoder_decoder"] = bool(hf.get("is_encoder_decoder", False))
    return inputs, unknowns


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
