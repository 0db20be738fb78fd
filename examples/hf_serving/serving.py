"""A random Llama (nothing downloaded) served by transformers' continuous batching, with
graphflow capturing its graphs.

    python examples/hf_serving/serving.py            # foreground: the PIECEWISE keys first, the FULL ones beside
    python examples/hf_serving/serving.py --lazy     # serving at once, keys captured beside it
    graphflow show --serving examples.hf_serving.serving:manager    # the plan, before any capture

On a GPU the graphs are CUDA graphs; without one graphflow runs the same steps on its CPU
backend (no graphs), which shows the wiring and the coverage table. torch and transformers
load inside the functions, so the script says what it does before the seconds they take.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

CONFIG = dict(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=2048)
#: The engine's settings: its cache, batches and padding decide graphflow's keys.
BATCHING = dict(block_size=32, num_blocks=64, max_batch_tokens=128, max_requests_per_batch=16,
                q_padding_interval_size=32, kv_padding_interval_size=1024, use_async_batching=False)
NEW_TOKENS = 24


def model(device: str | None = None):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    built = LlamaForCausalLM(LlamaConfig(**CONFIG)).to(device, torch.bfloat16 if device == "cuda" else None).eval()
    built.set_attn_implementation("paged|sdpa")
    return built


def manager(built=None):
    """The continuous-batching manager ``graphflow show --serving`` and ``main`` use."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    built = built if built is not None else model()
    generation = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    return built.init_continuous_batching(generation_config=generation,
                                          continuous_batching_config=ContinuousBatchingConfig(**BATCHING))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lazy", action="store_true", help="serve at once, capture keys in the background")
    parser.add_argument("--requests", type=int, default=24)
    args = parser.parse_args()
    say(f"loading torch and transformers, then building a random Llama ({CONFIG['num_hidden_layers']} layers) and "
        f"serving {args.requests} requests, graphs captured "
        + ("beside serving" if args.lazy else "before serving (the PIECEWISE ones; the FULL ones beside it)"))
    import torch

    from graphflow.integrations.hf.batching import serve

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)
    began = time.perf_counter()
    engine = manager()
    say(f"model and engine built in {time.perf_counter() - began:.1f} s; graphflow reads the engine's keys"
        + ("" if args.lazy else " and captures the PIECEWISE keys before serving"))
    serving = serve(engine, lazy=args.lazy, longest=100 + NEW_TOKENS)
    generator = torch.Generator().manual_seed(1)
    prompts = [[int(t) for t in torch.randint(3, CONFIG["vocab_size"], (int(n),), generator=generator)]
               for n in torch.randint(4, 100, (args.requests,), generator=generator)]
    began = time.perf_counter()
    engine.start()
    engine.add_requests(prompts, max_new_tokens=NEW_TOKENS)
    done = [engine.get_result(timeout=300) for _ in prompts]
    engine.stop(block=True)
    print(f"{len(done)} requests, {sum(len(r.generated_tokens) for r in done)} tokens in "
          f"{time.perf_counter() - began:.2f} s")
    print(serving.report())
    serving.close()
    return 0


def say(line: str) -> None:
    print(f"hf_serving: {line}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
