"""The vLLM tests: the real vllm 0.33.0 package on CPUs, in the venv of scripts/vllm_env.sh.

Where vLLM is not installed (the main test venv) every module here skips itself. Where it
is, the GPU stand-ins of ``standins.py`` are set up before anything imports vLLM's
platform, and the helpers of this folder are importable by name.
"""

import importlib.util
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

_spec = importlib.util.find_spec("vllm")
if _spec is not None and _spec.origin is not None:  # the package, not a folder named vllm on the path
    sys.path.insert(0, HERE)
    import standins

    standins.setup()


@pytest.fixture
def cpu_cuda():
    """torch.cuda streams, capture state and graphs on the CPU (standins.CpuCuda)."""
    import standins

    with standins.CpuCuda().installed() as fake:
        yield fake


@pytest.fixture(scope="session")
def vllm_world():
    """vLLM's distributed state for this process: a world of one rank over gloo."""
    import socket

    import harness

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    harness.init_distributed(harness.engine_config(max_num_seqs=4, max_num_batched_tokens=64), port=port)


@pytest.fixture
def plugin(monkeypatch):
    """graphflow's plugin, registered with the test's GRAPHFLOW_VLLM_* settings; unregistered after."""
    from graphflow.integrations.vllm import plugin as module

    def register(**env):
        monkeypatch.setenv("GRAPHFLOW_VLLM", "1")
        monkeypatch.delenv("VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY", raising=False)  # register adds to it
        for name, value in env.items():
            monkeypatch.setenv(f"GRAPHFLOW_VLLM_{name.upper()}", str(value))
        module.register()
        return module.registered()

    yield register
    module.unregister()


@pytest.fixture
def vllm_output(monkeypatch):
    """vLLM's logging as each of its processes configures it (its ``vllm`` logger and
    handler, not propagating), at INFO: yields what that handler writes; undone after."""
    import io
    import logging

    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging

    vllm_logger = logging.getLogger("vllm")
    monkeypatch.setattr(vllm_logger, "handlers", [])
    for name in ("propagate", "level"):
        monkeypatch.setattr(vllm_logger, name, getattr(vllm_logger, name))
    factory = logging.getLogRecordFactory()
    configure_logging(LoggingConfig(log_level="INFO", configure_logging=True, pylogging_config_file=None))
    (handler,) = vllm_logger.handlers
    handler.setStream(io.StringIO())
    yield handler.stream
    logging.setLogRecordFactory(factory)
    logging.getLogger("vllm.graphflow").manager._clear_cache()


@pytest.fixture
def vllm_logging_later(monkeypatch, capsys):
    """This process as vLLM's CLI starts it: vLLM's logging not set up yet (``vllm serve``
    loads general plugins while it builds its parser, then sets logging up from the parsed
    arguments). Yields that set-up, ``configure_logging_from_args`` at INFO, which returns
    what vLLM's handler wrote to stdout, its default stream; undone after."""
    import logging
    import types

    import vllm.logger
    from vllm.config.logging import LoggingConfig

    vllm_logger = logging.getLogger("vllm")
    monkeypatch.setattr(vllm_logger, "handlers", [])
    for name in ("propagate", "level"):
        monkeypatch.setattr(vllm_logger, name, getattr(vllm_logger, name))
    monkeypatch.setattr(vllm.logger, "_last_configured_logging_config", None)
    factory = logging.getLogRecordFactory()

    def configure() -> str:
        capsys.readouterr()
        config = LoggingConfig(log_level="INFO", configure_logging=True, pylogging_config_file=None)
        vllm.logger.configure_logging_from_args(types.SimpleNamespace(logging_config=config))
        logging.getLogger("vllm.entrypoints.cli.main").info("vLLM's first line after its logging set-up")
        return capsys.readouterr().out

    yield configure
    logging.setLogRecordFactory(factory)
    logging.getLogger("vllm.graphflow").manager._clear_cache()


@pytest.fixture
def plugin_log(caplog, vllm_output):
    """caplog under vLLM's logging: pytest hands its handler to the loggers that do not
    propagate (vLLM's, and so the plugin's, a child of it) when the test starts."""
    return caplog


@pytest.fixture
def runner(vllm_world, cpu_cuda):
    """A V1 model runner of vLLM's own class, on the stand-in model (``harness``)."""
    import harness
    from vllm.config import set_current_vllm_config

    config = harness.engine_config(max_num_seqs=4, max_num_batched_tokens=64)
    with set_current_vllm_config(config):
        yield harness.standin_runner_cls()(config, model=harness.TinyMoE())


@pytest.fixture
def runner_v2(vllm_world, cpu_cuda):
    """A V2 runner (its config reconfigures vLLM's logging: made before ``plugin_log``)."""
    import harness
    from vllm.compilation import monitor
    from vllm.config import set_current_vllm_config

    monitor.set_cudagraph_capturing_enabled(True)  # as in a fresh process: V2 never turns it on itself
    config = harness.engine_config(max_num_seqs=4, max_num_batched_tokens=64)
    with set_current_vllm_config(config):
        yield harness.standin_v2_runner_cls()(config, model=harness.TinyMoE())
