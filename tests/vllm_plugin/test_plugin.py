"""The plugin as vLLM loads it: the entry point, the switch, idempotence, a clean undo."""

import pytest

pytest.importorskip("vllm")

from graphflow.errors import CaptureError  # noqa: E402
from graphflow.integrations.vllm import plugin as module  # noqa: E402
from graphflow.integrations.vllm.settings import PluginSettings, SettingsError  # noqa: E402
from graphflow.plan import WarmupPolicy  # noqa: E402


def hooked():
    """The vLLM attributes the plugin wraps, as they are now."""
    from vllm.distributed.device_communicators.custom_all_reduce import CustomAllreduce
    from vllm.v1.worker import gpu_model_runner as v1
    from vllm.v1.worker.gpu import cudagraph_utils, model_runner as v2
    from vllm.v1.worker.gpu_worker import Worker

    return (CustomAllreduce.__dict__["custom_all_reduce"], v1.GPUModelRunner.__dict__["capture_model"],
            v1.GPUModelRunner.__dict__["profile_cudagraph_memory"], v2.GPUModelRunner.__dict__["capture_model"],
            cudagraph_utils.CudaGraphManager.__dict__["capture"], Worker.__dict__["shutdown"])


@pytest.fixture
def fresh_loader(monkeypatch):
    """vLLM's general-plugin loader, as in a process that has not loaded plugins yet."""
    import vllm.plugins

    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.delenv("VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY", raising=False)  # an enabled plugin adds to it
    yield vllm.plugins.load_general_plugins
    module.unregister()


def test_vllms_loader_finds_the_entry_point_and_the_switch_turns_it_on(fresh_loader, monkeypatch):
    original = hooked()
    monkeypatch.setenv("GRAPHFLOW_VLLM", "1")
    monkeypatch.setenv("VLLM_PLUGINS", "graphflow")  # vLLM's filter: only ours
    fresh_loader()
    assert module.registered() is not None
    now = hooked()
    assert all(a is not b for a, b in zip(original, now))
    assert now[0].__wrapped__ is original[0]


def test_without_the_switch_loading_changes_nothing(fresh_loader, monkeypatch):
    original = hooked()
    monkeypatch.delenv("GRAPHFLOW_VLLM", raising=False)
    fresh_loader()
    assert module.registered() is None and hooked() == original


def test_register_is_idempotent_and_unregister_restores_every_attribute(plugin):
    original = hooked()
    first = plugin()
    module.register()
    assert module.registered() is first
    assert len(first.patches) == len(hooked()) + 3  # and two drafters' dummy_run, the encoder's budget capture
    module.unregister()
    assert hooked() == original and module.registered() is None


def test_settings_are_read_per_family_and_bad_ones_name_the_variable():
    settings = PluginSettings.from_env({"GRAPHFLOW_VLLM": "1", "GRAPHFLOW_VLLM_WARMUP": "target=real,drafter=prepare",
                                        "GRAPHFLOW_VLLM_ON_FAILURE": "eager", "GRAPHFLOW_VLLM_TIMEOUT_S": "5"})
    assert settings.policy("target") is WarmupPolicy.REAL and settings.policy("drafter") is WarmupPolicy.PREPARE
    assert settings.policy("encoder") is WarmupPolicy.PLACEHOLDER and settings.on_failure == "eager"
    assert PluginSettings.from_env({"GRAPHFLOW_VLLM": "0", "GRAPHFLOW_VLLM_WARMUP": "bogus"}).enabled is False
    for env, text in [({"GRAPHFLOW_VLLM_WARMUP": "target=eager"}, "GRAPHFLOW_VLLM_WARMUP: unknown policy 'eager'"),
                      ({"GRAPHFLOW_VLLM_WARMUP": "draft=real"}, "unknown family 'draft'"),
                      ({"GRAPHFLOW_VLLM_TIMEOUT_S": "0"}, "GRAPHFLOW_VLLM_TIMEOUT_S='0'"),
                      ({"GRAPHFLOW_VLLM_DISABLE": "GF999"}, "unknown rule code(s) GF999"),
                      ({"GRAPHFLOW_VLLM_PREPARE": "nowhere"}, "is not 'package.module:function'")]:
        with pytest.raises(SettingsError, match=text.replace("(", r"\(").replace(")", r"\)")):
            PluginSettings.from_env({"GRAPHFLOW_VLLM": "1", **env})


def test_validation_errors_refuse_capture_before_any_graph(vllm_world, cpu_cuda, plugin):
    import harness
    from vllm.config import set_current_vllm_config

    config = harness.engine_config(max_num_seqs=4, max_num_batched_tokens=64,
                                   compilation_config={"cudagraph_num_of_warmups": 0})
    plugin()
    with set_current_vllm_config(config):
        runner = harness.standin_runner_cls()(config, model=harness.TinyMoE())
        config.compilation_config.cudagraph_num_of_warmups = 0  # vLLM sets 1 after init; a fork may not
        with pytest.raises(CaptureError, match="cudagraph_num_of_warmups = 0") as info:
            runner.capture_model()
    assert info.value.phase == "validate" and cpu_cuda.captures == 0 and runner.runs == []


def test_an_enabled_plugin_has_vllms_ray_launcher_copy_its_settings(plugin, monkeypatch):
    """vLLM's launcher of Ray engines copies only some prefixes; ``register`` in the driver adds ours."""
    from vllm.ray.ray_env import get_env_vars_to_copy

    monkeypatch.delenv("VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY", raising=False)
    monkeypatch.setenv("GRAPHFLOW_VLLM_WARMUP", "real")
    assert "GRAPHFLOW_VLLM_WARMUP" not in get_env_vars_to_copy()
    plugin()
    copied = get_env_vars_to_copy()
    assert {"GRAPHFLOW_VLLM", "GRAPHFLOW_VLLM_WARMUP"} <= copied
