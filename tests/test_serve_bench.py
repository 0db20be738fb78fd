"""bench/serve_bench.py on the CPU (its --smoke mode), for the default shape and for the 8b
shape's model family (a tiny Qwen2): each row serves the workload twice on one manager,
and the cold start, the waves and the comparisons its table prints are what it records, so
a GPU session does not find a broken bench."""

from __future__ import annotations

import json
import sys

import pytest

from bench import serve_bench


def _smoke(out, *extra: str):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", ["serve_bench.py", "--smoke", "--out", str(out), *extra])
        assert serve_bench.main() == 0
    return out


@pytest.fixture(scope="module")
def default(tmp_path_factory):
    out = _smoke(tmp_path_factory.mktemp("serve"))
    return json.loads((out / "serve.json").read_text()), (out / "serve.txt").read_text()


def test_every_row_serves_a_cold_then_a_warm_wave_with_the_eager_tokens(default):
    results, _ = default
    rows = results["workloads"]["6"]
    assert [r["row"] for r in rows] == [r for r in serve_bench.ROWS if r != "engine graphs"]  # no CUDA: no own graphs
    for r in rows:
        assert [w["wave"] for w in r["waves"]] == list(serve_bench.WAVES)
        assert all(w["generated"] > 0 and w["steps"] > 0 for w in r["waves"])
        assert r["identical_eager"] == {"cold": True, "warm": True}, r["row"]
        assert r["identical_own"] is None  # the engine's own graphs need CUDA
        # From the row's setup to the cold wave's last answer: the setup and the whole wave.
        assert r["cold_start_s"] >= r["setup_s"] + r["waves"][0]["served_s"] - 1e-6
    lazy = next(r for r in rows if r["row"] == "graphflow lazy")
    assert lazy["worst_step_capturing_s"] is not None
    assert lazy["worst_capturing_vs_eager_step"] == pytest.approx(lazy["worst_step_capturing_s"]
                                                                   / rows[0]["median_step_s"])
    foreground = next(r for r in rows if r["row"] == "graphflow foreground")
    assert foreground["keys_captured"] == foreground["keys_planned"] > 0


def test_the_table_names_the_device_and_the_shape(default):
    results, text = default
    assert results["device"] == "cpu" and results["shape"] == "default"
    assert text.startswith("# bench/serve_bench.py --shape default --smoke on cpu")
    for column in ("cold start", "cold tok/s", "warm tok/s", "worst capturing", "graph MiB"):
        assert column in text


def test_the_8b_shape_builds_a_qwen2_of_its_proportions(tmp_path):
    out = _smoke(tmp_path, "--shape", "8b", "--rows", "engine eager,graphflow lazy")
    results = json.loads((out / "serve-8b.json").read_text())
    assert results["model"].startswith("random Qwen2, 2 layers, hidden 128, intermediate 448")
    assert [r["row"] for r in results["workloads"]["6"]] == ["engine eager", "graphflow lazy"]
    assert all(r["identical_eager"] == {"cold": True, "warm": True} for r in results["workloads"]["6"])
    assert serve_bench.SHAPES["8b"]["settings"]["num_blocks"] == 2048


def test_the_8b_shape_is_llama_3_8b_sized():
    """Its config, built on the meta device (no memory): Llama-3-8B's parameter count."""
    import torch

    with torch.device("meta"):
        model = serve_bench.build_model("qwen2", 32, 4096, 128256, "meta")
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size, config.num_attention_heads,
            config.num_key_value_heads, config.vocab_size) == (32, 4096, 14336, 32, 8, 128256)
    assert 8.0e9 < sum(p.numel() for p in model.parameters()) < 8.1e9


def test_a_row_that_fails_is_recorded_with_why_and_the_others_still_run(tmp_path, monkeypatch):
    real = serve_bench.serve

    def failing(manager, **options):
        if options.get("lazy"):
            raise RuntimeError("injected failure")
        return real(manager, **options)

    monkeypatch.setattr(serve_bench, "serve", failing)
    monkeypatch.setattr(sys, "argv", ["serve_bench.py", "--smoke", "--out", str(tmp_path), "--rows",
                                      "engine eager,graphflow lazy,graphflow foreground"])
    assert serve_bench.main() == 1
    rows = {r["row"]: r for r in json.loads((tmp_path / "serve.json").read_text())["workloads"]["6"]}
    assert rows["graphflow lazy"] == {"row": "graphflow lazy", "error": "RuntimeError: injected failure"}
    assert rows["graphflow foreground"]["identical_eager"] == {"cold": True, "warm": True}
    assert "graphflow lazy         failed: RuntimeError: injected failure" in (tmp_path / "serve.txt").read_text()
