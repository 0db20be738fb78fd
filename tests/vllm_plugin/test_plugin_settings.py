"""The plugin as a team deploys it: vLLM's reading of switches, settings and versions that
leave it off without stopping vLLM, and its lines in vLLM's log."""

import logging
import re

import pytest

pytest.importorskip("vllm")


from graphflow.errors import CaptureError  # noqa: E402
from graphflow.integrations.vllm import plugin as module  # noqa: E402
from graphflow.integrations.vllm.logs import LOGGER  # noqa: E402
from graphflow.integrations.vllm.settings import PluginSettings  # noqa: E402


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


def test_another_vllm_version_stays_off_with_one_line(load, plugin_log, monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.34.1")
    original = hooked()
    with plugin_log.at_level("INFO", logger=LOGGER):
        assert load(GRAPHFLOW_VLLM="1") is None
    assert hooked() == original
    (line,) = lines(plugin_log)
    assert "vLLM 0.34.1 is not 0.33.x" in line and "plugin off" in line and "GRAPHFLOW_VLLM_ANY_VERSION=1" in line


def test_another_vllm_version_is_tried_with_the_opt_in(load, plugin_log, monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.34.1")
    with plugin_log.at_level("INFO", logger=LOGGER):
        assert load(GRAPHFLOW_VLLM="1", GRAPHFLOW_VLLM_ANY_VERSION="1") is not None
    warning, enabled = lines(plugin_log)
    assert "trying anyway" in warning and "plugin enabled on vLLM 0.34.1" in enabled


def test_an_attribute_another_vllm_moved_is_one_line_and_every_wrap_undone(load, plugin_log, monkeypatch):
    from vllm.v1.worker.gpu import cudagraph_utils

    monkeypatch.delattr(cudagraph_utils.CudaGraphManager, "capture")  # wrapped after the others
    original = hooked()
    with plugin_log.at_level("INFO", logger=LOGGER):
        assert load(GRAPHFLOW_VLLM="1") is None
    assert hooked() == original
    (line,) = lines(plugin_log)
    assert line.startswith("graphflow[rank ") and "cannot wrap vLLM 0.33" in line and "AttributeError" in line
    assert "plugin off" in line


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
