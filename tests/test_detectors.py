"""Capture-safety detectors on CPU: each check fires on a seeded bug and stays quiet on
the clean version of the same segment.

Source lines are found through ``# <name>`` markers, so findings are compared with
the exact line that made the call. A second device for CROSS_DEVICE is played by
``meta``; what needs a GPU (streams, capture) is in ``tests/cuda/test_cuda_detectors.py``.
"""

from __future__ import annotations

import contextlib
import threading

import attrs
import pytest
import torch

from graphflow.engine.detectors import Check, Detectors, aside
from graphflow.events import Phase
from tests.source_markers import marked

at = marked(__file__)


def watched(det: Detectors, segment_fn, *, capturing=False, device="cpu", segment="L0.pre", phase=Phase.WARMUP):
    with det.watch(segment, phase, capturing, device):
        segment_fn()
    return det.findings


def calls(findings) -> list[tuple[Check, str]]:
    return [(f.check, f.call) for f in findings]


class Holder:
    """Stands in for a module that keeps a reference on ``self``."""


@pytest.fixture
def buf():
    return torch.arange(8, dtype=torch.float32)  # buf: [8], a declared static buffer


@pytest.fixture
def det(buf):
    return Detectors(known=[buf])


class TestCheck:
    def test_values_are_lowercase_names(self):
        assert {c.value for c in Check} == {"host_sync", "foreign_tensor", "escape", "uncaptured_kernel",
                                            "cross_device", "host_state"}

    def test_default_is_every_check(self):
        assert Check.default() == frozenset(Check)
        assert isinstance(Check.default(), frozenset)

    def test_checks_must_be_check_members(self):
        with pytest.raises(TypeError, match=r"checks must be graphflow.engine.detectors.Check members \(got 'host_sync'\)"):
            Detectors(checks=["host_sync"])

    def test_known_must_be_tensors(self):
        with pytest.raises(TypeError, match=r"known tensors must be torch.Tensor \(got list\)"):
            Detectors(known=[[1, 2]])


class TestHostSync:
    def test_item_is_flagged_with_segment_call_line_and_phase(self, det, buf):
        def seg():
            buf.sum().item()  # <item>

        (finding,) = watched(det, seg)
        assert finding.check is Check.HOST_SYNC
        assert finding.segment == "L0.pre"
        assert finding.call == f"aten._local_scalar_dense (Tensor.item) at {at('item')}"
        assert finding.phase is Phase.WARMUP
        assert finding.message.startswith("reads a tensor's value into Python (.item(), int(t), float(t), bool(t)")

    def test_if_on_a_tensor_is_flagged(self, det, buf):
        def seg():
            if buf.sum() > 0:  # <if>
                buf.mul_(2)

        assert calls(watched(det, seg)) == [(Check.HOST_SYNC, f"aten._local_scalar_dense (Tensor.__bool__) at {at('if')}")]

    def test_int_of_a_tensor_is_flagged(self, det, buf):
        def seg():
            buf.add_(int(buf[0]))  # <int>

        assert calls(watched(det, seg)) == [(Check.HOST_SYNC, f"aten._local_scalar_dense (Tensor.__int__) at {at('int')}")]

    def test_the_same_decision_on_the_device_is_quiet(self, det, buf):
        def seg():
            buf.copy_(torch.where(buf.sum() > 0, buf * 2, buf))

        assert watched(det, seg) == []

    def test_nonzero_is_flagged(self, det, buf):
        def seg():
            buf.nonzero()  # <nonzero>

        (finding,) = watched(det, seg)
        assert (finding.check, finding.call) == (Check.HOST_SYNC, f"aten.nonzero (Tensor.nonzero) at {at('nonzero')}")
        assert finding.message.startswith("its output size depends on tensor values")

    def test_boolean_mask_indexing_is_flagged_and_a_multiplied_mask_is_not(self, det, buf):
        def seg():
            buf[buf > 3]  # <mask>
            buf.mul_(buf > 3)

        (finding,) = watched(det, seg)
        assert (finding.check, finding.call) == (Check.HOST_SYNC, f"aten.index (Tensor.__getitem__) at {at('mask')}")
        assert finding.message.startswith("indexes with a boolean mask: its output size depends on tensor values")

    def test_bincount_is_flagged(self, det, buf):
        def seg():
            torch.bincount(buf.long(), minlength=8)  # <bincount>

        assert calls(watched(det, seg)) == [(Check.HOST_SYNC, f"aten.bincount (torch.bincount) at {at('bincount')}")]

    def test_an_op_called_through_torch_ops_is_named_without_a_python_call(self, det, buf):
        def seg():
            buf.sum()
            torch.ops.aten.nonzero.default(buf)  # <direct>

        assert calls(watched(det, seg)) == [(Check.HOST_SYNC, f"aten.nonzero at {at('direct')}")]

    def test_tolist_is_flagged_once(self, det, buf):
        def seg():
            buf.tolist()  # <tolist>

        assert calls(watched(det, seg)) == [(Check.HOST_SYNC, f"Tensor.tolist at {at('tolist')}")]

    def test_cuda_synchronize_is_flagged_before_it_runs_and_restored_after(self, det):
        original = torch.cuda.synchronize

        def seg():
            torch.cuda.synchronize()  # <sync>

        with contextlib.suppress(AssertionError, RuntimeError):  # a CPU build cannot synchronize
            watched(det, seg)
        (finding,) = det.findings
        assert (finding.check, finding.call) == (Check.HOST_SYNC, f"torch.cuda.synchronize at {at('sync')}")
        assert finding.message.startswith("waits for the device: not allowed during capture")
        assert torch.cuda.synchronize is original

    def test_a_sync_from_another_thread_is_not_the_segments(self, det, buf):
        def other():
            buf.sum().item()
            with contextlib.suppress(AssertionError, RuntimeError):
                torch.cuda.synchronize()

        def seg():
            thread = threading.Thread(target=other)
            thread.start()
            thread.join()

        assert watched(det, seg) == []


