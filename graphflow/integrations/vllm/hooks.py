"""Where the plugin wraps vLLM 0.33, and what a capture changes that must come back.

vLLM has no capture callback, so the plugin wraps these methods (each named by its module
in the installed package; docs/vllm.md says what the plugin does in each, and what a
moved one does: ``register`` logs it and leaves vLLM running without the plugin):

* model runner V1 (``vllm.v1.worker.gpu_model_runner.GPUModelRunner``): ``capture_model``
  and ``profile_cudagraph_memory`` (a session each; capture as a transaction); for the
  session, on the runner *instance* (so a fork's subclass that overrides them is
  covered too), ``_warmup_and_capture`` (the descriptor) and ``_dummy_run`` (warmup or
  capture run: the phase boundaries); the drafters' ``dummy_run`` (family ``drafter``);
* model runner V2 (``vllm.v1.worker.gpu.model_runner.GPUModelRunner``): ``capture_model``
  (``profile_only`` is V2's profiling), ``CudaGraphManager.capture`` (its
  ``create_forward_fn``: descriptor, phase, family);
* the vision encoder's ``EncoderCudaGraphManager._capture_budget_graph`` (family
  ``encoder``);
* ``CustomAllreduce.custom_all_reduce`` (``graphflow.integrations.vllm.allreduce``);
* the GPU worker's ``shutdown`` (``vllm.v1.worker.gpu_worker.Worker``): vLLM's own end of
  an engine's worker, after which the plugin closes its trace (``Plugin.close_trace``).

``Patches`` applies them and undoes them exactly (the original attribute of each owner,
or its absence). ``transaction_for(runner)`` lists what capture changes in vLLM's state.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from graphflow.integrations.vllm.descriptors import VllmDescriptor, descriptor_from_vllm
from graphflow.integrations.vllm.transaction import CaptureTransaction
from graphflow.plan import Mode

__all__ = ["Patches", "install_hooks", "runner_hooks", "transaction_for"]

_MISSING = object()


@attrs.define
class Patches:
    """Attributes replaced on vLLM's classes, and how to put each back."""

    _applied: list[tuple[Any, str, Any]] = attrs.field(factory=list)

    def replace(self, owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
        original = owner.__dict__.get(name, _MISSING)
        current = getattr(owner, name)
        self._applied.append((owner, name, original))
        setattr(owner, name, make(current))

    def undo(self) -> None:
        while self._applied:
            owner, name, original = self._applied.pop()
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)

    def __len__(self) -> int:
        return len(self._applied)


def install_hooks(patches: Patches, plugin: Any) -> None:
    """Wrap vLLM's capture paths and its custom all-reduce for ``plugin`` (its ``Plugin``)."""
    from vllm.distributed.device_communicators.custom_all_reduce import CustomAllreduce
    from vllm.v1.worker import gpu_model_runner as v1
    from vllm.v1.worker.encoder_cudagraph import EncoderCudaGraphManager
    from vllm.v1.worker.gpu import cudagraph_utils as v2_graphs
    from vllm.v1.worker.gpu import model_runner as v2
    from vllm.v1.worker.gpu_worker import Worker

    from graphflow.integrations.vllm.allreduce import traced_custom_all_reduce

    patches.replace(CustomAllreduce, "custom_all_reduce", lambda f: traced_custom_all_reduce(f, plugin.active))
    runner1 = v1.GPUModelRunner
    patches.replace(runner1, "capture_model", lambda f: _session(plugin, f, "capture"))
    patches.replace(runner1, "profile_cudagraph_memory", lambda f: _session(plugin, f, "profile"))
    for proposer in _proposers():
        patches.replace(proposer, "dummy_run", lambda f: _family(plugin, f, "drafter"))
    patches.replace(v2.GPUModelRunner, "capture_model", lambda f: _session(plugin, f, "capture"))
    patches.replace(v2_graphs.CudaGraphManager, "capture", lambda f: _v2_manager(plugin, f))
    patches.replace(EncoderCudaGraphManager, "_capture_budget_graph", lambda f: _encoder_budget(plugin, f))
    patches.replace(Worker, "shutdown", lambda f: _closing_trace(plugin, f))


def _proposers() -> Iterator[type]:
    """V1 drafter classes that define their own ``dummy_run``."""
    import importlib

    for module, name in (("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer"),
                         ("vllm.v1.spec_decode.dflash", "DFlashProposer")):
        with contextlib.suppress(ImportError, AttributeError):
            cls = getattr(importlib.import_module(module), name)
            if "dummy_run" in cls.__dict__:
                yield cls


# -- the wrappers ------------------------------------------------------------------------------
def _session(plugin: Any, original: Callable, kind: str) -> Callable:
    @functools.wraps(original)
    def run(self, *args, **kwargs):
        profile = kind == "profile" or bool(kwargs.get("profile_only", False))
        return plugin.run_capture(self, lambda: original(self, *args, **kwargs), profile=profile)

    return run


@contextlib.contextmanager
def runner_hooks(runner: Any, plugin: Any) -> Iterator[None]:
    """For one session, V1's descriptor and phase hooks on the runner instance itself."""
    if not hasattr(runner, "cudagraph_dispatcher"):
        yield
        return
    bound = {"_warmup_and_capture": runner._warmup_and_capture, "_dummy_run": runner._dummy_run}
    q = getattr(runner.cudagraph_dispatcher, "uniform_decode_query_len", 1)

    def warmup_and_capture(desc, cudagraph_runtime_mode, *args, **kwargs):
        descriptor = descriptor_from_vllm("target", cudagraph_runtime_mode, desc, uniform_query_len=q)
        with plugin.at_descriptor(descriptor):
            return bound["_warmup_and_capture"](desc, cudagraph_runtime_mode, *args, **kwargs)

    def dummy_run(*args, **kwargs):
        if plugin.session.site.descriptor is None:
            return bound["_dummy_run"](*args, **kwargs)
        with plugin.phase("capture" if kwargs.get("is_graph_capturing") else "warmup"):
            return bound["_dummy_run"](*args, **kwargs)

    shadowed = {name: runner.__dict__[name] for name in bound if name in runner.__dict__}
    runner._warmup_and_capture, runner._dummy_run = warmup_and_capture, dummy_run
    try:
        yield
    finally:
        for name in bound:
            if name in shadowed:
                setattr(runner, name, shadowed[name])
            else:
                delattr(runner, name)


