"""``graphflow vllm check -- SERVE_ARGS...``: the graphs vLLM will capture for a serve line.

No GPU and no model download: vLLM's own ``vllm serve`` parser reads the arguments, and
graphflow's vLLM integration predicts the capture from them
(``graphflow.integrations.vllm.check`` says how). Prints the descriptors per family and
mode, what the prediction cannot know, the plugin's settings from the environment and
graphflow's findings; ``--json`` prints the same as one document. Exit status: 0 clean,
1 the plugin would refuse this capture, 2 vLLM is not importable here or rejects the
arguments, or a setting or file cannot be read.

The command line sits below the integrations in graphflow's layers: this module only
declares the command, and imports the integration that does its work when it runs (one
of the two upward imports tests/test_architecture.py allows, by name).
"""

from __future__ import annotations

import argparse

__all__ = ["register"]


def register(subparsers) -> None:
    parser = subparsers.add_parser("vllm", help="vLLM: what it will capture for a 'vllm serve' line",
                                   description="graphflow's vLLM integration (docs/vllm.md).")
    actions = parser.add_subparsers(dest="vllm_command", metavar="ACTION")
    actions.required = True
    check = actions.add_parser(
        "check", help="print the graphs vLLM will capture, what that cannot know, and the plugin's settings",
        description=__doc__.split("\n\n", 2)[1], formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="graphflow vllm check [--json] [--hf-config PATH] [--attention-support S] [--device-capability N] "
              "-- MODEL [vllm serve options]")
    check.add_argument("--json", action="store_true", help="print one JSON document")
    check.add_argument("--hf-config", metavar="PATH",
                       help="the model's Hugging Face config.json (or a directory holding one): layers, experts, "
                            "encoder-decoder; without it, and without a local model directory, they are unknown")
    check.add_argument("--attention-support", type=str.upper, metavar="S",
                       help="the attention backends' FULL-graph support when known: NEVER, "
                            "UNIFORM_SINGLE_TOKEN_DECODE, UNIFORM_BATCH or ALWAYS (default: assumed ALWAYS)")
    check.add_argument("--device-capability", type=int, default=90, metavar="N",
                       help="the GPU's compute capability as vLLM writes it (90 Hopper, 100 Blackwell; default 90)")
    check.add_argument("serve_args", nargs=argparse.REMAINDER, metavar="-- SERVE_ARGS",
                       help="the arguments of 'vllm serve', after '--'")
    check.set_defaults(func=run_check)


def run_check(args: argparse.Namespace) -> int:
    import graphflow.integrations.vllm.check as check

    return check.run(args)
