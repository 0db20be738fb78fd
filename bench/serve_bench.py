"""Serving under transformers' continuous batching: the engine eager, the engine with its own
graphs, graphflow foreground and graphflow lazy, side by side in one process.

    PYTHONPATH=. python3 bench/serve_bench.py --out DIR                 # GPU: 8 layers, 64 and 256 requests
    PYTHONPATH=. python3 bench/serve_bench.py --out DIR --shape 8b      # GPU: Llama-3-8B's shape, 128 requests
    PYTHONPATH=. python3 bench/serve_bench.py --out DIR --smoke         # CPU, tiny: checks the script

``--shape`` picks the model, the engine's settings, the workload and the rows (each can be
overridden by its own flag):

* ``default``: a random Llama, 8 layers, hidden 1024; block 32 x 512 blocks, 512 batch
  tokens; 64 and 256 requests, prompts of 16-384 tokens, 16-128 new tokens; all five rows;
* ``12l``: a random Llama, 12 layers, hidden 1536; the settings and workload of ``8b``;
* ``8b``: a random Qwen2 of Llama-3-8B's shape (32 layers, hidden 4096, intermediate 14336,
  32 heads, 8 KV heads, vocab 128256), its bf16 weights made on the GPU where they live;
  block 32 x 2048 blocks, 1024 batch tokens, 64 requests a batch, q padded to 64, KV to
  4096; 128 requests, prompts of 16-1024 tokens, 32-128 new tokens; four rows (no padded eager).

Nothing is downloaded. Attention ``paged|sdpa``, greedy; one workload per ``--requests``
(prompt and output lengths drawn once, the same for every row). The model is built once;
each row is a fresh manager over it that serves the workload **twice**: a cold wave, then
the same prompts again, warm (the graphs of the first wave are there).

* **engine eager**: ``use_cuda_graph=False``, padding off: the reference tokens;
* **engine eager padded** (the default shape's rows, or ``--rows``): the same with the
  padding the graphs need turned on: the engine's eager steps on the very batches every
  graph row replays (bf16 kernels sum in another order at another size, so padding alone
  can change a random model's tokens);
* **engine graphs**: ``use_cuda_graph=True`` after ``manager.warmup()`` (what it pre-captures);
  every other key is captured inline the first time a step asks for it;
* **graphflow foreground**: ``serve(manager)`` before ``start()``: every key captured and
  verified first;
* **graphflow restart** (after the foreground row, which then saves its FULL keys'
  graphs once its warm wave is served: ``Serving.save_graphs``): ``serve(manager,
  graphs_from=...)``, the saved keys built from their nodes, in the same process (a new
  process would also load the libraries' kernels; the PIECEWISE captures do that);
* **graphflow lazy**: ``serve(manager, lazy=True)``: serving at once, keys captured beside it.

Columns: tokens identical (both waves) to the eager row, to the padded eager row
(``=pad``) and to the engine's own graphs (``=own``; ``n:cold``/``n:warm`` say which wave
differs); the **cold start**: seconds from the row's setup (``serve``, the engine's
``warmup`` for its own graphs, nothing for eager) to the last answer of the cold wave,
and its ratio to the engine's own graphs; generated tokens per second over each wave
(from its first ``add_request`` to its last answer), each with its ratio to the engine's
own graphs; the warm wave's median step; the worst step while graphs were being captured
(engine graphs: a step that captured inline; graphflow: a step while its capture thread
was alive, less the steps that checked a new graph, an eager step and a replay by design,
whose median and worst are in the JSON) and its ratio to the eager row's median step; the time until every key was ready (engine graphs: its warmup; foreground:
its capture; lazy: from ``serve`` until every key was live or failed, waited for up to
``--lazy-wait`` seconds after the warm wave); keys captured of planned; and the graph
memory (the bytes of the engine's own graph pool, or graphflow's pools and static
attention buffers, after the warm wave) with its ratio to the engine's own graph pool.
Under the table, a line for each row and wave whose tokens differ from the engine's own
graphs' (the eager row's where there are none): how many requests differ, and where the
earliest differing token was made: the step of each row (by the engine's token stamps)
and what served it (graphflow: the key, why it ran eagerly, whether it checked a new
graph; the engine: its own graph, or a capture inline).
The JSON has every wave's TTFT p50/p99, step counts, those first differences
(``differs_own``, ``differs_eager``) and the coverage of each graphflow row.
Targets: identical tokens in every row; graphflow's cold start shorter than the engine's
own graphs' and its warm tokens/s at or above theirs; lazy's worst step while capturing at
most 1.5x the eager row's median step; graph memory at most the engine's own pool.

Writes ``serve.txt``/``serve.json`` (``serve-SHAPE.*`` for another shape) into ``--out``,
with the device's name in both, after every row (a run stopped by a time limit keeps the
rows it finished); progress lines go to stdout as it runs. A row that raises is recorded
with its error, the other rows still run, and the script exits 1.
"""

