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


def test_no_smoke_row_differs_from_the_eager_step(default):
    results, text = default
    for r in results["workloads"]["6"]:
        assert r["differs_eager"] == {"cold": None, "warm": None}, r["row"]
    assert "differ from" not in text


def _row(name: str, tokens: list[list[int]], served: list[str], ended: list[float],
         stamps: list[list[float]]) -> dict:
    steps = [serve_bench.Step(0.01, False, 0, label.endswith("check"), at, label) for label, at in zip(served, ended)]
    return {"row": name, "step_log": steps, "waves": [{"wave": "cold", "tokens": tokens, "stamps": stamps}]}


def test_a_difference_is_placed_at_the_step_that_made_the_first_differing_token():
    """Two requests of three differ; the earlier differing token (by when the row made
    it) is request 2's second, made by step 1 (the last step to end before its stamp);
    the reference made it in its step 2."""
    ours = _row("graphflow foreground", [[5, 6, 7], [1, 2, 3], [8, 9]], ["piecewise(q=16)", "decode check", "x"],
                [1.0, 2.0, 3.0], [[1.1, 2.1, 3.1], [1.1, 2.1, 3.1], [1.1, 2.2]])
    own = _row("engine graphs", [[5, 6, 0], [1, 2, 3], [8, 4]], ["own graph", "captured inline", "own graph"],
               [1.5, 2.5, 3.5], [[1.6, 2.6, 3.6], [1.6, 2.6, 3.6], [1.6, 3.6]])
    first = serve_bench._first_difference(ours, own, 0)
    assert first == {"requests": 2, "of": 3, "request": 2, "token": 1,
                     "step": {"index": 1, "served": "decode check", "checking": True},
                     "other_step": {"index": 2, "served": "own graph", "checking": False}}
    assert serve_bench._first_difference(own, own, 0) is None
    ours["differs_own"] = {"cold": first}
    (line,) = serve_bench.differences([own, ours])
    assert line == ("graphflow foreground, cold wave: 2 of 3 requests differ from the engine's own graphs; first at "
                    "request 2 token 1, step 1 (decode check, a check); theirs: step 2 (own graph)")


def test_full_keys_asked_leaves_the_fulls_no_step_asked_for(tmp_path):
    out = _smoke(tmp_path, "--full-keys", "asked", "--rows", "engine eager,graphflow foreground")
    results = json.loads((out / "serve.json").read_text())
    assert results["full_keys"] == "asked"
    foreground = results["workloads"]["6"][1]
    planned = [key for key, entry in foreground["coverage"]["keys"].items() if entry["state"] == "planned"]
    assert foreground["keys_captured"] + len(planned) == foreground["keys_planned"]
    assert not [key for key in planned if key.startswith("piecewise")], planned
    assert "--full-keys asked" in (out / "serve.txt").read_text().splitlines()[0]