def _family(plugin: Any, original: Callable, family: str) -> Callable:
    @functools.wraps(original)
    def run(self, *args, **kwargs):
        state = plugin.active()
        if state is None:
            return original(self, *args, **kwargs)
        with state.session.at(family=family):
            return original(self, *args, **kwargs)

    return run


def _closing_trace(plugin: Any, original: Callable) -> Callable:
    @functools.wraps(original)
    def shutdown(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        finally:
            plugin.close_trace()

    return shutdown


def _v2_manager(plugin: Any, original: Callable) -> Callable:
    @functools.wraps(original)
    def capture(self, create_forward_fn, *args, **kwargs):
        state = plugin.active()
        if state is None:
            return original(self, create_forward_fn, *args, **kwargs)
        family = "target" if id(self) in state.target_managers else "drafter"

        def create(desc, warmup: bool):
            forward = create_forward_fn(desc, warmup)
            descriptor = descriptor_from_vllm(family, None, desc)

            def run(cg_mode):
                phase = "warmup" if warmup and getattr(cg_mode, "name", cg_mode) == "NONE" else "capture"
                with state.at_descriptor(descriptor), state.phase(phase):
                    return forward(cg_mode)

            return run

        return original(self, create, *args, **kwargs)

    return capture


def _encoder_budget(plugin: Any, original: Callable) -> Callable:
    @functools.wraps(original)
    def capture_budget(self, token_budget, *args, **kwargs):
        state = plugin.active()
        if state is None:
            return original(self, token_budget, *args, **kwargs)
        descriptor = VllmDescriptor("encoder", Mode.FULL, int(token_budget))
        with state.at_descriptor(descriptor), state.phase("capture"):
            return original(self, token_budget, *args, **kwargs)

    return capture_budget


# -- what capture changes ---------------------------------------------------------------------
def transaction_for(runner: Any) -> CaptureTransaction:
    """The undo steps of one ``capture_model`` call of ``runner`` (V1 or V2).

    Registered now, run newest first on rollback: capturing flag off (V1; V2's as it
    was), every wrapper's
    graphs and the managers' graphs cleared, V1 dispatcher keys cleared (drafter's too),
    pools and counters back, the collector re-enabled and unfrozen, and finally the
    device's cached memory handed back.
    """
    import torch
    from vllm.compilation import monitor
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphWrapper
    from vllm.compilation.counter import compilation_counter
    from vllm.compilation.cuda_graph import CUDAGraphWrapper
    from vllm.platforms import current_platform

    from graphflow.integrations.vllm.engine import runner_kind

    txn = CaptureTransaction(f"vLLM {runner_kind(runner).upper()} capture")

    def release_memory() -> None:
        with contextlib.suppress(RuntimeError, AssertionError):  # no device: nothing cached
            torch.accelerator.synchronize()
            torch.accelerator.empty_cache()

    txn.on_rollback("device memory released", release_memory)
    txn.keep_gc()
    txn.keep_attrs("compilation counters", compilation_counter, ("num_cudagraph_captured",
                                                                "num_gpu_runner_capture_triggers"))
    wrappers = list(CUDAGraphWrapper._all_instances) + list(BreakableCUDAGraphWrapper._all_instances)
    txn.keep_each("wrapper graph pools", wrappers, "graph_pool")
    platform = type(current_platform)
    txn.keep_attrs("global graph pool", platform, ("_global_graph_pool",))
    if runner_kind(runner) == "v1":
        for owner in (runner, getattr(runner, "drafter", None)):
            dispatcher = getattr(owner, "cudagraph_dispatcher", None)
            if dispatcher is not None:
                txn.clear_keys(f"{'drafter' if owner is not runner else 'target'} dispatcher keys", dispatcher)
    else:
        from graphflow.integrations.vllm.engine import graph_managers

        for family, manager in graph_managers(runner):
            txn.on_rollback(f"{family} graphs (CudaGraphManager)", manager.release_graphs)

    def clear_graphs() -> None:
        CUDAGraphWrapper.clear_all_graphs()
        BreakableCUDAGraphWrapper.clear_all_graphs()
        for encoder in _encoder_managers(runner):
            encoder.clear()

    txn.on_rollback("wrapper and encoder graphs", clear_graphs)
    if runner_kind(runner) == "v1":
        # V1 turns the flag on for its capture and off after it: off is its state afterwards.
        txn.on_rollback("capturing flag off", lambda: monitor.set_cudagraph_capturing_enabled(False))
    else:
        # V2 never touches it (its wrappers capture while it is on, as at import): as it was.
        txn.keep("capturing flag as before", lambda: monitor.cudagraph_capturing_enabled,
                 monitor.set_cudagraph_capturing_enabled)
    return txn


def _encoder_managers(runner: Any) -> Iterator[Any]:
    manager = getattr(runner, "encoder_cudagraph_manager", None)
    if manager is None:
        runner_ = getattr(getattr(runner, "model_state", None), "encoder_runner", None)
        manager = getattr(runner_, "cudagraph_manager", None)
    if manager is not None:
        yield manager