from __future__ import annotations

import argparse
import bisect
import importlib.metadata
import json
import logging
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from typing import NamedTuple

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from graphflow.integrations.hf.batching import serve

ROWS = ("engine eager", "engine eager padded", "engine graphs", "graphflow foreground", "graphflow restart",
        "graphflow lazy")
WAVES = ("cold", "warm")

#: The issue's settings and workload for the large shapes.
_LARGE_SETTINGS = {"block_size": 32, "num_blocks": 2048, "max_batch_tokens": 1024, "max_requests_per_batch": 64,
                   "q_padding_interval_size": 64, "kv_padding_interval_size": 4096}
_LARGE = {"settings": _LARGE_SETTINGS, "requests": "128", "prompt": "16,1024", "output": "32,128",
          "rows": "engine eager,engine graphs,graphflow foreground,graphflow restart,graphflow lazy"}
SHAPES = {
    "default": {"family": "llama", "layers": 8, "hidden": 1024, "vocab": 32000, "requests": "64,256",
                "prompt": "16,384", "output": "16,128", "rows": ",".join(ROWS),
                "settings": {"block_size": 32, "num_blocks": 512, "max_batch_tokens": 512,
                             "max_requests_per_batch": 64, "q_padding_interval_size": 64,
                             "kv_padding_interval_size": 4096}},
    "12l": {"family": "llama", "layers": 12, "hidden": 1536, "vocab": 32000, **_LARGE},
    "8b": {"family": "qwen2", "layers": 32, "hidden": 4096, "vocab": 128256, **_LARGE},
}
SMOKE = {"layers": 2, "hidden": 128, "vocab": 512, "requests": "6", "prompt": "4,40", "output": "4,12",
         "settings": {"block_size": 16, "num_blocks": 32, "max_batch_tokens": 64, "max_requests_per_batch": 8,
                      "q_padding_interval_size": 16, "kv_padding_interval_size": 256}}

_BEGAN = time.perf_counter()


class Step(NamedTuple):
    """One step of a row: its seconds; whether graphs were being captured meanwhile; its
    wave; whether graphflow checked a new graph in it (an eager step and a replay by
    design); when it ended (``perf_counter``, as the engine stamps each token after its
    step); and what served it (graphflow: its key, and why it ran eagerly; the engine's
    own graphs: whether it captured inline)."""

    took: float
    capturing: bool
    wave: int
    checking: bool
    ended: float
    served: str


def say(line: str) -> None:
    print(f"[{time.perf_counter() - _BEGAN:7.1f} s] {line}", flush=True)