class TestForeignTensor:
    def test_a_tensor_made_outside_the_plan_is_flagged(self, det, buf):
        foreign = torch.ones(8)  # re-created each step by the caller, say

        def seg():
            buf.add_(foreign)  # <foreign>

        (finding,) = watched(det, seg)
        assert (finding.check, finding.call) == (Check.FOREIGN_TENSOR, f"aten.add_ (Tensor.add_) at {at('foreign')}")
        assert finding.message.startswith(
            "argument 'other' is a float32 tensor on cpu that is neither a declared buffer, nor a parameter or "
            "buffer of the model, nor created inside the segment")

    def test_a_foreign_tensor_updated_in_place_during_capture_is_foreign_not_escaped(self, det, buf):
        foreign = torch.ones(8)

        def seg():
            foreign.add_(buf)

        assert [f.check for f in watched(det, seg, capturing=True)] == [Check.FOREIGN_TENSOR]

    def test_a_foreign_tensor_used_many_times_is_one_finding(self, det, buf):
        foreign = torch.ones(8)

        def seg():
            for _ in range(3):
                buf.add_(foreign)

        assert len(watched(det, seg)) == 1

    def test_a_known_buffer_and_its_views_are_not_foreign(self, det, buf):
        def seg():
            buf[2:6].mul_(2)
            buf.view(2, 4).sum(dim=0)
            buf.t().add_(1)

        assert watched(det, seg) == []

    def test_another_storage_object_over_known_memory_is_not_foreign(self, det, buf):
        alias = torch.from_dlpack(buf[4:])  # a new storage object starting inside buf's memory

        def seg():
            alias.add_(1)

        assert alias.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()
        assert watched(det, seg) == []

    def test_model_parameters_and_buffers_given_as_known_are_not_foreign(self, buf):
        model = torch.nn.Linear(8, 8)
        model.register_buffer("scale", torch.full((8,), 0.5))
        det = Detectors(known=[buf, *model.parameters(), *model.buffers()])

        def seg():
            with torch.no_grad():
                buf.copy_(model(buf) * model.scale)

        assert watched(det, seg) == []

    def test_add_known_makes_a_tensor_declared(self, det, buf):
        extra = torch.ones(8)
        det.add_known([extra])

        def seg():
            buf.add_(extra)

        assert watched(det, seg) == []

    def test_intermediates_are_not_foreign_and_do_not_escape(self, det, buf):
        def seg():
            y = buf * 2
            z = torch.relu(y - 3)
            buf.copy_(z + torch.tensor([1.0] * 8))

        assert watched(det, seg, capturing=True) == []

    def test_a_tensor_built_from_python_data_inside_is_not_foreign(self, det, buf):
        def seg():
            buf.add_(torch.tensor([1.0] * 8))

        assert watched(det, seg) == []

    def test_python_numbers_and_cpu_scalars_are_not_foreign(self, det, buf):
        half = torch.tensor(0.5)

        def seg():
            buf.mul_(half).add_(1)

        assert watched(det, seg) == []

    def test_an_intermediate_of_an_earlier_segment_is_foreign_in_the_next(self, det, buf):
        kept = {}

        def first():
            kept["y"] = buf * 2

        def second():
            buf.copy_(kept["y"])  # <next>

        watched(det, first, segment="A")
        assert calls(watched(det, second, segment="B")) == [(Check.FOREIGN_TENSOR, f"aten.copy_ (Tensor.copy_) at {at('next')}")]
        assert det.findings[0].segment == "B"


