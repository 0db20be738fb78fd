"""``graphflow vllm check -- SERVE_ARGS...``: the graphs vLLM will capture for a serve line.

No GPU and no model download: vLLM's own ``vllm serve`` parser reads the arguments, and
graphflow's vLLM integration predicts the capture from them
(``graphflow.integrations.vllm.check`` says how). Prints the descriptors per family and
mode, what the prediction cannot know, the plugin's settings from the environment and
graphflow's findings; ``--json`` prints the same as one document. Exit status: 0 clean,
1 the plugin would refuse this capture, 2 vLLM is not importable here or rejects the
arguments, or a setting or file cannot be read.

The command line sits above the integrations in graphflow's layers: this module declares
the command, imports the integration that does its work only when it runs (so other
commands load none of it), and turns the integration's ``CheckError`` into the command's
one line and exit status 2 (the integration does not import the command line).
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
              "[--gpu-memory-gib G] -- MODEL [vllm serve options]")
    check.add_argument("--json", action="store_true", help="print one JSON document")
    check.add_argument("--hf-config", metavar="PATH",
                       help="the model's Hugging Face config.json (or a directory holding one): layers, experts, "
                            "encoder-decoder; without it, and without a local model directory, they are unknown")
    check.add_argument("--attention-support", type=str.upper, metavar="S",
                       help="the attention backends' FULL-graph support when known: NEVER, "
                            "UNIFORM_SINGLE_TOKEN_DECODE, UNIFORM_BATCH or ALWAYS (default: assumed ALWAYS)")
    check.add_argument("--device-capability", type=int, default=90, metavar="N",
                       help="the GPU's compute capability as vLLM writes it (90 Hopper, 100 Blackwell; default 90)")
    check.add_argument("--gpu-memory-gib", type=float, default=80, metavar="G",
                       help="one GPU's memory in GiB, from which vllm serve picks max_num_batched_tokens and "
                            "max_num_seqs when the line leaves them out (default 80, an H100; 141 H200, 180 B200)")
    check.add_argument("serve_args", nargs=argparse.REMAINDER, metavar="-- SERVE_ARGS",
                       help="the arguments of 'vllm serve', after '--'")
    check.set_defaults(func=run_check)


def run_check(args: argparse.Namespace) -> int:
    import graphflow.integrations.vllm.check as check
    from graphflow.cli import CommandError

    try:
        return check.run(args)
    except check.CheckError as error:
        raise CommandError(str(error)) from error