def build_model(family: str, layers: int, hidden: int, vocab: int, device: str):
    """A random model made where it runs, in its serving dtype: no weights on the CPU to copy
    (8 B parameters take seconds to draw on a GPU, minutes on its host)."""
    torch.manual_seed(0)
    if family == "qwen2":  # Llama-3-8B's shape: head_dim 128, 8 KV heads, intermediate 3.5x hidden
        from transformers import Qwen2Config as Config
        from transformers import Qwen2ForCausalLM as Model

        heads = max(hidden // 128, 1)
        config = Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 7 // 2,
                        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=min(8, heads),
                        max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                        tie_word_embeddings=False)
    else:
        from transformers import LlamaConfig as Config
        from transformers import LlamaForCausalLM as Model

        config = Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                        num_hidden_layers=layers, num_attention_heads=hidden // 64,
                        num_key_value_heads=max(hidden // 256, 1), max_position_embeddings=4096)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = Model._from_config(config, dtype=dtype)
    model.eval()
    model.set_attn_implementation("paged|sdpa")
    return model


def describe(model) -> str:
    config = model.config
    params = sum(p.numel() for p in model.parameters())
    return (f"random {type(model).__name__.removesuffix('ForCausalLM')}, {config.num_hidden_layers} layers, hidden "
            f"{config.hidden_size}, intermediate {config.intermediate_size}, {config.num_attention_heads} heads, "
            f"{config.num_key_value_heads} KV heads, vocab {config.vocab_size}, "
            f"{f'{params / 1e9:.2f} B' if params >= 1e9 else f'{params / 1e6:.1f} M'} parameters, "
            f"{str(model.dtype).removeprefix('torch.')}")


def workload(requests: int, vocab: int, prompt: tuple[int, int], output: tuple[int, int], seed: int):
    generator = torch.Generator().manual_seed(seed)
    prompts, news = [], []
    for _ in range(requests):
        n = int(torch.randint(prompt[0], prompt[1] + 1, (1,), generator=generator))
        prompts.append([int(t) for t in torch.randint(3, vocab, (n,), generator=generator)])
        news.append(int(torch.randint(output[0], output[1] + 1, (1,), generator=generator)))
    return prompts, news


class _Progress:
    """A foreground capture's lines, one in ``every`` (and every failure) printed."""

    def __init__(self, label: str, every: int = 16) -> None:
        self.label, self.every, self.count = label, every, 0

    def __call__(self, line: str) -> None:
        self.count += 1
        if self.count == 1 or self.count % self.every == 0 or "fail" in line.lower():
            say(f"{self.label}: {line}")


def run_row(row: str, model, prompts, news, settings: dict, longest: int, lazy_wait: float, label: str,
            saved: pathlib.Path | None = None, full_keys: str = "all") -> dict:
    """One row: a fresh manager over ``model``, set up as ``row`` says, serving the workload
    twice; everything it made is given back before it returns, or raises. ``saved``: where
    the foreground row saves its graphs and the restart row serves from; ``full_keys``:
    graphflow's ``serve(full_keys=...)``."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    cuda = next(model.parameters()).is_cuda
    label = f"{label}: {row}"
    config = ContinuousBatchingConfig(use_cuda_graph=row == "engine graphs", use_async_batching=False, **settings)
    generation = GenerationConfig(max_new_tokens=max(news), do_sample=False, eos_token_id=None, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=config)
    state = {"serving": None}
    try:
        return _serve_row(row, manager, state, prompts, news, longest, lazy_wait, label, cuda, saved, full_keys)
    finally:
        if manager.is_running():
            manager.stop(block=True, hard_stop=True)
        if state["serving"] is not None:
            state["serving"].close()
        if manager.batch_processor is not None:
            manager.batch_processor.__dict__.pop("_generation_step", None)
        model.destroy_cached_continuous_batching_manager()
        manager = None  # the engine and its cache go before the next row
        _sync(cuda)
        if cuda:
            torch.cuda.empty_cache()
        say(f"{label}: done")


def _serve_row(row: str, manager, state: dict, prompts, news, longest: int, lazy_wait: float, label: str,
               cuda: bool, saved: pathlib.Path | None, full_keys: str) -> dict:
    graphs = row == "engine graphs"
    manager.batch_processor = manager._create_batch_processor()
    processor = manager.batch_processor
    if row == "engine eager padded":
        processor.model_runner.pad_inputs = processor.inputs_and_outputs.use_cuda_graph_varlen = True
    _sync(cuda)
    serving = None
    say(f"{label}: manager built, setting up")
    began = time.perf_counter()
    if graphs:
        manager.warmup()
    elif row == "graphflow foreground":
        serving = state["serving"] = serve(manager, longest=longest, progress=_Progress(label), full_keys=full_keys)
    elif row == "graphflow restart":
        serving = state["serving"] = serve(manager, longest=longest, progress=_Progress(label), graphs_from=saved,
                                           full_keys=full_keys)
    elif row == "graphflow lazy":
        serving = state["serving"] = serve(manager, lazy=True, longest=longest, full_keys=full_keys)
    setup_s = time.perf_counter() - began
    if serving is not None:
        say(f"{label}: {len(serving.plan.keys)} keys planned; serve returned in {setup_s:.2f} s")
    elif graphs:
        say(f"{label}: engine warmup {setup_s:.2f} s")
    steps: list[Step] = []
    step = processor._generation_step
    wave_now = [0]
    served_by: list[str] = []
    if serving is not None:
        served = serving.coverage.served

        def counted(key, tokens, fallback):
            served_by.append(f"{key}" + (f", eager: {fallback}" if fallback is not None else ""))
            served(key, tokens, fallback)

        serving.coverage.served = counted

    def timed(model_):
        capturing = serving is not None and serving.capturing
        keys_before = len(processor.inputs_and_outputs.graphs._storage) if graphs else 0
        checks_before = _checks_done(serving)
        served_by.clear()
        start = time.perf_counter()
        step(model_)  # synchronous batching: the step's tokens are on the host when it returns
        ended = time.perf_counter()
        if graphs:
            capturing = len(processor.inputs_and_outputs.graphs._storage) > keys_before
        how = ("captured inline" if capturing else "own graph") if graphs else "; ".join(served_by) or "eager"
        steps.append(Step(ended - start, capturing, wave_now[0], _checks_done(serving) > checks_before, ended, how))

    processor._generation_step = timed
    manager.start()
    waves = []
    for index, wave in enumerate(WAVES):
        wave_now[0] = index
        submitted = time.perf_counter()
        ids = [manager.add_request(p, max_new_tokens=n, record_timestamps=True) for p, n in zip(prompts, news)]
        outputs = {}
        while len(outputs) < len(ids):
            result = manager.get_result(timeout=600)
            if result is None:
                raise RuntimeError(f"{label}: {wave} wave: no result within 600 s")
            if result.error is not None:
                raise RuntimeError(f"{label}: {wave} wave: request {result.request_id} failed: {result.error}")
            outputs[result.request_id] = result
        answered = time.perf_counter()
        served_s = answered - submitted
        tokens = [outputs[rid].generated_tokens for rid in ids]
        stamps = [outputs[rid].timestamps or [] for rid in ids]
        first = [outputs[rid].timestamps[0] - submitted for rid in ids if outputs[rid].timestamps]
        ours = [s.took for s in steps if s.wave == index]
        generated = sum(len(t) for t in tokens)
        waves.append({"wave": wave, "tokens": tokens, "stamps": stamps, "generated": generated, "served_s": served_s,
                      "tokens_per_s": generated / served_s, "ttft_p50_s": _quantile(first, 0.5),
                      "ttft_p99_s": _quantile(first, 0.99), "steps": len(ours),
                      "median_step_s": statistics.median(ours) if ours else None,
                      "worst_step_s": max(ours, default=None)})
        if index == 0:
            cold_start_s = answered - began
        say(f"{label}: {wave} wave: {len(ids)} answers, {generated} tokens in {served_s:.2f} s "
            f"({generated / served_s:.0f} tok/s), {len(ours)} steps"
            + (f"; cold start {cold_start_s:.2f} s" if index == 0 else ""))
    manager.stop(block=True)
    lazy_done = None
    if serving is not None and row == "graphflow lazy":
        if serving.capturing:
            say(f"{label}: waiting up to {lazy_wait:.0f} s for the lazy capture to finish the plan")
        lazy_done = serving.wait_captured(lazy_wait)
    saving = None
    if serving is not None and row == "graphflow foreground" and saved is not None and cuda:  # graphs to save
        serving.wait_captured(lazy_wait)
        saving = serving.save_graphs(saved)
        say(f"{label}: saved {saving.saved} FULL keys' graphs for the restart row"
            + (f"; left out {list(saving.left_out)}" if saving.left_out else ""))
    _sync(cuda)
    memory = _graph_memory(processor, serving) if cuda else None
    checking = [s.took for s in steps if s.checking]
    result = {"row": row, "waves": waves, "step_log": steps, "setup_s": setup_s, "cold_start_s": cold_start_s,
              "steps": len(steps), "median_step_s": statistics.median(s.took for s in steps),
              "worst_step_capturing_s": max((s.took for s in steps if s.capturing and not s.checking), default=None),
              "worst_step_s": max(s.took for s in steps),
              "checking_steps": len(checking), "median_checking_step_s": statistics.median(checking) if checking
              else None, "worst_checking_step_s": max(checking, default=None),
              "ready_s": setup_s if graphs else None, "graph_memory_bytes": memory}
    if graphs:
        result["keys_captured"] = len(processor.inputs_and_outputs.graphs._storage)
    if serving is not None:
        result["ready_s"] = serving.all_captured_s
        summary = serving.coverage.as_dict()
        memory_info = serving.memory
        result.update(keys_captured=summary["captured"], keys_planned=len(serving.plan.keys),
                      graph_steps=summary["graph_steps"], eager_steps=summary["eager_steps"],
                      unused_keys=len(summary["unused"]), pool_bytes=memory_info.get("pool_bytes"),
                      estimated_pool_bytes=memory_info.get("estimated_pool_bytes"), coverage=summary,
                      report=serving.report())
        if row == "graphflow lazy":
            result.update(lazy_finished=lazy_done, recording_pauses=serving.turns.pauses,
                          retried_keys=serving.retried)
        if saving is not None:
            result["saved_keys"] = saving.saved
        if serving.restart is not None:
            restart = serving.restart
            result["restart"] = {"restored": restart.restored, "captured": restart.captured,
                                 "refused": restart.refused, "seconds": restart.seconds,
                                 "left_out": list(restart.left_out), "built": restart.built}
            if memory is not None:  # restored graphs hold their blocks outside the pools
                result["graph_memory_bytes"] = memory + restart.built.get("memory_bytes", 0)
        state["serving"] = None
        serving.close()
    return result


def _checks_done(serving) -> int:
    """How many new graphs graphflow's steps have checked against the engine's eager step."""
    if serving is None:
        return 0
    checks = serving.checks
    return checks.on_first_use + checks.failed


def _graph_memory(processor, serving) -> int:
    """The bytes the row's graphs hold, read while it holds them: graphflow's pools and its
    static attention buffers, or the segments of the engine's own graph pool (its
    ``graph_pool_id``, where its captures and their warmups allocate); 0 for eager."""
    if serving is not None:
        cut = serving.capture.cut
        return (serving.capture.pools.nbytes() or 0) + (0 if cut is None else cut.buffers.nbytes)
    pool = getattr(processor.model_runner, "graph_pool_id", None)
    if pool is None:
        return 0
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) == tuple(pool))


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def compare(results: list[dict]) -> None:
    """Each row's tokens against the eager, padded eager and own-graphs rows, and its ratios to
    the engine's own graphs and the eager step, written into the row."""
    results = [r for r in results if "error" not in r]
    by_row = {r["row"]: r for r in results}
    eager, padded, own = (by_row.get(name) for name in ("engine eager", "engine eager padded", "engine graphs"))
    for r in results:
        for name, other in (("eager", eager), ("padded", padded), ("own", own)):
            r[f"identical_{name}"] = None if other is None else {
                w["wave"]: w["tokens"] == o["tokens"] for w, o in zip(r["waves"], other["waves"])}
            r[f"differs_{name}"] = None if other is None else {
                w["wave"]: _first_difference(r, other, index) for index, w in enumerate(r["waves"])}
        r["cold_start_vs_own"] = _over(r["cold_start_s"], own and own["cold_start_s"])
        for w, o in zip(r["waves"], own["waves"] if own else [None] * len(r["waves"])):
            w["tokens_per_s_vs_own"] = _over(w["tokens_per_s"], o and o["tokens_per_s"])
        r["graph_memory_vs_own"] = _over(r["graph_memory_bytes"], own and own["graph_memory_bytes"])
        r["worst_capturing_vs_eager_step"] = _over(r["worst_step_capturing_s"], eager and eager["median_step_s"])


