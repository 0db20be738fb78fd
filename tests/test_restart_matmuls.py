"""The multiplications a saving run records, and their replay on scratch tensors of the
same layouts (what a restart runs to load a matrix library's kernels; on the GPU in
``tests/cuda/test_cuda_restart.py``)."""

from __future__ import annotations

import torch

from graphflow.engine.restart import saved, store
from graphflow.engine.restart.matmuls import Recorder, alignment, run


def _step(x: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
    """Multiplications of the inputs and views of them only: a fresh tensor's alignment
    is the CPU allocator's to choose, and two runs would record two layouts."""
    h = linear(x)  # addmm
    scores = torch.bmm(x.view(2, 3, 8), x.view(2, 3, 8).transpose(1, 2))
    return h.sum() + scores.relu().sum() + (x[1:] @ x[1:].T).sum()  # mm on a view one row in


def test_each_distinct_multiplication_is_recorded_once_with_its_layout():
    recorder, linear, x = Recorder(), torch.nn.Linear(8, 16), torch.randn(6, 8)
    recorder.recording(lambda: _step(x, linear))()
    recorder.recording(lambda: _step(x, linear))()
    found = recorder.taken()
    assert [m.operator for m in found] == ["addmm.default", "bmm.default", "mm.default"]
    mm = found[2]
    assert mm.args[0] == saved.TensorLayout((5, 8), (8, 1), "float32", alignment(x.data_ptr() + 32))
    assert mm.args[1].stride == (1, 8)  # the transpose, as the library sees it
    assert recorder.taken() == ()  # taken starts afresh


def test_an_address_is_aligned_to_the_largest_power_of_two_dividing_it_up_to_256_bytes():
    assert [alignment(a) for a in (0x7F00_0000_0000, 0x7F00_0000_0100, 0x7F00_0000_0080, 0x7F00_0000_0022)] == [
        256, 256, 128, 2]


def test_a_replay_runs_each_multiplication_on_tensors_of_its_recorded_layout():
    """Recorded again, the replay's calls are the recorded ones: shapes, strides, dtypes
    and addresses as far past an alignment boundary as the originals."""
    recorder, linear, x = Recorder(), torch.nn.Linear(8, 16), torch.randn(6, 8)
    recorder.recording(lambda: _step(x, linear))()
    found = recorder.taken()
    recorder.recording(lambda: run(found, torch.device("cpu"), None))()
    assert recorder.taken() == found


def test_recorded_multiplications_are_saved_and_read_back(tmp_path):
    layout = saved.TensorLayout((4, 8), (8, 1), "bfloat16", 32)
    matmul = saved.Matmul("mm.default", (layout, layout), (("out_dtype", "torch.float32"),))
    run_ = saved.SavedRun({"gpu": "a"}, {}, (saved.SavedDescriptor(4, "FULL", (), (), (matmul,)),))
    store.write(run_, tmp_path)
    assert store.load(tmp_path).descriptors[0].matmuls == (matmul,)


def test_scratch_tensors_hold_zeros():
    """A grouped multiplication reads its groups' offsets from a tensor: garbage there
    would read out of bounds."""
    from graphflow.engine.restart.matmuls import _scratch

    for align in (4, 16, 64, 256):
        tensor = _scratch(saved.TensorLayout((3, 5), (1, 3), "int32", align), torch.device("cpu"))
        assert tensor.shape == (3, 5) and tensor.stride() == (1, 3) and not tensor.any()
        assert alignment(tensor.data_ptr()) == align


def test_recording_leaves_torch_compile_compiling():
    """A dispatch mode torch.compile does not know of makes it skip a frame for good;
    recording tells it to look through."""
    runs = []

    def backend(graph_module, example_inputs):
        def compiled(*args):
            runs.append(1)
            return graph_module.forward(*args)

        return compiled

    @torch.compile(backend=backend)
    def step(x, w):
        return torch.relu(x @ w)

    x, w = torch.randn(4, 8), torch.randn(8, 8)
    step(x, w)
    recorder = Recorder()
    recorder.recording(lambda: step(x, w))()
    step(x, w)
    assert len(runs) == 3 and [m.operator for m in recorder.taken()] == ["mm.default"]