class TestEscape:
    def test_a_tensor_kept_on_self_during_capture_escapes(self, det, buf):
        holder = Holder()

        def seg():
            holder.out = buf * 2  # <escape>

        (finding,) = watched(det, seg, capturing=True, phase=Phase.CAPTURE)
        assert (finding.check, finding.call) == (Check.ESCAPE, f"aten.mul (Tensor.mul) at {at('escape')}")
        assert finding.phase is Phase.CAPTURE
        assert finding.message.startswith(
            "a float32 tensor on cpu created inside the captured region and still referenced after the segment "
            "returned: its memory belongs to the graph's pool and is overwritten at the next replay")

    def test_the_same_segment_outside_capture_does_not_escape(self, det, buf):
        holder = Holder()

        def seg():
            holder.out = buf * 2

        assert watched(det, seg, capturing=False) == []

    def test_a_view_of_an_intermediate_escapes_from_where_the_intermediate_was_made(self, det, buf):
        holder = Holder()

        def seg():
            y = buf * 2  # <made>
            holder.out = y[:4]

        assert calls(watched(det, seg, capturing=True)) == [(Check.ESCAPE, f"aten.mul (Tensor.mul) at {at('made')}")]

    def test_a_view_of_a_known_buffer_kept_on_self_does_not_escape(self, det, buf):
        holder = Holder()

        def seg():
            holder.out = buf[:4]
            buf.mul_(2)

        assert watched(det, seg, capturing=True) == []

    def test_writing_into_a_buffer_does_not_escape(self, det, buf):
        def seg():
            buf.copy_(buf * 2)

        assert watched(det, seg, capturing=True) == []

    def test_a_failing_segment_is_not_checked_for_escapes(self, det, buf):
        holder = Holder()

        def seg():
            holder.out = buf * 2
            raise ValueError("boom")

        with pytest.raises(ValueError):
            watched(det, seg, capturing=True)
        assert det.findings == []


class TestCrossDevice:
    """``meta`` plays the second device; CUDA cases run in tests/cuda."""

    def test_a_tensor_on_another_device_than_the_segment_is_flagged(self, det, buf):
        def seg():
            buf * 2  # <other>

        (finding,) = watched(det, seg, device="meta")
        assert (finding.check, finding.call) == (Check.CROSS_DEVICE, f"aten.mul (Tensor.mul) at {at('other')}")
        assert finding.message.startswith("argument 'self' is a float32 tensor on cpu in a segment on meta: ")

    def test_a_copy_to_another_device_is_flagged(self, det, buf):
        def seg():
            buf.to("meta")  # <to>

        (finding,) = watched(det, seg, device=None)
        assert (finding.check, finding.call) == (Check.CROSS_DEVICE, f"aten._to_copy (Tensor.to) at {at('to')}")
        assert finding.message.startswith("copies from cpu to meta: a copy between devices inside a graph segment")

    def test_an_op_mixing_devices_is_flagged_without_a_segment_device(self, det, buf):
        target = torch.empty(8, device="meta")

        def seg():
            target.copy_(buf)  # <mix>

        (finding,) = watched(det, seg, device=None)
        assert (finding.check, finding.call) == (Check.CROSS_DEVICE, f"aten.copy_ (Tensor.copy_) at {at('mix')}")
        assert finding.message.startswith("mixes tensors on cpu, meta: ")

    def test_cpu_scalars_with_tensors_of_the_segments_device_are_quiet(self, det):
        def seg():
            x = torch.empty(8, device="meta")
            x * torch.tensor(2.0) + 1

        assert watched(det, seg, device="meta") == []

    def test_a_segment_on_one_device_is_quiet(self, det, buf):
        def seg():
            buf.copy_(buf.to(torch.float64) * 2)

        assert watched(det, seg, device="cpu") == []


