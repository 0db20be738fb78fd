"""Capture-safety detectors on a real GPU, inside ``torch.cuda.graph`` capture.

Every capture runs on a fresh stream (a failed capture invalidates its stream), and
``captured`` leaves the device clean: not capturing, the caller's stream current.
A hazard that makes capture fail must still be recorded, before the failing op runs,
so the engine can name it in its error.
"""

from __future__ import annotations

import pytest
import torch

from graphflow.engine.detectors import Check, Detectors
from graphflow.events import Phase
from tests.source_markers import marked

pytestmark = pytest.mark.cuda

at = marked(__file__)

CUDA = torch.device("cuda:0")


def captured(det: Detectors, segment_fn, segment: str = "g"):
    """Capture ``segment_fn`` under ``det.watch`` on a fresh stream.

    Returns (graph, error): the error the capture raised, or None. Whatever happened,
    the device is left not capturing and on the stream it was on.
    """
    previous = torch.cuda.current_stream()
    stream = torch.cuda.Stream(device=CUDA)
    graph = torch.cuda.CUDAGraph()
    error = None
    try:
        with torch.cuda.graph(graph, stream=stream):
            with det.watch(segment, Phase.CAPTURE, True, CUDA):
                segment_fn()
    except RuntimeError as e:
        error = e
    finally:
        torch.cuda.set_stream(previous)
    assert not torch.cuda.is_current_stream_capturing()
    torch.cuda.synchronize()
    return graph, error


def warmed(det: Detectors, segment_fn, segment: str = "g"):
    with det.watch(segment, Phase.WARMUP, False, CUDA):
        segment_fn()
    torch.cuda.synchronize()
    return det.findings


def of(findings, check: Check) -> list[str]:
    return [f.call for f in findings if f.check is check]


class Holder:
    """Stands in for a module that keeps a reference on ``self``."""


@pytest.fixture
def inp():
    return torch.arange(16, device=CUDA, dtype=torch.float32)  # inp: [16], input buffer


@pytest.fixture
def out():
    return torch.zeros(16, device=CUDA)  # out: [16], output buffer


@pytest.fixture
def det(inp, out):
    return Detectors(known=[inp, out])


class TestCleanCapture:
    def test_a_clean_segment_has_no_findings_and_replays_like_eager(self, det, inp, out):
        def seg():
            out.copy_(torch.relu(inp - 4) * torch.tensor(2.0) + 1)

        warmed(det, seg)
        graph, error = captured(det, seg)
        assert error is None
        assert det.findings == []
        inp.copy_(torch.linspace(-8, 8, 16, device=CUDA))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, torch.relu(inp - 4) * 2 + 1)

    def test_a_side_stream_forked_from_the_capture_stream_is_captured(self, det, inp, out):
        side = torch.cuda.Stream(device=CUDA)

        def seg():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out.copy_(inp * 3)
            torch.cuda.current_stream().wait_stream(side)

        graph, error = captured(det, seg)
        assert error is None
        assert det.findings == []
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, inp * 3)


class TestHostSyncInCapture:
    def test_item_is_recorded_before_the_capture_fails(self, det, inp, out):
        def seg():
            out.add_(inp.sum().item())  # <item>

        _, error = captured(det, seg)
        assert error is not None
        assert of(det.findings, Check.HOST_SYNC) == [f"aten._local_scalar_dense (Tensor.item) at {at('item')}"]

    def test_cuda_synchronize_is_recorded_before_the_capture_fails(self, det, inp, out):
        def seg():
            out.copy_(inp)
            torch.cuda.synchronize()  # <sync>

        _, error = captured(det, seg)
        assert error is not None
        assert of(det.findings, Check.HOST_SYNC) == [f"torch.cuda.synchronize at {at('sync')}"]

    def test_stream_synchronize_is_recorded(self, det, inp, out):
        def seg():
            out.copy_(inp)
            torch.cuda.current_stream().synchronize()  # <stream-sync>

        _, error = captured(det, seg)
        assert error is not None
        assert of(det.findings, Check.HOST_SYNC) == [f"torch.cuda.Stream.synchronize at {at('stream-sync')}"]


