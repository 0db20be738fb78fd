"""Serving under transformers' continuous batching: the engine eager, the engine with its own
graphs, graphflow foreground and graphflow lazy, side by side in one process.

    PYTHONPATH=. python3 bench/serve_bench.py --out DIR            # GPU: 64 and 256 requests
    PYTHONPATH=. python3 bench/serve_bench.py --out DIR --smoke    # CPU, tiny: checks the script

One random Llama (``--layers`` x ``--hidden``, bf16, nothing downloaded), attention
``paged|sdpa``, one workload per ``--requests`` (prompt and output lengths drawn once, the
same for every row), greedy. For each row a fresh manager over the same model:

* **engine eager**: ``use_cuda_graph=False``, padding off: the reference tokens;
* **engine eager padded**: the same with the padding the graphs need turned on: the
  engine's eager steps on the very batches every graph row replays (bf16 kernels sum in
  another order at another size, so padding alone can change a random model's tokens);
* **engine graphs**: ``use_cuda_graph=True`` after ``manager.warmup()`` (what it pre-captures);
  every other key is captured inline the first time a step asks for it;
* **graphflow foreground**: ``serve(manager)`` before ``start()``: every key captured and
  verified first;
* **graphflow lazy**: ``serve(manager, lazy=True)``: serving at once, keys captured beside it.

Columns: tokens identical to the eager row (y/n), to the padded eager row (``=pad``: the
exact reference of every graph row) and to the engine's own graphs (``=own``), generated tokens per second over the
serving time, time to first token p50 and p99 (from ``add_requests``), the median step,
the worst step while graphs were being captured (engine graphs: a step that captured
inline; lazy: a step while the capture thread was alive; foreground: capture is over
before serving, so its worst step), the time until every key was ready (engine graphs:
its warmup; foreground: its capture; lazy: from ``serve`` until every key was live or
failed), the graph memory (reserved bytes after the run over those once the manager's
cache and tensors were built), and for lazy how many times its recordings paused for a
step and how many keys were recorded again whole after a failed capture.
Targets (issue): identical tokens in every row; graphflow's
tokens/s at or above the engine's own graphs; lazy's worst step while capturing under 2x
the eager row's median step; everything live sooner than the engine's own warmup.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from graphflow.integrations.hf.batching import serve  # noqa: E402

ROWS = ("engine eager", "engine eager padded", "engine graphs", "graphflow foreground", "graphflow lazy")


def build_model(layers: int, hidden: int, vocab: int, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64,
                         num_key_value_heads=max(hidden // 256, 1), max_position_embeddings=4096)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = LlamaForCausalLM(config).to(device, dtype).eval()
    model.set_attn_implementation("paged|sdpa")
    return model


def workload(requests: int, vocab: int, prompt: tuple[int, int], output: tuple[int, int], seed: int):
    generator = torch.Generator().manual_seed(seed)
    prompts, news = [], []
    for _ in range(requests):
        n = int(torch.randint(prompt[0], prompt[1] + 1, (1,), generator=generator))
        prompts.append([int(t) for t in torch.randint(3, vocab, (n,), generator=generator)])
        news.append(int(torch.randint(output[0], output[1] + 1, (1,), generator=generator)))
    return prompts, news


def run_row(row: str, model, prompts, news, settings: dict, longest: int) -> dict:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    cuda = next(model.parameters()).is_cuda
    graphs = row == "engine graphs"
    config = ContinuousBatchingConfig(use_cuda_graph=graphs, use_async_batching=False, **settings)
    generation = GenerationConfig(max_new_tokens=max(news), do_sample=False, eos_token_id=None, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=config)
    manager.batch_processor = manager._create_batch_processor()
    processor = manager.batch_processor
    if row == "engine eager padded":
        processor.model_runner.pad_inputs = processor.inputs_and_outputs.use_cuda_graph_varlen = True
    _sync(cuda)
    reserved_built = torch.cuda.memory_reserved() if cuda else 0
    serving = None
    began = time.perf_counter()
    if graphs:
        manager.warmup()
    elif row == "graphflow foreground":
        serving = serve(manager, longest=longest, progress=lambda line: None)
    elif row == "graphflow lazy":
        serving = serve(manager, lazy=True, longest=longest)
    ready_s = time.perf_counter() - began if row != "graphflow lazy" else None
    steps = []
    step = processor._generation_step

    def timed(model_):
        capturing = serving is not None and serving.capturing
        keys_before = len(processor.inputs_and_outputs.graphs._storage) if graphs else 0
        start = time.perf_counter()
        step(model_)  # synchronous batching: the step's tokens are on the host when it returns
        took = time.perf_counter() - start
        if graphs:
            capturing = len(processor.inputs_and_outputs.graphs._storage) > keys_before
        steps.append((took, capturing))

    processor._generation_step = timed
    manager.start()
    submitted = time.perf_counter()
    ids = [manager.add_request(p, max_new_tokens=n, record_timestamps=True) for p, n in zip(prompts, news)]
    outputs = {}
    while len(outputs) < len(ids):
        result = manager.get_result(timeout=600)
        if result is None:
            raise RuntimeError(f"{row}: no result within 600 s")
        outputs[result.request_id] = result
    served_s = time.perf_counter() - submitted
    manager.stop(block=True)
    if serving is not None and serving.lazy:
        serving.wait_captured(600)
    _sync(cuda)
    memory = (torch.cuda.memory_reserved() - reserved_built) if cuda else None
    tokens = {rid: outputs[rid].generated_tokens for rid in ids}
    first = [outputs[rid].timestamps[0] - submitted for rid in ids if outputs[rid].timestamps]
    generated = sum(len(t) for t in tokens.values())
    result = {"row": row, "tokens": tokens, "generated": generated, "tokens_per_s": generated / served_s,
              "served_s": served_s, "ttft_p50_s": _quantile(first, 0.5), "ttft_p99_s": _quantile(first, 0.99),
              "steps": len(steps), "median_step_s": statistics.median(s for s, _ in steps),
              "worst_step_capturing_s": max((s for s, c in steps if c), default=None),
              "worst_step_s": max(s for s, _ in steps), "ready_s": ready_s, "graph_memory_bytes": memory}
    if graphs:
        result["keys_captured"] = len(processor.inputs_and_outputs.graphs._storage)
    if serving is not None:
        result["ready_s"] = serving.all_captured_s
        summary = serving.coverage.as_dict()
        result.update(keys_captured=summary["captured"], keys_planned=len(serving.plan.keys),
                      graph_steps=summary["graph_steps"], eager_steps=summary["eager_steps"],
                      unused_keys=len(summary["unused"]), pool_bytes=serving.memory.get("pool_bytes"),
                      estimated_pool_bytes=serving.memory.get("estimated_pool_bytes"), report=serving.report())
        if serving.lazy:
            result.update(recording_pauses=serving.turns.pauses, retried_keys=serving.retried)
        serving.close()
    processor.__dict__.pop("_generation_step", None)
    model.destroy_cached_continuous_batching_manager()
    manager = processor = None  # the engine and its cache go before the next row
    _sync(cuda)
    if cuda:
        torch.cuda.empty_cache()
    return result


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def table(results: list[dict], requests: int) -> str:
    eager = next(r for r in results if r["row"] == "engine eager")
    own = next((r for r in results if r["row"] == "engine graphs"), None)
    padded = next((r for r in results if r["row"] == "engine eager padded"), None)
    lines = [f"{requests} requests; the eager row's worst step {_ms(eager['worst_step_s'])}",
             f"{'row':22} {'same':>4} {'=pad':>4} {'=own':>4} {'tok/s':>8} {'vs own':>7} {'ttft p50':>9} {'ttft p99':>9} {'step':>8} "
             f"{'worst capturing':>15} {'vs eager step':>13} {'ready s':>8} {'keys':>9} {'graph MiB':>9}"]
    for r in results:
        same = "y" if r["tokens"] == eager["tokens"] else "n"
        as_own = "-" if own is None else "y" if r["tokens"] == own["tokens"] else "n"
        as_padded = "-" if padded is None else "y" if r["tokens"] == padded["tokens"] else "n"
        worst = r["worst_step_capturing_s"]
        keys = f"{r.get('keys_captured', '-')}" + (f"/{r['keys_planned']}" if "keys_planned" in r else "")
        lines.append(
            f"{r['row']:22} {same:>4} {as_padded:>4} {as_own:>4} {r['tokens_per_s']:8.0f} "
            f"{_ratio(r['tokens_per_s'] / own['tokens_per_s'] if own else None):>7} "
            f"{_ms(r['ttft_p50_s']):>9} {_ms(r['ttft_p99_s']):>9} {_ms(r['median_step_s']):>8} "
            f"{_ms(worst):>15} {_ratio(worst / eager['median_step_s'] if worst else None):>13} "
            f"{'-' if r['ready_s'] is None else format(r['ready_s'], '.2f'):>8} {keys:>9} "
            f"{(r['graph_memory_bytes'] or 0) / 2**20:9.1f}"
            + (f"  pauses {r['recording_pauses']}, retried {r['retried_keys']}" if "recording_pauses" in r else ""))
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out")
    parser.add_argument("--requests", default="64,256")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompt", default="16,384", help="prompt lengths, least,most")
    parser.add_argument("--output", default="16,128", help="new tokens, least,most")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model and workload: checks the script")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if args.smoke:
        args.requests, args.layers, args.hidden, args.vocab = "6", 2, 128, 512
        args.prompt, args.output = "4,40", "4,12"
    prompt = tuple(int(x) for x in args.prompt.split(","))
    output = tuple(int(x) for x in args.output.split(","))
    settings = (dict(block_size=16, num_blocks=32, max_batch_tokens=64, max_requests_per_batch=8,
                     q_padding_interval_size=16, kv_padding_interval_size=256) if args.smoke else
                dict(block_size=32, num_blocks=512, max_batch_tokens=512, max_requests_per_batch=64,
                     q_padding_interval_size=64, kv_padding_interval_size=4096))
    rows = [r.strip() for r in args.rows.split(",")]
    if device == "cpu":
        rows = [r for r in rows if r != "engine graphs"]  # the engine captures only on CUDA
    model = build_model(args.layers, args.hidden, args.vocab, device)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    everything = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                  "torch": torch.__version__, "model": f"random Llama, {args.layers} layers, hidden {args.hidden}",
                  "settings": settings, "workloads": {}}
    tables = []
    for requests in (int(n) for n in args.requests.split(",")):
        prompts, news = workload(requests, args.vocab, prompt, output, seed=requests)
        longest = prompt[1] + output[1]
        results = []
        for row in rows:
            print(f"== {requests} requests: {row}", flush=True)
            results.append(run_row(row, model, prompts, news, settings, longest))
            if "report" in results[-1]:
                print(results[-1]["report"], flush=True)
        tables.append(table(results, requests))
        print(tables[-1], flush=True)
        eager = results[0]["tokens"]
        padded = next((r["tokens"] for r in results if r["row"] == "engine eager padded"), None)
        everything["workloads"][requests] = [{k: v for k, v in r.items() if k != "tokens"} | {
            "identical": r["tokens"] == eager, "identical_padded": r["tokens"] == padded} for r in results]
    text = (f"# bench/serve_bench.py on {everything['device']}, torch {everything['torch']}, "
            f"{everything['model']}, paged|sdpa, bf16\n" + "\n\n".join(tables) + "\n")
    (out / "serve.txt").write_text(text)
    (out / "serve.json").write_text(json.dumps(everything, indent=1, default=str))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
