"""Plans and model factories for ``graphflow run`` under torchrun (tests/test_torchrun.py).

A rank of ``graphflow run`` builds its model from the factory the plan names, with the
channel handles it offers and nothing else, so test_tp's fault and legacy models are
rebuilt here from those handles (a handle says how the call made now is served, which
is how the fault knows it is inside capture). The torchrun ranks import this module
through PYTHONPATH, as a user's own model package would be.
"""

from __future__ import annotations

import pathlib
import time

import attrs
import torch

from graphflow.integrations.dsv4.config import DSV4Config
from graphflow.integrations.dsv4.model import DSV4Model
from graphflow.integrations.dsv4.tp import TPDecoderLayer, TPModel
from graphflow.plan.loader import dump_plan
from graphflow.plan import Channel, ChannelKind, WarmupPolicy
from graphflow.dist.trace import CallPath
from test_tp import FAULTY_RANK, LegacyAllReduce, LegacyDispatchLayer, plan_for

#: Long enough that a rank starved by the other jobs on a small machine still arrives;
#: a fault or a divergence ends the ranks through the store at once, not at this timeout.
SUCCESS_TIMEOUT_S = 60.0
#: The barrier timeout of the failing plans: a rank that waited for it would show.
FAILURE_TIMEOUT_S = 30.0
#: The barrier timeout of the plan whose rank hangs: the others wait exactly this long.
HANG_TIMEOUT_S = 4.0


class CaptureFaultLayer(TPDecoderLayer):
    """Raises in the capture of its first all-reduce's segment, on the rank the factory marks."""

    faulty = False

    def post_attention(self, o, post_mix, res_mix, x, h, ffn_post, ffn_logits) -> None:
        if self.faulty and self.tp.path() is CallPath.CAPTURED:
            raise RuntimeError(f"injected capture fault on rank {FAULTY_RANK}")
        super().post_attention(o, post_mix, res_mix, x, h, ffn_post, ffn_logits)


class WarmupHangLayer(TPDecoderLayer):
    """Never returns from its first warmup step, on the rank the factory marks."""

    hangs = False

    def post_attention(self, o, post_mix, res_mix, x, h, ffn_post, ffn_logits) -> None:
        if self.hangs and self.tp.path() is CallPath.EAGER_WARMUP:
            time.sleep(3600)
        super().post_attention(o, post_mix, res_mix, x, h, ffn_post, ffn_logits)


def build_hanging(*, device="cpu", plan=None, rank: int = 0, world_size: int = 1, channels=None,
                  **model_args) -> TPModel:
    WarmupHangLayer.hangs = rank == FAULTY_RANK
    return TPModel(DSV4Model(DSV4Config(**model_args), torch.device(device)), rank, world_size, channels["tp_ar"],
                   layer_type=WarmupHangLayer)


def build_faulty(*, device="cpu", plan=None, rank: int = 0, world_size: int = 1, channels=None,
                 **model_args) -> TPModel:
    CaptureFaultLayer.faulty = rank == FAULTY_RANK
    return TPModel(DSV4Model(DSV4Config(**model_args), torch.device(device)), rank, world_size, channels["tp_ar"],
                   layer_type=CaptureFaultLayer)


def build_legacy(*, device="cpu", plan=None, rank: int = 0, world_size: int = 1, channels=None,
                 **model_args) -> TPModel:
    """The legacy all-reduce (rank-local garbage in a placeholder warmup) feeding the legacy,
    host-routed expert dispatch: one all-reduce per expert the routing chose."""
    LegacyDispatchLayer.ep = channels["ep_ar"]
    return TPModel(DSV4Model(DSV4Config(**model_args), torch.device(device)), rank, world_size,
                   LegacyAllReduce(channels["tp_ar"], rank), layer_type=LegacyDispatchLayer)


def write_plans(folder: pathlib.Path) -> dict[str, pathlib.Path]:
    """The plan files the torchrun tests run, by name."""
    def timeout(plan, seconds: float):
        return attrs.evolve(plan, capture=attrs.evolve(plan.capture, barrier_timeout_s=seconds))

    plans = {
        "piecewise2": timeout(plan_for("piecewise", 2), SUCCESS_TIMEOUT_S),
        "full3": timeout(plan_for("full", 3), SUCCESS_TIMEOUT_S),
        "full2": timeout(plan_for("full", 2), SUCCESS_TIMEOUT_S),
        "fault": timeout(attrs.evolve(plan_for("full", 2), model="torchrun_models:build_faulty"), FAILURE_TIMEOUT_S),
        "placeholder": timeout(_legacy_plan(), FAILURE_TIMEOUT_S),
        "hang": timeout(attrs.evolve(plan_for("full", 2), model="torchrun_models:build_hanging"), HANG_TIMEOUT_S),
    }
    paths = {}
    for name, plan in plans.items():
        paths[name] = folder / f"{name}.yaml"
        paths[name].write_text(dump_plan(plan))
    return paths


def _legacy_plan():
    """test_tp's seed plan (``tp_ar`` warmup placeholder, an expert channel on every MoE
    segment) as a plan that forgot to mark its routing data-dependent: validation cannot
    see the hazard, so only the runtime's barriers stand between the ranks and a hang."""
    plan = plan_for("full", 2, policy=WarmupPolicy.PLACEHOLDER)
    ep = Channel("ep_ar", ChannelKind.ALL_REDUCE, "ep", 2, "target")
    segments = [attrs.evolve(s, data_dependent=False,
                             channels=[*s.channels, "ep_ar"] if s.name.endswith(".moe") else s.channels)
                for s in plan.segments]
    return attrs.evolve(plan, model="torchrun_models:build_legacy", channels=[*plan.channels, ep], segments=segments)
