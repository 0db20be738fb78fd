"""A server's FULL keys saved and restored (``serve(manager, graphs_from=...)``), on the CPU.

What the CPU can show: the regions the engine's tensors are saved as are named alike by
two engines built alike, and cover every tensor the plan adopts; a directory that cannot
be used is refused in one line and serving captures as without it, tokens unchanged; the
API's refusals. Building graphs from saved nodes, and their replay against the engine's
eager step, is for the GPU (``tests/cuda/test_cuda_hf_serving_restart.py``).
"""

from __future__ import annotations

import pytest
import torch

from graphflow.errors import PlanError
from graphflow.integrations.hf.batching import serve
from graphflow.integrations.hf.batching.restart import engine_tensors
from tests.serving_models import manager, prompts, quick_gc, run, shared  # noqa: F401 - quick_gc: a module fixture

pytest.importorskip("transformers")


def _processor(model):
    mgr = manager(model, 4)
    mgr.batch_processor = mgr._create_batch_processor()
    return mgr


def test_the_engines_tensors_are_named_alike_by_two_engines_built_alike():
    model = shared("llama")[0]
    one, two = (engine_tensors(_processor(model).batch_processor) for _ in range(2))
    assert [(name, tuple(t.shape), t.dtype) for name, t in one] == [(name, tuple(t.shape), t.dtype) for name, t in two]
    assert len({name for name, _ in one}) == len(one)
    processor = _processor(model).batch_processor
    named = {t.untyped_storage().data_ptr() for _, t in engine_tensors(processor)}
    io, cache = processor.inputs_and_outputs, processor.cache
    adopted = [io._bulk_input_tensor, io.write_index_storage, io.read_index_storage, io.output_ids,
               *cache.key_cache, *cache.value_cache]
    assert all(t.untyped_storage().data_ptr() in named for t in adopted)


def test_a_directory_that_cannot_be_used_is_refused_in_one_line_and_the_keys_are_captured(tmp_path, caplog):
    model = shared("llama")[0]
    reference = run(model, prompts(), 6, "fg").tokens
    result = run(model, prompts(), 6, "fg", serve_kwargs={"graphs_from": tmp_path / "none"})
    restart = result.serving.restart
    assert restart.refused == (f"saved graphs in {tmp_path / 'none'} not used ({tmp_path / 'none'} holds no saved "
                               "graphs (graphs.pickle missing)); capturing instead")
    assert restart.restored == 0 and result.tokens == reference
    assert f"restart: {restart.refused}" in result.serving.report()
    assert result.serving.coverage.as_dict()["graph_steps"] > 0


def test_saving_needs_graphs_recorded_on_a_gpu(tmp_path):
    model = shared("llama")[0]
    mgr = _processor(model)
    serving = serve(mgr)
    try:
        with pytest.raises(PlanError, match="saving graphs needs graphs recorded on a GPU; this engine runs on cpu"):
            serving.save_graphs(tmp_path)
    finally:
        serving.close()
    assert not any(tmp_path.iterdir())


def test_graphs_from_is_for_a_foreground_serve(tmp_path):
    mgr = _processor(shared("llama")[0])
    with pytest.raises(PlanError, match="graphs_from builds the saved keys before serving") as raised:
        serve(mgr, lazy=True, graphs_from=tmp_path)
    assert raised.value.element == "graphs_from"
    assert torch.is_tensor(mgr.batch_processor.inputs_and_outputs.output_ids)  # the engine untouched, still usable
