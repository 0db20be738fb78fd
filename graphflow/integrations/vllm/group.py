"""Which ranks capture together: the ranks of one vLLM engine, and their barrier namespace.

The plugin's barriers must span exactly the ranks that capture in lockstep. That is one
engine (one data-parallel rank), not ``torch.distributed``'s world: with data parallelism
vLLM 0.33 puts every DP engine of a MoE model into one world (``init_distributed_environment``
offsets a worker's rank by ``data_parallel_rank * world_size`` and sizes the world
``world_size_across_dp``), and lays it out ExternalDP x DP x PP x PCP x TP
(``initialize_model_parallel``). So one engine's ranks are a contiguous block of
``ParallelConfig.world_size`` ranks (PP x PCP x TP; x DP too under ``external_launcher``,
where the DP ranks are one SPMD program), block ``rank // world_size``, which is the DP
rank. Under elastic EP each engine gets a world of its own and the block is that world.

Barriers over the whole world would lock every engine's capture to every other's, and an
engine that captures again alone (elastic EP's ``warm_and_capture`` after a scale-up or
down) would wait for engines that never come. Over the engine's own block they do not.

The namespace names the block and the capture's number in this process. Every rank of an
engine runs the same captures in the same order, so the numbers agree; an engine restarted
is new processes in a new world (vLLM cannot take a process back into a DP world, and
elastic EP gives each engine its own), whose ranks all count from 1 again, together.

No vLLM or torch import: the caller passes the ranks and ``ParallelConfig``.
"""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["EngineGroup", "engine_group"]

#: Every key the plugin puts in a c10d store starts with this.
PREFIX = "graphflow-vllm"


@attrs.frozen
class EngineGroup:
    """The global ranks of one engine (``members``) and its index among the world's engines."""

    index: int
    members: tuple[int, ...]

    def namespace(self, generation: int) -> str:
        """The store namespace of this engine's ``generation``-th capture session."""
        return f"{PREFIX}/engine{self.index}/{generation}"


def engine_group(rank: int, world_size: int, parallel_config: Any) -> EngineGroup:
    """The engine of global ``rank`` in a ``torch.distributed`` world of ``world_size``.

    ``parallel_config`` is the worker's ``vllm.config.ParallelConfig``; its ``world_size``
    is one engine's rank count. A world that is not a whole number of such engines (a fork
    laying ranks out otherwise) is taken as one engine, so every rank still agrees.
    """
    size = int(getattr(parallel_config, "world_size", world_size) or world_size)
    if size < 1 or size > world_size or world_size % size:
        return EngineGroup(0, tuple(range(world_size)))
    index = rank // size
    return EngineGroup(index, tuple(range(index * size, (index + 1) * size)))