class TestDisabledChecks:
    def test_no_checks_record_nothing_and_push_no_mode(self, buf):
        det = Detectors(checks=(), known=[buf])
        holder = Holder()
        foreign = torch.ones(8)
        stack_inside = []

        def seg():
            stack_inside.append(torch._C._len_torch_dispatch_stack())
            buf.sum().item()
            buf.add_(foreign)
            holder.out = buf * 2

        assert watched(det, seg, capturing=True) == []
        assert stack_inside == [0]

    def test_only_enabled_checks_fire(self, buf):
        det = Detectors(checks={Check.FOREIGN_TENSOR}, known=[buf])
        holder = Holder()
        foreign = torch.ones(8)
        sync_inside = []

        def seg():
            sync_inside.append(torch.cuda.synchronize)
            buf.sum().item()
            buf.add_(foreign)
            holder.out = buf * 2

        assert [f.check for f in watched(det, seg, capturing=True)] == [Check.FOREIGN_TENSOR]
        assert sync_inside == [torch.cuda.synchronize]  # HOST_SYNC off: nothing patched


class TestFindings:
    def test_a_repeated_hazard_is_one_finding(self, det, buf):
        def seg():
            for _ in range(3):
                buf.sum().item()

        watched(det, seg)
        watched(det, seg)
        assert len(det.findings) == 1
        watched(det, seg, phase=Phase.CAPTURE)
        assert [f.phase for f in det.findings] == [Phase.WARMUP, Phase.CAPTURE]

    def test_findings_are_frozen(self, det, buf):
        (finding,) = watched(det, lambda: buf.sum().item())
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            finding.segment = "other"

    def test_clear_forgets_findings(self, det, buf):
        def seg():
            buf.sum().item()

        watched(det, seg)
        det.clear()
        assert det.findings == []
        assert len(watched(det, seg)) == 1

    def test_report_groups_findings_by_segment(self, det, buf):
        foreign = torch.ones(8)

        def pre():
            buf.sum().item()  # <r1>

        def post():
            buf.add_(foreign)  # <r2>

        watched(det, pre, segment="L0.pre")
        watched(det, post, segment="L0.post", phase=Phase.CAPTURE)
        lines = det.report().splitlines()
        assert lines[0] == "2 capture-safety findings in 2 segments:"
        assert lines[1] == "segment L0.pre:"
        assert lines[2] == f"  host_sync [warmup]: aten._local_scalar_dense (Tensor.item) at {at('r1')}"
        assert lines[3] == f"      {det.findings[0].message}"
        assert lines[4] == "segment L0.post:"
        assert lines[5] == f"  foreign_tensor [capture]: aten.add_ (Tensor.add_) at {at('r2')}"
        assert len(lines) == 7

    def test_report_without_findings(self, det):
        assert det.report() == "no capture-safety findings"


