"""The plugin as a team deploys it: vLLM's reading of switches, settings and versions that
leave it off without stopping vLLM, and its lines in vLLM's log."""

import logging
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("vllm")


from graphflow.errors import CaptureError  # noqa: E402
from graphflow.integrations.vllm import plugin as module  # noqa: E402
from graphflow.integrations.vllm.logs import LOGGER  # noqa: E402
from graphflow.integrations.vllm.settings import RAY_PREFIXES_ENV, PluginSettings  # noqa: E402
from standins import TINY_MODELS  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def hooked():
    from vllm.distributed.device_communicators.custom_all_reduce import CustomAllreduce
    from vllm.v1.worker import gpu_model_runner as v1

    return CustomAllreduce.__dict__["custom_all_reduce"], v1.GPUModelRunner.__dict__["capture_model"]


@pytest.fixture
def load(monkeypatch):
    """vLLM's general-plugin loader, as in a fresh process, with only graphflow's plugin."""
    import vllm.plugins

    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.setenv("VLLM_PLUGINS", "graphflow")
    for name in ("WARMUP", "ANY_VERSION"):
        monkeypatch.delenv(f"GRAPHFLOW_VLLM_{name}", raising=False)
    monkeypatch.delenv(RAY_PREFIXES_ENV, raising=False)  # what an enabled plugin sets

    def run(**env):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        vllm.plugins.load_general_plugins()
        return module.registered()

    yield run
    module.unregister()


def lines(log, level="DEBUG"):
    return [r.getMessage() for r in log.records if r.name == LOGGER and r.levelno >= logging.getLevelName(level)]


@pytest.mark.parametrize("value", ["1", "true", "TRUE", " True "])
def test_switches_read_as_vllm_reads_its_own_flags_on(value):
    assert PluginSettings.from_env({"GRAPHFLOW_VLLM": value}).enabled
    assert PluginSettings.from_env({"GRAPHFLOW_VLLM": "1", "GRAPHFLOW_VLLM_ANY_VERSION": value}).any_version


@pytest.mark.parametrize("value", ["", "0", "false", "False", "yes"])
def test_switches_read_as_vllm_reads_its_own_flags_off(value):
    assert not PluginSettings.from_env({"GRAPHFLOW_VLLM": value}).enabled


def test_true_turns_it_on_through_vllms_loader(load):
    assert load(GRAPHFLOW_VLLM="true") is not None


def test_a_bad_setting_logs_one_line_and_leaves_vllm_running_without_the_plugin(load, plugin_log):
    original = hooked()
    with plugin_log.at_level("INFO", logger=LOGGER):
        assert load(GRAPHFLOW_VLLM="1", GRAPHFLOW_VLLM_WARMUP="bogus") is None
    assert hooked() == original
    (line,) = lines(plugin_log)
    assert "GRAPHFLOW_VLLM_WARMUP" in line and "'bogus'" in line and "real, prepare, placeholder" in line
    assert line.endswith("plugin off") and "\n" not in line
    assert RAY_PREFIXES_ENV not in os.environ


