"""Which ranks capture together, and how they agree on settings, without vLLM.

Ranks are threads sharing one in-memory c10d ``HashStore``; the real vLLM world (two
data-parallel engines over gloo) is tests/vllm_plugin/test_data_parallel.py.
"""

import time
import types

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from graphflow.errors import DivergenceError  # noqa: E402
from graphflow.integrations.vllm.group import EngineGroup, engine_group  # noqa: E402
from graphflow.integrations.vllm.session import CaptureSession  # noqa: E402
from graphflow.integrations.vllm.settings import RAY_PREFIXES_ENV, PluginSettings, carry_to_ray_workers  # noqa: E402
from rank_threads import run_threads  # noqa: E402


def parallel(world_size):
    return types.SimpleNamespace(world_size=world_size)


class TestEngineGroup:
    def test_each_dp_engine_is_its_block_of_the_world(self):
        # DP=2 x TP=2: vLLM's world has 4 ranks, an engine 2
        assert engine_group(0, 4, parallel(2)) == EngineGroup(0, (0, 1))
        assert engine_group(3, 4, parallel(2)) == EngineGroup(1, (2, 3))
        assert engine_group(5, 8, parallel(4)) == EngineGroup(1, (4, 5, 6, 7))

    def test_a_world_of_one_engine_is_the_whole_world(self):
        assert engine_group(1, 2, parallel(2)) == EngineGroup(0, (0, 1))  # no DP, or elastic EP's own world

    def test_a_layout_it_does_not_know_is_one_group(self):
        assert engine_group(2, 3, parallel(2)).members == (0, 1, 2)
        assert engine_group(0, 2, parallel(4)).members == (0, 1)

    def test_namespaces_differ_by_engine_and_generation_only(self):
        a, b = engine_group(0, 4, parallel(2)), engine_group(2, 4, parallel(2))
        assert a.namespace(1) == engine_group(1, 4, parallel(2)).namespace(1) == "graphflow-vllm/engine0/1"
        assert a.namespace(1) != b.namespace(1) and a.namespace(1) != a.namespace(2)


class TestSettings:
    def test_agreed_leaves_out_what_a_node_may_set_for_itself(self):
        settings = PluginSettings.from_env({"GRAPHFLOW_VLLM": "1", "GRAPHFLOW_VLLM_WARMUP": "target=real",
                                            "GRAPHFLOW_TRACE": "/tmp/t", "GRAPHFLOW_VLLM_ROUTED": "target"})
        described = settings.described()
        assert described["GRAPHFLOW_VLLM_WARMUP"] == "target=real,drafter=placeholder,encoder=placeholder"
        assert described["GRAPHFLOW_VLLM_ROUTED"] == "target" and described["GRAPHFLOW_TRACE"] == "/tmp/t"
        assert "GRAPHFLOW_TRACE" not in settings.agreed() and "GRAPHFLOW_VLLM_ANY_VERSION" not in settings.agreed()
        assert PluginSettings.from_env({"GRAPHFLOW_VLLM": "1", "GRAPHFLOW_TRACE": "/elsewhere"}).agreed() == \
            PluginSettings.from_env({"GRAPHFLOW_VLLM": "1"}).agreed()

    @pytest.mark.parametrize("before, after, changed", [
        ({}, "GRAPHFLOW_", True),
        ({RAY_PREFIXES_ENV: "MYLIB_"}, "MYLIB_,GRAPHFLOW_", True),
        ({RAY_PREFIXES_ENV: "GRAPHFLOW_"}, "GRAPHFLOW_", False),
        ({RAY_PREFIXES_ENV: "GRAPH"}, "GRAPH", False),  # a shorter prefix covers ours
    ])
    def test_ray_workers_are_given_the_graphflow_prefix_once(self, before, after, changed):
        env = dict(before)
        assert carry_to_ray_workers(env) is changed
        assert env[RAY_PREFIXES_ENV] == after


def sessions(world, settings_of, *, timeout_s=2.0, store=None, namespace="t", members=None):
    """Run ``agree_settings`` on each rank of ``members`` (default: all of ``world``)."""
    store = store if store is not None else dist.HashStore()
    members = tuple(range(world)) if members is None else members

    def body(index):
        rank = members[index]
        CaptureSession(rank=rank, world=members, store=store, timeout_s=timeout_s,
                       namespace=namespace).agree_settings(settings_of(rank))

    return run_threads(len(members), body, timeout_s=timeout_s)


class TestAgreeSettings:
    def test_the_same_settings_pass(self):
        assert all(e is None for e in sessions(3, lambda r: {"GRAPHFLOW_VLLM_WARMUP": "real"}).values())

    def test_a_differing_setting_is_named_on_every_rank_at_once(self):
        start = time.monotonic()
        errors = sessions(3, lambda r: {"GRAPHFLOW_VLLM_WARMUP": "placeholder" if r == 2 else "real",
                                        "GRAPHFLOW_VLLM_TIMEOUT_S": "60"}, timeout_s=20)
        assert time.monotonic() - start < 10  # not at the timeout
        for error in errors.values():
            assert isinstance(error, DivergenceError) and error.ranks == (2,)
            assert "GRAPHFLOW_VLLM_WARMUP is 'real' on rank(s) 0, 1 and 'placeholder' on rank(s) 2" in str(error)
            assert "TIMEOUT" not in error.message

    def test_a_rank_without_the_plugin_is_named_at_the_timeout(self):
        store = dist.HashStore()
        errors = {}

        def body(rank):
            if rank == 1:
                return  # its worker runs without the plugin: it never publishes
            try:
                CaptureSession(rank=0, world=(0, 1), store=store, timeout_s=1, namespace="t").agree_settings({"a": "1"})
            except DivergenceError as e:
                errors[rank] = e

        run_threads(2, body)
        error = errors[0]
        assert error.ranks == (1,) and "rank(s) 1 never started graphflow's capture within 1 s" in error.message
        assert "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY" in error.hint

    def test_two_engines_on_one_store_do_not_wait_for_each_other(self):
        store = dist.HashStore()
        for members in ((0, 1), (2, 3)):
            group = engine_group(members[0], 4, parallel(2))
            start = time.monotonic()
            errors = sessions(4, lambda r: {"a": "1"}, store=store, namespace=group.namespace(1), members=members,
                              timeout_s=5)
            assert all(e is None for e in errors.values()) and time.monotonic() - start < 2