class TestWatch:
    def test_modes_are_active_only_inside_a_watch(self, det, buf):
        inside = []

        def seg():
            inside.append((torch._C._len_torch_dispatch_stack(), torch._C._len_torch_function_stack()))

        before = (torch._C._len_torch_dispatch_stack(), torch._C._len_torch_function_stack())
        watched(det, seg)
        after = (torch._C._len_torch_dispatch_stack(), torch._C._len_torch_function_stack())
        assert before == after == (0, 0)
        assert inside == [(1, 1)]

    def test_ops_after_a_watch_are_not_recorded(self, det, buf):
        watched(det, lambda: None)
        buf.sum().item()
        with contextlib.suppress(AssertionError, RuntimeError):
            torch.cuda.synchronize()
        assert det.findings == []

    def test_a_synchronize_kept_from_inside_a_watch_records_nothing_after_it(self, det):
        kept = []
        watched(det, lambda: kept.append(torch.cuda.synchronize))
        assert kept[0] is not torch.cuda.synchronize  # the recording wrapper
        with contextlib.suppress(AssertionError, RuntimeError):
            kept[0]()
        assert det.findings == []

    def test_a_synchronize_in_a_breaks_eager_work_is_not_the_segments(self, det):
        def segment():
            with det.eager(), contextlib.suppress(AssertionError, RuntimeError):
                torch.cuda.synchronize()

        assert watched(det, segment) == []

    def test_a_synchronize_set_aside_is_not_the_segments(self, det):
        # torch.compile compiling and autotuning a segment's code synchronizes: not the segment's doing.
        def segment():
            with aside(), contextlib.suppress(AssertionError, RuntimeError):
                torch.cuda.synchronize()
            with contextlib.suppress(AssertionError, RuntimeError):
                torch.cuda.synchronize()  # <own>

        assert calls(watched(det, segment)) == [(Check.HOST_SYNC, f"torch.cuda.synchronize at {at('own')}")]

    def test_a_user_exception_is_reraised_and_everything_is_restored(self, det, buf):
        originals = (torch.cuda.synchronize, torch.cuda.Stream.synchronize, torch.cuda.Event.synchronize)
        error = ValueError("segment failed")

        def seg():
            buf.sum().item()
            raise error

        with pytest.raises(ValueError) as raised:
            watched(det, seg)
        assert raised.value is error
        assert (torch._C._len_torch_dispatch_stack(), torch._C._len_torch_function_stack()) == (0, 0)
        assert (torch.cuda.synchronize, torch.cuda.Stream.synchronize, torch.cuda.Event.synchronize) == originals
        assert [f.check for f in det.findings] == [Check.HOST_SYNC]

    def test_a_failing_op_propagates_its_own_error(self, det, buf):
        def seg():
            buf.view(3, 3)

        with pytest.raises(RuntimeError, match="shape '\\[3, 3\\]' is invalid"):
            watched(det, seg)
        assert torch._C._len_torch_dispatch_stack() == 0

    def test_a_segment_returns_its_normal_result_under_watch(self, det, buf):
        expected = (buf * 2 + 1).sum()
        result = []

        def seg():
            result.append((buf * 2 + 1).sum())

        watched(det, seg)
        assert torch.equal(result[0], expected)

    @pytest.mark.slow
    def test_watching_ops_does_not_import_dynamo(self):
        # Importing TorchDynamo costs a second or more of start-up; a watch must not
        # pull it in for a model that never compiles.
        import subprocess
        import sys

        code = ("import sys, torch\n"
                "from graphflow.engine.detectors import Detectors\n"
                "from graphflow.events import Phase\n"
                "buf = torch.ones(4)\n"
                "det = Detectors(known=[buf])\n"
                "with det.watch('L0.pre', Phase.WARMUP, False, 'cpu'):\n"
                "    torch.nn.functional.layer_norm(buf, (4,)).add_(1)\n"
                "print('torch._dynamo' in sys.modules)\n")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        assert out.stdout.strip() == "False"

    def test_once_dynamo_is_loaded_the_mode_keeps_dynamo_out_of_its_frames(self, det, buf):
        import torch._dynamo  # noqa: F401  (a compiled model has loaded it)

        modes = []

        def seg():
            modes.append(type(torch.utils._python_dispatch._get_current_dispatch_mode()))
            (buf * 2).sum()

        watched(det, seg)
        dispatch = modes[0].__torch_dispatch__
        assert getattr(dispatch, "__wrapped__", None) is not None  # torch._disable_dynamo's wrapper

    def test_work_that_runs_eagerly_at_replay_is_not_watched_and_what_it_made_is_the_segments(self, det, buf):
        # A submodule a PIECEWISE segment breaks at runs eagerly between the graph pieces:
        # its host reads and the tensors it reads are no hazard, and the model goes on
        # with what it returns; after it, the graph piece is watched again.
        foreign = torch.ones(8)
        made = []

        def seg():
            with det.eager():
                foreign.sum().item()  # a host read, of a tensor the plan does not know
                made.append(foreign * 2)
            buf.add_(made[0])  # the break's output: the segment's own
            buf.add_(foreign)  # <after-break>

        findings = watched(det, seg, capturing=True)
        assert calls(findings) == [(Check.FOREIGN_TENSOR, f"aten.add_ (Tensor.add_) at {at('after-break')}")]