def test_another_vllm_version_stays_off_with_one_line(load, plugin_log, monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.34.1")
    original = hooked()
    with plugin_log.at_level("INFO", logger=LOGGER):
        assert load(GRAPHFLOW_VLLM="1") is None
    assert hooked() == original
    (line,) = lines(plugin_log)
    assert "vLLM 0.34.1 is not 0.33.x" in line and "plugin off" in line and "GRAPHFLOW_VLLM_ANY_VERSION=1" in line
    assert RAY_PREFIXES_ENV not in os.environ  # a plugin that stays off sets nothing


def test_another_vllm_version_is_tried_with_the_opt_in(load, plugin_log, monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.34.1")
    with plugin_log.at_level("INFO", logger=LOGGER):
        assert load(GRAPHFLOW_VLLM="1", GRAPHFLOW_VLLM_ANY_VERSION="1") is not None
    warning, ray, enabled = lines(plugin_log)
    assert "trying anyway" in warning and "plugin enabled on vLLM 0.34.1" in enabled
    assert f"added GRAPHFLOW_ to {RAY_PREFIXES_ENV}" in ray


def test_an_attribute_another_vllm_moved_is_one_line_and_every_wrap_undone(load, plugin_log, monkeypatch):
    from vllm.v1.worker.gpu import cudagraph_utils

    monkeypatch.delattr(cudagraph_utils.CudaGraphManager, "capture")  # wrapped after the others
    original = hooked()
    with plugin_log.at_level("INFO", logger=LOGGER):
        assert load(GRAPHFLOW_VLLM="1") is None
    assert hooked() == original
    (line,) = lines(plugin_log)
    assert line.startswith("graphflow[rank ") and "cannot wrap vLLM 0.33" in line and "AttributeError" in line
    assert "plugin off" in line and RAY_PREFIXES_ENV not in os.environ


@pytest.mark.parametrize("env, version, expected", [
    ({"GRAPHFLOW_VLLM": "1"}, None, [r"INFO .*\] graphflow\[rank \S+\]: added GRAPHFLOW_ to " + RAY_PREFIXES_ENV,
                                     r"INFO .*\] graphflow\[rank \S+\]: vLLM plugin enabled on vLLM 0\.33"]),
    ({"GRAPHFLOW_VLLM": "1", "GRAPHFLOW_VLLM_WARMUP": "bogus"}, None,
     [r"ERROR .*\] graphflow\[rank \S+\]: GRAPHFLOW_VLLM_WARMUP: unknown policy 'bogus'.*; plugin off"]),
    ({"GRAPHFLOW_VLLM": "1"}, "0.34.1",
     [r"WARNING .*\] graphflow\[rank \S+\]: vLLM 0\.34\.1 is not 0\.33\.x.*plugin off"]),
], ids=["enabled", "bad-setting", "other-version"])
def test_start_up_lines_wait_for_vllms_logging_and_show_in_its_format(load, vllm_logging_later, capsys, monkeypatch,
                                                                      env, version, expected):
    """``vllm serve`` loads general plugins while it builds its parser, before it sets its
    logging up: the plugin's first lines come out with vLLM's first lines, formatted as
    they are, and only once."""
    import vllm

    if version:
        monkeypatch.setattr(vllm, "__version__", version)
    load(**env)
    before = capsys.readouterr()
    assert "graphflow" not in before.out + before.err  # not printed bare (Python's last-resort handler)
    out = vllm_logging_later()
    shown = [line for line in out.splitlines() if "graphflow[" in line]
    assert len(shown) == len(expected), out
    for line, pattern in zip(shown, expected):
        assert re.match(r"\(\S+ pid=\d+\) " + pattern, line), line
        assert "[plugin.py:" in line
    assert out.splitlines()[len(expected)].endswith("vLLM's first line after its logging set-up")


def test_vllm_serve_shows_the_first_line_in_each_process_that_runs_the_plugin(tmp_path):
    """vLLM's own CLI entry: the API server process logs the plugin's lines once its logging is
    set up, and the engine core it forks (a library user's default; ``vllm serve`` spawns unless
    ``VLLM_WORKER_MULTIPROC_METHOD`` says otherwise) logs its own "plugin enabled" line,
    although a forked process never loads general plugins again."""
    env = {**os.environ, "GRAPHFLOW_VLLM": "1", "VLLM_LOGGING_LEVEL": "INFO", "VLLM_WORKER_MULTIPROC_METHOD": "fork",
           "VLLM_PLUGINS": "graphflow", "NO_COLOR": "1"}
    env.pop(RAY_PREFIXES_ENV, None)
    done = subprocess.run([sys.executable, os.path.join(HERE, "serve_cli.py"), "serve", str(TINY_MODELS / "llama-tiny"),
                           "--max-model-len", "64", "--skip-tokenizer-init"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode != 0 and "Engine core initialization failed" in out, out[-3000:]  # no device here
    ours = [line for line in out.splitlines() if "graphflow[" in line]
    by_process = {}
    for line in ours:
        found = re.match(r"\((\S+) pid=(\d+)\) INFO \d\d-\d\d [\d:]+ \[plugin\.py:\d+\] graphflow\[rank -\]: (.*)$", line)
        assert found, line
        by_process.setdefault((found[1], found[2]), []).append(found[3])
    (server, server_lines), (core, core_lines) = by_process.items()
    assert server[0] == "APIServer" and core[0] == "EngineCore" and server[1] != core[1], ours
    ray, enabled = server_lines
    assert ray.startswith(f"added GRAPHFLOW_ to {RAY_PREFIXES_ENV}") and enabled.startswith("vLLM plugin enabled on")
    assert core_lines == [enabled]  # the Ray line once: the engine core inherits the variable


def test_lines_go_through_vllms_handler_with_time_and_rank(vllm_world, vllm_output, plugin):
    plugin()
    ray, line = [line for line in vllm_output.getvalue().splitlines() if "graphflow" in line]
    assert re.search(r" INFO .* graphflow\[rank 0\]: added GRAPHFLOW_ to VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY", ray)
    assert re.search(r" INFO \d\d-\d\d \d\d:\d\d:\d\d \[\S*plugin\.py:\d+\] graphflow\[rank 0\]: "
                     r"vLLM plugin enabled on vLLM 0\.33\.\d", line), line


def test_a_failure_in_raise_mode_is_logged_with_v2s_flag_as_it_was(runner_v2, plugin, plugin_log):
    plugin()
    runner_v2.fail_at = ("FULL", 2)
    with plugin_log.at_level("ERROR", logger=LOGGER), pytest.raises(CaptureError) as info:
        runner_v2.capture_model()
    (line,) = lines(plugin_log, "ERROR")
    assert line.startswith("graphflow[rank 0]: ") and info.value.message in line
    assert "capturing flag as it was" in info.value.hint and "flag off" not in info.value.hint


def test_start_up_lines_held_in_a_process_without_vllms_logging_come_before_its_capture(runner, plugin, plugin_log,
                                                                                         monkeypatch):
    """A process where vLLM never set its logging up (a script driving vLLM's internals)
    still says the plugin is on, before its first capture's lines."""
    import vllm.logger

    monkeypatch.setattr(vllm.logger, "_last_configured_logging_config", None)
    with plugin_log.at_level("INFO", logger=LOGGER):
        plugin()
        assert lines(plugin_log) == []
        runner.capture_model()
    ray, enabled, *_, captured = lines(plugin_log)
    assert "added GRAPHFLOW_" in ray and "vLLM plugin enabled" in enabled and "captured 7 graphs" in captured