class TestHostSyncInWarmup:
    """Warmup runs eagerly, so nothing fails: the findings are what warn before capture."""

    def test_item_nonzero_and_a_device_to_host_copy_are_flagged(self, det, inp, out):
        def seg():
            out.fill_(inp.max().item())  # <w-item>
            inp.nonzero()  # <w-nonzero>
            inp.cpu()  # <w-cpu>

        findings = warmed(det, seg)
        assert of(findings, Check.HOST_SYNC) == [
            f"aten._local_scalar_dense (Tensor.item) at {at('w-item')}",
            f"aten.nonzero (Tensor.nonzero) at {at('w-nonzero')}",
            f"aten._to_copy (Tensor.cpu) at {at('w-cpu')}",
        ]

    def test_tolist_is_one_finding(self, det, inp):
        def seg():
            inp.tolist()  # <w-tolist>

        assert [(f.check, f.call) for f in warmed(det, seg)] == [(Check.HOST_SYNC, f"Tensor.tolist at {at('w-tolist')}")]


class TestCrossDeviceInCapture:
    def test_a_cpu_tensor_in_a_graph_segment_is_flagged(self, det, out):
        host = torch.ones(16)
        det.add_known([host])

        def seg():
            out.add_(host)  # <cpu>

        captured(det, seg)
        (finding,) = det.findings
        assert (finding.check, finding.call) == (Check.CROSS_DEVICE, f"aten.add_ (Tensor.add_) at {at('cpu')}")
        assert finding.message.startswith("argument 'other' is a float32 tensor on cpu in a segment on cuda:0: ")

    def test_a_copy_to_the_host_is_flagged_as_cross_device_and_sync(self, det, inp):
        def seg():
            inp.to("cpu")  # <to-cpu>

        _, error = captured(det, seg)
        assert error is not None
        assert of(det.findings, Check.CROSS_DEVICE) == [f"aten._to_copy (Tensor.to) at {at('to-cpu')}"]
        assert of(det.findings, Check.HOST_SYNC) == [f"aten._to_copy (Tensor.to) at {at('to-cpu')}"]

    def test_torch_tensor_with_a_cuda_device_is_flagged(self, det, out):
        def seg():
            out[:2].copy_(torch.tensor([1.0, 2.0], device=CUDA))  # <lift>

        assert of(warmed(det, seg), Check.CROSS_DEVICE) == [f"aten.lift_fresh (torch.tensor) at {at('lift')}"]


class TestUncapturedKernel:
    def test_a_kernel_on_a_stream_that_is_not_capturing_is_flagged_and_missing_from_the_graph(self, det):
        side = torch.cuda.Stream(device=CUDA)
        side_buf = torch.ones(16, device=CUDA)
        det.add_known([side_buf])

        def seg():
            with torch.cuda.stream(side):
                side_buf.mul_(2)  # <side>

        graph, error = captured(det, seg)
        assert error is None
        (finding,) = det.findings
        assert (finding.check, finding.call) == (Check.UNCAPTURED_KERNEL, f"aten.mul_ (Tensor.mul_) at {at('side')}")
        assert finding.message.startswith("the current stream of cuda:0 is not capturing")
        assert torch.equal(side_buf, torch.full((16,), 2.0, device=CUDA))  # ran once, at capture
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(side_buf, torch.full((16,), 2.0, device=CUDA))  # the graph does not hold it


class TestEscapeAndForeignInCapture:
    def test_a_tensor_kept_after_capture_is_flagged(self, det, inp, out):
        holder = Holder()

        def seg():
            holder.out = inp * 2  # <escape>
            out.copy_(holder.out)

        _, error = captured(det, seg)
        assert error is None
        assert [(f.check, f.call) for f in det.findings] == [(Check.ESCAPE, f"aten.mul (Tensor.mul) at {at('escape')}")]

    def test_a_tensor_in_reused_memory_is_still_tracked(self, det, inp):
        holder = Holder()
        addresses = []

        def seg():
            freed = inp * 3
            addresses.append(freed.data_ptr())
            del freed
            holder.out = inp * 2  # <reused>
            addresses.append(holder.out.data_ptr())

        captured(det, seg)
        assert addresses[0] == addresses[1]  # the graph's pool gave the freed block back
        assert of(det.findings, Check.ESCAPE) == [f"aten.mul (Tensor.mul) at {at('reused')}"]

    def test_a_tensor_made_outside_the_plan_is_foreign(self, det, out):
        foreign = torch.ones(16, device=CUDA)

        def seg():
            out.add_(foreign)  # <foreign>

        _, error = captured(det, seg)
        assert error is None
        assert [(f.check, f.call) for f in det.findings] == [(Check.FOREIGN_TENSOR, f"aten.add_ (Tensor.add_) at {at('foreign')}")]
