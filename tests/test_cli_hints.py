"""An error's fix names ``RunOptions`` settings as data; each caller says them its own way.

The engine speaks to every caller (a script, a server, the CLI): an error keeps the
settings its hint names as ``OptionFix(field, value)`` (``CaptureError.settings``), its
text saying them as ``RunOptions(sizes=...)``; ``graphflow.cli`` says each as the flag
``graphflow run`` sets it with (``graphflow.cli.flag``), reading the data, never the text.
"""

from __future__ import annotations

import json

import attrs
import pytest
import torch

from graphflow.cli import FLAGS, flag, main
from graphflow.engine import RunOptions
from graphflow.engine.backend import BACKENDS, BackendKind, CpuBackend
from graphflow.errors import CaptureError, OptionError, OptionFix
from graphflow.integrations import dsv4
from graphflow.plan import Buffer, BufferRole, CaptureSettings, Mode, Plan, Segment, SegmentKind, Stream
from graphflow.plan.loader import dump_plan


class Syncing(torch.nn.Module):
    """A graph segment that reads a value back to the host: the host_sync detector refuses it."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward_step(self, x, y):
        torch.matmul(x, self.lin.weight.t(), out=y)
        float(y.sum().item())


def syncing_plan() -> Plan:
    return Plan("syncing", model="tests.test_cli_hints:Syncing",
                buffers=[Buffer("x", ("B", 8), "float32", "cuda:0", role=BufferRole.INPUT),
                         Buffer("y", ("B", 8), "float32", "cuda:0", role=BufferRole.OUTPUT)],
                streams=[Stream("s0", "cuda:0")],
                segments=[Segment("step", SegmentKind.GRAPH, "forward_step", reads=("x",), writes=("y",),
                                  stream="s0")],
                capture=CaptureSettings(modes=(Mode.FULL,), sizes=(2, 1)))


class TestSettings:
    def test_a_setting_says_itself_as_the_options_object(self):
        assert str(OptionFix("sizes")) == "RunOptions(sizes=...)"
        assert str(OptionFix("disabled_checks", {"host_sync"})) == "RunOptions(disabled_checks={'host_sync'})"
        assert str(OptionFix("compile", False)) == "RunOptions(compile=False)"

    @pytest.mark.parametrize(("setting", "said"), [
        (OptionFix("sizes"), "--sizes N,N,..."),
        (OptionFix("sizes", (1, 2)), "--sizes 1,2"),
        (OptionFix("disabled_checks", {"host_sync"}), "--disable-check host_sync"),
        (OptionFix("disabled_checks"), "--disable-check NAME"),
        (OptionFix("compile", False), "--no-compile"),
        (OptionFix("verify", False), "--no-verify"),
        (OptionFix("verify", "all"), "--verify all"),
        (OptionFix("detectors", "off"), "--no-detectors"),
        (OptionFix("backend", "cpu"), "--backend cpu"),
        (OptionFix("lazy", True), "--lazy"),
        (OptionFix("seed", 1), "RunOptions(seed=1)"),  # no flag sets it
        (OptionFix("lazy", False), "RunOptions(lazy=False)"),  # the default: no flag says it
    ])
    def test_the_command_line_says_the_flag_that_sets_it(self, setting, said):
        assert flag(setting) == said

    def test_a_capture_error_says_its_settings_each_callers_way(self):
        error = CaptureError("too large", hint="capture fewer sizes ({0}) or verify less ({1})",
                             settings=(OptionFix("sizes"), OptionFix("verify", False)))
        assert error.hint == "capture fewer sizes (RunOptions(sizes=...)) or verify less (RunOptions(verify=False))"
        assert str(error) == f"too large — {error.hint}"
        assert error.describe(flag) == "too large — capture fewer sizes (--sizes N,N,...) or verify less (--no-verify)"

    def test_a_hint_set_as_text_keeps_no_settings(self):
        error = CaptureError("boom", hint="see {0}", settings=(OptionFix("sizes"),))
        error.hint = "a hint of {braces} that names no setting"
        assert (error.settings, error.describe(flag)) == ((), "boom — a hint of {braces} that names no setting")

    def test_an_option_this_machine_cannot_honour_says_which_can(self):
        error = OptionError("no GPU", hint="use {0}", settings=(OptionFix("backend", "cpu"),))
        assert isinstance(error, ValueError)
        assert (str(error), error.describe(flag)) == ("no GPU — use RunOptions(backend='cpu')", "no GPU — use --backend cpu")

    def test_every_field_the_command_line_sets_has_its_flag(self):
        fields = {a.name for a in attrs.fields(RunOptions)}
        assert set(FLAGS) <= fields and fields - set(FLAGS) == {"seed", "skip_rules"}


class TestEngineErrors:
    def test_the_detectors_hint_names_the_flag(self, tmp_path, capsys):
        path = tmp_path / "syncing.yaml"
        path.write_text(dump_plan(syncing_plan()))
        status = main(["run", str(path), "--backend", "cpu", "--steps", "0", "--quiet"])
        out, err = capsys.readouterr()
        assert (status, out) == (1, "")
        (line,) = [line for line in err.splitlines() if line.startswith("graphflow:")]
        assert line.startswith("graphflow: capture failed, rolled back: [phase=warmup descriptor=FULL(B=2) "
                               "segment=step rank=0] capture-safety detectors found 1 problem(s): [host_sync]")
        assert "silence a check with --disable-check host_sync" in line and "RunOptions" not in line

    def test_the_flag_turns_the_check_off(self, tmp_path):
        path = tmp_path / "syncing.yaml"
        path.write_text(dump_plan(syncing_plan()))
        assert main(["run", str(path), "--backend", "cpu", "--steps", "0", "--quiet",
                     "--disable-check", "host_sync"]) == 0

    def test_json_carries_the_settings_as_data(self, tmp_path, capsys):
        path = tmp_path / "syncing.yaml"
        path.write_text(dump_plan(syncing_plan()))
        assert main(["run", str(path), "--backend", "cpu", "--steps", "0", "--json"]) == 1
        error = json.loads(capsys.readouterr().out)["error"]
        assert error["settings"] == [{"field": "disabled_checks", "value": ["host_sync"],
                                      "flag": "--disable-check host_sync"}]
        assert error["hint"].endswith("RunOptions(disabled_checks={'host_sync'})")

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
        assert "capture smaller sizes (--sizes N,N,...)" in line and line.count("--sizes") == 1
        assert "RunOptions" not in line


@pytest.mark.parametrize("field", sorted(FLAGS))
def test_each_flag_is_one_graphflow_run_has(field, capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    assert FLAGS[field].split()[0] in capsys.readouterr().out