def _first_difference(row: dict, other: dict, wave: int) -> dict | None:
    """Where ``row``'s tokens of one wave first part from ``other``'s: how many requests
    differ, and the earliest differing token (by when ``row`` made it): its request, its
    place, and the step of each row that made it, with what served that step. None where
    every token is the same."""
    mine, theirs = row["waves"][wave], other["waves"][wave]
    found = []
    for request, (a, b) in enumerate(zip(mine["tokens"], theirs["tokens"])):
        if a == b:
            continue
        token = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        found.append((_stamp(mine, request, token), _stamp(theirs, request, token), request, token))
    if not found:
        return None
    at, other_at, request, token = min(found, key=lambda f: (f[0] is None, f[0] or 0.0))
    return {"requests": len(found), "of": len(mine["tokens"]), "request": request, "token": token,
            "step": _step_of(row["step_log"], at), "other_step": _step_of(other["step_log"], other_at)}


def _stamp(wave: dict, request: int, token: int) -> float | None:
    stamps = wave["stamps"][request]
    return stamps[token] if token < len(stamps) else None


def _step_of(steps: list[Step], stamp: float | None) -> dict | None:
    """The step that made a token stamped at ``stamp``: the last to end before it (the
    engine stamps a step's tokens after the step), with its place and what served it."""
    if stamp is None:
        return None
    index = bisect.bisect_right([s.ended for s in steps], stamp) - 1
    if index < 0:
        return None
    return {"index": index, "served": steps[index].served, "checking": steps[index].checking}


