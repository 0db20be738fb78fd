"""A tiny model for the toy plans and the engine's tests: fast on a CPU, real on a GPU.

Per layer: ``pre`` (norm + linear, capturable), ``mix`` (an eager break: each row is
rolled by a shift read back to Python from that row, so it cannot be captured) and
``post`` (linear + residual, capturable); then a ``head``. ``blend`` is ``mix``'s
capturable stand-in for the FULL variant (``plans/toy_full.yaml``). Rows never mix,
so a padded batch gives the same rows as an unpadded one. Methods follow the engine's
calling convention: reads first, then writes, results written in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from graphflow.plan import Buffer, BufferRole, CaptureSettings, Mode, Plan, Prewarm, Segment, SegmentKind, Stream

__all__ = ["Toy", "ToyLayer", "build_toy", "toy_plan"]


class ToyLayer(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, hidden)
        self.down = nn.Linear(hidden, hidden)

    def pre(self, x: torch.Tensor, h: torch.Tensor) -> None:
        # x: [B, H] -> h: [B, H]
        torch.matmul(self.norm(x), self.up.weight.t(), out=h)
        h.add_(self.up.bias)

    def mix(self, h: torch.Tensor, m: torch.Tensor) -> None:
        # Data-dependent: the shift of each row is a Python int read from the row.
        for row in range(h.shape[0]):
            shift = int(h[row].argmax())
            m[row].copy_(h[row].roll(shift))

    def blend(self, h: torch.Tensor, m: torch.Tensor) -> None:
        torch.mul(h, torch.sigmoid(h), out=m)

    def post(self, m: torch.Tensor, x: torch.Tensor) -> None:
        # x += down(relu(m)), in place: x is read and written
        x.add_(self.down(torch.relu(m)))


class Toy(nn.Module):
    def __init__(self, layers: int, hidden: int, vocab: int):
        super().__init__()
        self.layers = nn.ModuleList(ToyLayer(hidden) for _ in range(layers))
        self.out = nn.Linear(hidden, vocab)

    def head(self, x: torch.Tensor, logits: torch.Tensor) -> None:
        # x: [B, H] -> logits: [B, V]
        logits.copy_(self.out(x))

    def step(self, x: torch.Tensor, logits: torch.Tensor, *, full: bool = False) -> None:
        """The whole step without graphflow, for comparisons."""
        for layer in self.layers:
            h = torch.empty_like(x)
            m = torch.empty_like(x)
            layer.pre(x, h)
            (layer.blend if full else layer.mix)(h, m)
            layer.post(m, x)
        self.head(x, logits)


def build_toy(layers: int = 2, hidden: int = 32, vocab: int = 64, seed: int = 0,
              device: torch.device | str = "cpu") -> Toy:
    """Seeded weights; inference only (no autograd on the static buffers)."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = Toy(layers, hidden, vocab)
    finally:
        torch.random.set_rng_state(generator_state)
    return model.requires_grad_(False).eval().to(device)


def toy_plan(layers: int = 3, *, hidden: int = 32, vocab: int = 64, sizes: Sequence[int] = (1, 2, 4, 8),
             modes: Sequence[Mode] = (Mode.PIECEWISE,), full: bool = False, device: str = "cuda:0",
             prewarm: Sequence[Prewarm] = (), warmup_iters: int = 1, atol: float = 0.0, rtol: float = 0.0) -> Plan:
    """The toy plan built in Python (what ``plans/toy.yaml`` says, for ``layers`` layers).

    ``full`` makes each layer's mix the capturable ``blend``, so FULL capture is allowed.
    """
    H, V = hidden, vocab
    buffers = [Buffer("x", ("B", H), "float32", device, role=BufferRole.INPUT)]
    segments = []
    for i in range(layers):
        buffers += [Buffer(f"h{i}", ("B", H), "float32", device), Buffer(f"m{i}", ("B", H), "float32", device)]
        segments += [
            Segment(f"L{i}.pre", SegmentKind.GRAPH, f"layers.{i}.pre", reads=("x",), writes=(f"h{i}",), stream="s0"),
            Segment(f"L{i}.mix", SegmentKind.GRAPH if full else SegmentKind.EAGER,
                    f"layers.{i}.{'blend' if full else 'mix'}", reads=(f"h{i}",), writes=(f"m{i}",),
                    stream="s0", data_dependent=not full),
            Segment(f"L{i}.post", SegmentKind.GRAPH, f"layers.{i}.post", reads=(f"m{i}", "x"), writes=("x",),
                    stream="s0"),
        ]
    buffers.append(Buffer("logits", ("B", V), "float32", device, role=BufferRole.OUTPUT))
    segments.append(Segment("head", SegmentKind.GRAPH, "head", reads=("x",), writes=("logits",), stream="s0"))
    return Plan(
        name=f"toy-{layers}l{'-full' if full else ''}", buffers=buffers, streams=[Stream("s0", device)],
        segments=segments, prewarm=prewarm, symbols={}, model="plans.toy_model:build_toy",
        model_args={"layers": layers, "hidden": H, "vocab": V, "seed": 0},
        capture=CaptureSettings(modes=tuple(modes), sizes=tuple(sizes), warmup_iters=warmup_iters, atol=atol, rtol=rtol),
    )
