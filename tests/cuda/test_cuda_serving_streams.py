"""Serving's eager-then-replay check on a real GPU, with the engine's step still running on
its compute stream when the check's own work is queued: the order of the two streams is
what is tested, so each step sleeps on the device before it writes, and queues nothing
that waits for the host: an index given as a Python list is copied to the device from
pageable memory, which waits for the stream, and would order the two streams by itself.

The engine here is the few tensors the check touches (its IO and cache objects carry many
more); the steps are plain writes on the compute stream, as the engine's are.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.cuda

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from graphflow.integrations.hf.batching.capture import eager_then_replay

#: Device cycles a step sleeps before it writes: tens of milliseconds, far longer than the
#: host takes to queue everything after it.
SLEEP = 50_000_000
SLOTS = [5, 9, 13, 17]


def _engine():
    stream = torch.cuda.Stream()
    index = torch.zeros(1, 8, dtype=torch.long, device="cuda")
    index[0, :4] = torch.tensor(SLOTS)
    io = SimpleNamespace(compute_stream=stream, use_block_table=False, num_q_tokens=len(SLOTS),
                         write_index_storage=index, output_ids=torch.zeros(1, 4, dtype=torch.long, device="cuda"))
    cache = SimpleNamespace(key_cache=[torch.zeros(64, 2, 4, device="cuda")],
                            value_cache=[torch.zeros(64, 2, 4, device="cuda")])
    slots = torch.tensor(SLOTS, device="cuda")
    torch.cuda.synchronize()
    return SimpleNamespace(inputs_and_outputs=io, cache=cache, slots=slots)


def _step(processor, token: int, kv: float):
    """A step that writes its KV slots and its output tokens late, on the compute stream."""
    io, cache = processor.inputs_and_outputs, processor.cache

    def run() -> None:
        with torch.cuda.stream(io.compute_stream):
            torch.cuda._sleep(SLEEP)
            for tensor in (*cache.key_cache, *cache.value_cache):
                tensor.index_fill_(0, processor.slots, kv)
            io.output_ids.fill_(token)

    return run


def test_a_wrong_replay_is_caught_though_both_steps_write_late():
    processor = _engine()
    out = processor.inputs_and_outputs.output_ids
    differ = eager_then_replay(processor, _step(processor, 7, 1.0), _step(processor, 8, 1.0), lambda: out)
    assert differ == ([8] * 4, [7] * 4)
    assert out.tolist() == [[7] * 4]  # the step serves the eager tokens


def test_the_eager_step_s_kv_stays_in_its_slots_when_the_memory_is_reused_at_once():
    """Right after the check, the process allocates and fills small tensors on its own
    stream (the next batch's, say): none of them may be what the check's last write still
    reads, or that write goes to other slots."""
    processor = _engine()
    out = processor.inputs_and_outputs.output_ids
    assert eager_then_replay(processor, _step(processor, 7, 1.0), _step(processor, 7, 2.0), lambda: out) is None
    grabbed = [torch.zeros(len(SLOTS), dtype=torch.long, device="cuda") for _ in range(256)]
    torch.cuda.synchronize()
    for tensor in (*processor.cache.key_cache, *processor.cache.value_cache):
        assert tensor[SLOTS].eq(1.0).all()  # the eager step's KV, not the replay's
        others = torch.ones(tensor.shape[0], dtype=torch.bool, device="cuda")
        others[SLOTS] = False
        assert tensor[others].eq(0.0).all()
    del grabbed