def differences(results: list[dict]) -> list[str]:
    """A line for each row and wave whose tokens differ from the engine's own graphs' (the
    eager row's where there are none): where they first part, and what served each side."""
    lines = []
    for r in results:
        if "error" in r or r["row"] in ("engine graphs", "engine eager"):
            continue
        name, label = ("own", "the engine's own graphs") if r.get("differs_own") is not None else \
            ("eager", "the engine's eager step")
        for wave, first in (r.get(f"differs_{name}") or {}).items():
            if first is None:
                continue
            mine, theirs = first["step"], first["other_step"]
            lines.append(f"{r['row']}, {wave} wave: {first['requests']} of {first['of']} requests differ from "
                         f"{label}; first at request {first['request']} token {first['token']}, "
                         f"step {_described(mine)}; theirs: step {_described(theirs)}")
    return lines


def _described(step: dict | None) -> str:
    if step is None:
        return "?"
    return f"{step['index']} ({step['served']}{', a check' if step['checking'] else ''})"


def _over(value, reference) -> float | None:
    return None if value is None or not reference else value / reference


def table(results: list[dict], requests: int) -> str:
    eager = next((r for r in results if r["row"] == "engine eager" and "error" not in r), None)
    lines = [f"{requests} requests, served twice (cold, then warm)"
             + (f"; the eager row's median step {_ms(eager['median_step_s'])}, worst {_ms(eager['worst_step_s'])}"
                if eager else ""),
             (f"{'row':22} {'=eager':>6} {'=pad':>6} {'=own':>6} {'cold start':>10} {'vs own':>6} "
              f"{'cold tok/s':>10} {'vs own':>6} {'warm tok/s':>10} {'vs own':>6} {'warm step':>9} "
              f"{'worst capturing':>15} {'vs eager step':>13} {'ready s':>8} {'keys':>9} {'graph MiB':>9} "
              f"{'vs own':>6}")]
    for r in results:
        if "error" in r:
            lines.append(f"{r['row']:22} failed: {r['error']}")
            continue
        cold, warm = r["waves"]
        ready = "-" if r["ready_s"] is None else format(r["ready_s"], ".2f")
        if r["row"] == "graphflow lazy" and r.get("lazy_finished") is False:
            ready = "not yet"
        keys = f"{r.get('keys_captured', '-')}" + (f"/{r['keys_planned']}" if "keys_planned" in r else "")
        lines.append(
            f"{r['row']:22} {_same(r['identical_eager']):>6} {_same(r['identical_padded']):>6} "
            f"{_same(r['identical_own']):>6} {r['cold_start_s']:10.2f} {_ratio(r['cold_start_vs_own']):>6} "
            f"{cold['tokens_per_s']:10.0f} {_ratio(cold['tokens_per_s_vs_own']):>6} "
            f"{warm['tokens_per_s']:10.0f} {_ratio(warm['tokens_per_s_vs_own']):>6} {_ms(warm['median_step_s']):>9} "
            f"{_ms(r['worst_step_capturing_s']):>15} {_ratio(r['worst_capturing_vs_eager_step']):>13} "
            f"{ready:>8} {keys:>9} {(r['graph_memory_bytes'] or 0) / 2**20:9.1f} {_ratio(r['graph_memory_vs_own']):>6}"
            + (f"  pauses {r['recording_pauses']}, retried {r['retried_keys']}"
               if r.get("recording_pauses") is not None else ""))
    return "\n".join(lines + differences(results))


