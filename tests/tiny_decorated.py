"""A three-layer decoder that declares its capture plan with graphflow's decorators.

Used by tests/test_decorators.py and by ``graphflow export --module
tests.tiny_decorated:build_model``. Each layer is split the way a decode step is split
for PIECEWISE capture: a graph before attention, an eager attention break, a graph
after it; the head is one more graph.
"""

from __future__ import annotations

import torch
from torch import nn

import graphflow


class DecoderLayer(nn.Module):
    layer = graphflow.position()
    q = graphflow.buffer("q{layer}", shape=("B", lambda m: m.hidden), dtype="float32", device="cuda:0")
    o = graphflow.buffer("o{layer}", shape=("B", lambda m: m.hidden), dtype="float32", device="cuda:0")

    def __init__(self, hidden: int):
        super().__init__()
        self.hidden = hidden
        self.wq = nn.Linear(hidden, hidden, bias=False)
        self.wo = nn.Linear(hidden, hidden, bias=False)

    @graphflow.segment("L{layer}.pre", reads=["x"], writes=["q{layer}"], stream="s0")
    def pre_attention(self, x, q):
        torch.matmul(x, self.wq.weight.t(), out=q)  # q: [B, H]

    @graphflow.eager_break("L{layer}.attn", reads=["q{layer}"], writes=["o{layer}"])
    def attention(self, q, o):
        torch.mul(torch.softmax(q, dim=-1), q, out=o)

    @graphflow.segment("L{layer}.post", reads=["o{layer}", "x"], writes=["x"], stream="s0")
    def post_attention(self, o, x):
        x.add_(self.wo(o))


class TinyDecoder(nn.Module):
    x = graphflow.buffer(shape=("B", lambda m: m.hidden), dtype="float32", device="cuda:0", role="input")
    logits = graphflow.buffer(shape=("B", lambda m: m.vocab), dtype="float32", device="cuda:0", role="output")
    s0 = graphflow.stream(device="cuda:0")

    def __init__(self, layers: int = 3, hidden: int = 16, vocab: int = 32):
        super().__init__()
        self.hidden, self.vocab = hidden, vocab
        self.layers = nn.ModuleList(DecoderLayer(hidden) for _ in range(layers))
        self.proj = nn.Linear(hidden, vocab, bias=False)

    @graphflow.step(name="tiny-decode", sizes=(1, 2, 4))
    def step(self, bufs):
        for i, layer in enumerate(self.layers):
            layer.pre_attention(bufs["x"], bufs[f"q{i}"])
            layer.attention(bufs[f"q{i}"], bufs[f"o{i}"])
            layer.post_attention(bufs[f"o{i}"], bufs["x"])
        self.head(bufs["x"], bufs["logits"])

    @graphflow.segment(reads=["x"], writes=["logits"], stream="s0")
    def head(self, x, logits):
        torch.matmul(x, self.proj.weight.t(), out=logits)  # logits: [B, V]


def build_model(layers: int = 3, hidden: int = 16, vocab: int = 32, device: str = "cpu") -> TinyDecoder:
    torch.manual_seed(0)
    return TinyDecoder(layers, hidden, vocab).to(device)


#: The plan TinyDecoder(layers=3) declares, written by hand as YAML.
TINY_PLAN_YAML = """\
graphflow: 1
name: tiny-decode
symbols: {B: [1, 2, 4]}
for_each: {layer: "range(3)"}
streams:
  s0: {device: "cuda:0"}
buffers:
  x:          {shape: [B, 16], dtype: float32, device: "cuda:0", role: input}
  "q{layer}": {shape: [B, 16], dtype: float32, device: "cuda:0"}
  "o{layer}": {shape: [B, 16], dtype: float32, device: "cuda:0"}
  logits:     {shape: [B, 32], dtype: float32, device: "cuda:0", role: output}
segments:
  - {name: "L{layer}.pre", kind: graph, call: "layers.{layer}.pre_attention",
     reads: [x], writes: ["q{layer}"], stream: s0}
  - {name: "L{layer}.attn", kind: eager, call: "layers.{layer}.attention",
     reads: ["q{layer}"], writes: ["o{layer}"]}
  - {name: "L{layer}.post", kind: graph, call: "layers.{layer}.post_attention",
     reads: ["o{layer}", x], writes: [x], stream: s0}
  - {name: head, kind: graph, call: head, reads: [x], writes: [logits], stream: s0}
capture:
  modes: [PIECEWISE]
  sizes: B
"""
