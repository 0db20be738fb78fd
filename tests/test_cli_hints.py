"""Engine hints name ``RunOptions`` fields; the command line adds the flag that sets each.

The engine speaks to every caller (a script, a server, the CLI), so its hints name the
options object; ``graphflow.cli.report_error`` adds the flag beside the field, from
one table, when it prints an engine error.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from graphflow.cli import FLAGS, main, with_flags
from graphflow.engine import RunOptions
from graphflow.engine.backend import BACKENDS, BackendKind, CpuBackend
from graphflow.integrations import dsv4
from graphflow.plan import Buffer, BufferRole, CaptureSettings, Mode, Plan, Segment, SegmentKind, Stream
from graphflow.plan.loader import dump_plan


class Stepper(torch.nn.Module):
    """A step that moves a position kept in Python: the host-state check refuses it."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.position = 0

    def forward_step(self, x, y):
        torch.matmul(x, self.lin.weight.t(), out=y)
        self.position += 1


def stepper_plan() -> Plan:
    return Plan("stepper", model="tests.test_cli_hints:Stepper",
                buffers=[Buffer("x", ("B", 8), "float32", "cuda:0", role=BufferRole.INPUT),
                         Buffer("y", ("B", 8), "float32", "cuda:0", role=BufferRole.OUTPUT)],
                streams=[Stream("s0", "cuda:0")],
                segments=[Segment("step", SegmentKind.GRAPH, "forward_step", reads=("x",), writes=("y",),
                                  stream="s0")],
                capture=CaptureSettings(modes=(Mode.FULL,), sizes=(2, 1)))


class TestWithFlags:
    def test_a_field_in_parentheses_gets_its_flag_inside_them(self):
        assert with_flags("capture fewer sizes (RunOptions(sizes=...))") == \
            "capture fewer sizes (RunOptions(sizes=...); on the command line --sizes)"

    def test_a_field_outside_parentheses_gets_its_flag_in_parentheses_after_the_call(self):
        assert with_flags("turn it off with RunOptions(disabled_checks={'host_state'}), or fix it") == \
            "turn it off with RunOptions(disabled_checks={'host_state'}) (on the command line --disable-check " \
            "NAME), or fix it"

    def test_every_field_of_a_call_and_every_call_are_spelled(self):
        assert with_flags("RunOptions(sizes=(1, 2), verify=False) or RunOptions(compile=False)") == \
            "RunOptions(sizes=(1, 2), verify=False) (on the command line --sizes --no-verify) or " \
            "RunOptions(compile=False) (on the command line --no-compile)"

    def test_what_has_no_flag_or_already_names_it_is_left_as_is(self):
        for text in ("rerun with RunOptions(seed=1)", "(--sizes, RunOptions(sizes=...))",
                     "--backend cuda: use the cpu backend (RunOptions(backend='cpu'|'auto'))",
                     "no options here", "RunOptions(sizes=... unclosed"):
            assert with_flags(text) == text

    def test_the_table_holds_every_field_the_command_line_sets(self):
        fields = {a.name for a in attrs.fields(RunOptions)}
        assert set(FLAGS) <= fields and fields - set(FLAGS) == {"seed", "skip_rules"}


class TestEngineErrors:
    def test_the_host_state_hint_names_the_option_and_the_flag(self, tmp_path, capsys):
        path = tmp_path / "stepper.yaml"
        path.write_text(dump_plan(stepper_plan()))
        status = main(["run", str(path), "--backend", "cpu", "--steps", "0", "--quiet"])
        out, err = capsys.readouterr()
        assert (status, out) == (1, "")
        (line,) = [line for line in err.splitlines() if line.startswith("graphflow:")]
        assert line.startswith("graphflow: capture failed, rolled back: [phase=warmup descriptor=FULL(B=2) rank=0] "
                               "one eager step changed 1 value(s)")
        assert line.endswith("RunOptions(disabled_checks={'host_state'}) (on the command line --disable-check NAME)")

    def test_the_flag_turns_the_check_off(self, tmp_path, capsys):
        path = tmp_path / "stepper.yaml"
        path.write_text(dump_plan(stepper_plan()))
        assert main(["run", str(path), "--backend", "cpu", "--steps", "0", "--quiet",
                     "--disable-check", "host_state"]) == 0

    def test_a_plan_too_large_for_memory_names_sizes_once(self, monkeypatch, capsys):
        class SmallHost(CpuBackend):
            def free_memory(self, device: torch.device) -> int | None:
                return 1 << 30

        def build_model(**kwargs):
            raise AssertionError("the model was built")

        monkeypatch.setitem(BACKENDS, BackendKind.CPU, SmallHost)
        monkeypatch.setattr(dsv4, "build_model", build_model)
        status = main(["run", "plans/dsv4_61l_decode.yaml", "--backend", "cpu", "--steps", "0", "--quiet"])
        (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("graphflow:")]
        assert status == 1
        assert "RunOptions(sizes=...)" in line and line.count("--sizes") == 1


@pytest.mark.parametrize("field", sorted(FLAGS))
def test_each_flag_is_one_graphflow_run_has(field, capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    assert FLAGS[field].split()[0] in capsys.readouterr().out