def _same(identical: dict | None) -> str:
    if identical is None:
        return "-"
    differing = [wave for wave, same in identical.items() if not same]
    return "y" if not differing else "n" if len(differing) == len(identical) else f"n:{differing[0]}"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="default",
                        help="model, engine settings, workload and rows (see the module docstring)")
    parser.add_argument("--requests", help="request counts, one workload each (default: the shape's)")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--prompt", help="prompt lengths, least,most")
    parser.add_argument("--output", help="new tokens, least,most")
    parser.add_argument("--rows", help=f"some of: {', '.join(ROWS)}")
    parser.add_argument("--lazy-wait", type=float, default=60.0,
                        help="seconds the lazy row waits after its warm wave for the rest of the plan (default 60)")
    parser.add_argument("--full-keys", choices=("all", "asked"), default="all",
                        help="graphflow's serve(full_keys=...): record every FULL key, or those steps ask for")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model and workload: checks the script")
    args = parser.parse_args()
    shape = dict(SHAPES[args.shape])
    if args.smoke:
        shape.update(SMOKE)
    for name in ("requests", "layers", "hidden", "vocab", "prompt", "output", "rows"):
        if getattr(args, name) is None:
            setattr(args, name, shape[name])
    settings = shape["settings"]
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    prompt = tuple(int(x) for x in args.prompt.split(","))
    output = tuple(int(x) for x in args.output.split(","))
    rows = [r.strip() for r in args.rows.split(",")]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        parser.error(f"--rows: unknown {', '.join(unknown)} (one of: {', '.join(ROWS)})")
    if device == "cpu":
        rows = [r for r in rows if r != "engine graphs"]  # the engine captures only on CUDA
    logger = logging.getLogger("graphflow")
    if not logger.handlers:  # graphflow's own lines (keys planned, a failed key) among the progress
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("  [%(name)s] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    say(f"serve_bench --shape {args.shape}{' --smoke' if args.smoke else ''} on {device_name}: building the model")
    built = time.perf_counter()
    model = build_model(shape["family"], args.layers, args.hidden, args.vocab, device)
    _sync(device == "cuda")
    described = describe(model)
    say(f"model: {described}, built on {device} in {time.perf_counter() - built:.1f} s")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    everything = {"device": device_name, "torch": torch.__version__,
                  "transformers": importlib.metadata.version("transformers"), "shape": args.shape,
                  "smoke": args.smoke, "model": described, "attention": "paged|sdpa", "settings": settings,
                  "full_keys": args.full_keys,
                  "prompt": prompt, "output": output, "rows": rows, "workloads": {}}
    stem = "serve" if args.shape == "default" else f"serve-{args.shape}"
    flags = f"{' --smoke' if args.smoke else ''}{' --full-keys asked' if args.full_keys == 'asked' else ''}"
    header = (f"# bench/serve_bench.py --shape {args.shape}{flags} on {device_name}, "
              f"torch {everything['torch']}, transformers {everything['transformers']}\n"
              f"# {everything['model']}, paged|sdpa; engine {settings}; prompts {prompt[0]}-{prompt[1]} tokens, "
              f"{output[0]}-{output[1]} new\n")
    tables: dict[int, str] = {}
    failed = False
    if "graphflow restart" in rows and "graphflow foreground" not in rows:
        parser.error("--rows: graphflow restart serves from the graphs the graphflow foreground row saves")
    # The foreground row saves its graphs only for a restart row to serve from.
    saved = pathlib.Path(tempfile.mkdtemp(prefix="serve-bench-graphs-")) if "graphflow restart" in rows else None
    for requests in (int(n) for n in args.requests.split(",")):
        prompts, news = workload(requests, args.vocab, prompt, output, seed=requests)
        longest = prompt[1] + output[1]
        results = []
        for row in rows:
            say(f"== {requests} requests: {row}")
            try:
                results.append(run_row(row, model, prompts, news, settings, longest, args.lazy_wait,
                                       f"{requests} requests", saved and saved / str(requests), args.full_keys))
            except Exception as exc:  # noqa: BLE001 - the other rows still run; this one says why it failed
                traceback.print_exc()
                results.append({"row": row, "error": f"{type(exc).__name__}: {exc}"})
                failed = True
            if "report" in results[-1]:
                print(results[-1]["report"], flush=True)
            # Written after every row: a run stopped by a time limit keeps the rows it finished.
            compare(results)
            tables[requests] = table(results, requests)
            everything["workloads"][requests] = [_recorded(r) for r in results]
            _write(out, stem, header + "\n\n".join(tables.values()) + "\n", everything)
        print(tables[requests], flush=True)
    if saved is not None:
        shutil.rmtree(saved, ignore_errors=True)
    text = header + "\n\n".join(tables.values()) + "\n"
    print(text, flush=True)
    say(f"wrote {out / stem}.txt and .json")
    return 1 if failed else 0


def _recorded(r: dict) -> dict:
    """A row as the JSON keeps it: everything but the tokens, their stamps and the steps."""
    if "waves" not in r:
        return r
    return {k: v for k, v in r.items() if k not in ("waves", "step_log")} | {
        "waves": [{k: v for k, v in w.items() if k not in ("tokens", "stamps")} for w in r["waves"]]}


def _write(out: pathlib.Path, stem: str, text: str, everything: dict) -> None:
    (out / f"{stem}.txt").write_text(text)
    (out / f"{stem}.json").write_text(json.dumps(everything, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
