"""``vllm ARGS...`` as vLLM's console script runs it (``vllm.entrypoints.cli.main.main``: its
parser, which loads the general plugins, then its logging set-up, then the command), on the
GPU stand-ins of ``standins.py``.

Usage: python serve_cli.py serve MODEL [OPTIONS]. With ``VLLM_WORKER_MULTIPROC_METHOD=fork``
the engine core is forked from this process, as a library user's is; it then fails where it
needs a device (there is none), and ``vllm serve`` exits.
"""

import os
import sys

if __name__ == "__main__":  # a spawned child imports this file again
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import standins

    standins.setup()
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    main()
