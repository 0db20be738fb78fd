"""``graphflow vllm check`` where vLLM is not installed: the command is listed, and says so in one line.

Its plans against the real vLLM parser are tests/vllm_plugin/test_vllm_check.py.
"""

import subprocess
import sys

from graphflow.cli import main

#: Runs the CLI as if vLLM were not installed, whether or not it is here.
WITHOUT_VLLM = "import sys; sys.modules['vllm'] = None; from graphflow.cli import main; sys.exit(main(sys.argv[1:]))"


def without_vllm(*args):
    return subprocess.run([sys.executable, "-c", WITHOUT_VLLM, *args], capture_output=True, text=True)


def test_the_vllm_command_is_listed_in_help(capsys):
    try:
        main(["--help"])
    except SystemExit:
        pass
    assert "vllm" in capsys.readouterr().out.split("positional arguments:")[1]


def test_check_without_vllm_is_one_line_and_exit_2():
    done = without_vllm("vllm", "check", "--", "Qwen/Qwen3-0.6B", "--max-num-seqs", "300")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("graphflow: vllm check: vLLM is not installed here")


def test_check_without_serve_arguments_says_how_to_give_them():
    done = without_vllm("vllm", "check")
    assert done.returncode == 2 and "give the arguments of 'vllm serve' after '--'" in done.stderr


def test_the_check_action_is_required():
    done = without_vllm("vllm")
    assert done.returncode == 2 and "Traceback" not in done.stderr
