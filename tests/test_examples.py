"""The examples as a user runs them: each says what it does before torch and transformers
load, the seconds (tens, on a busy machine) in which a silent script looks hung."""

from __future__ import annotations

from tests.torch_loads import ROOT, before_torch


def test_the_serving_example_says_what_it_does_before_torch_loads():
    assert before_torch(str(ROOT / "examples" / "hf_serving" / "serving.py"), "--requests", "2") == [
        "hf_serving: loading torch and transformers, then building a random Llama (4 layers) and serving 2 requests, "
        "graphs captured before serving (the PIECEWISE ones; the FULL ones beside it)"]
