"""How the ranks of a torch.distributed run divide between tensor and data parallelism.

Launched under `torchrun` (an initialised default process group), an engine is data parallel
over the ranks that tensor parallelism does not take: world = tensor_parallel.size x data
parallel size, a 2-D mesh laid out as torch's `init_device_mesh(..., (dp, tp))` lays it out:
tensor parallel is the inner dimension, so a tensor-parallel group is tp consecutive ranks
([0, 1], [2, 3] at tp 2 x dp 2; their collectives run every layer, the ranks nearest each
other get them) and a data-parallel group takes one rank of each ([0, 2], [1, 3]; they meet at
the step). `MeshLayout` is that arithmetic, plain and testable without a process group.

Data parallelism runs on the chunk engine (chunk groups, each chunk's optimizer state on its
owner), so it needs device_memory or bf16/fp16; a plan without either would train N
independent replicas without a word, so it is refused (`data_parallel=False` asks for that).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from fxstar.errors import PlanError

__all__ = [
    "DP_GROUP",
    "MESH_GROUP",
    "MeshLayout",
    "data_parallel_size",
    "mesh_layout",
    "sharded_payloads",
    "load_unit",
]

DP_GROUP = "data_parallel_group"  # Program.shared key: the engine's data-parallel group
MESH_GROUP = "mesh_group"  # Program.shared key: every rank of a 2-D mesh (checkpoint saves)


@dataclass(frozen=True)
class MeshLayout:
    """`world` ranks as a [dp, tp] grid, tensor parallel the inner (fastest) dimension."""

    world: int
    tp: int

    def __post_init__(self) -> None:
        if self.tp < 1 or self.world < 1 or self.world % self.tp:
            raise PlanError(
                f"tensor_parallel.size {self.tp} does not divide the world of {self.world} "
                "ranks: launch a multiple of the tensor-parallel size (world = tensor_parallel "
                "size x data-parallel replicas)"
            )

    @property
    def dp(self) -> int:
        """The number of data-parallel replicas (tensor-parallel groups)."""
        return self.world // self.tp

    def tp_groups(self) -> list[list[int]]:
        """Every tensor-parallel group's global ranks: consecutive runs of tp."""
        return [[d * self.tp + t for t in range(self.tp)] for d in range(self.dp)]

    def dp_groups(self) -> list[list[int]]:
        """Every data-parallel group's global ranks: the same tp rank of each replica."""
        return [[d * self.tp + t for d in range(self.dp)] for t in range(self.tp)]

    def tp_partition(self) -> list[list[int]] | None:
        """The tensor-parallel groups an engine makes: None when one spans every rank."""
        return self.tp_groups() if self.dp > 1 else None

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def dp_rank(self, rank: int) -> int:
        return rank // self.tp

    def tp_group_of(self, rank: int) -> list[int]:
        return self.tp_groups()[self.dp_rank(rank)]

    def dp_group_of(self, rank: int) -> list[int]:
        return self.dp_groups()[self.tp_rank(rank)]


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _tp_size(plan: Any) -> int:
    return plan.tensor_parallel.size if plan.tensor_parallel is not None else 1


def mesh_layout(plan: Any, world: int | None = None) -> MeshLayout:
    """This run's mesh: the world (the default group's, unless given) over the plan's
    tensor-parallel size."""
    return MeshLayout(_world() if world is None else world, _tp_size(plan))


def data_parallel_size(plan: Any) -> int:
    """The number of data-parallel replicas this process is one of (1: none)."""
    world = _world()
    tp = _tp_size(plan)
    if world == 1 or tp == world:
        return 1
    layout = MeshLayout(world, tp)  # refuses a world that tp does not divide
    if not plan.data_parallel:
        return 1
    from fxstar.passes.chunk_layout import uses_chunks  # the passes import this module

    if not uses_chunks(plan):
        raise PlanError(
            f"this process is one of {world} ranks (torch.distributed is initialised): fxstar "
            "trains them data parallel through the chunk engine, which runs with device_memory "
            "set (or bf16/fp16); set device_memory (e.g. 'auto'), or data_parallel=False to "
            "train a model of its own in each process"
        )
    return layout.dp


def sharded_payloads(plan: Any) -> bool:
    """Whether the data-parallel ranks shard the chunks' payloads (plan.data_parallel_shard):
    'auto' does with Adam/AdamW, whose HybridAdam steps each rank's own chunks; a torch
    optimizer steps every parameter, so it needs them all on every rank."""
    shard, optimizer = plan.data_parallel_shard, plan.optimizer.type
    if shard == "auto":
        return optimizer in ("adam", "adamw")
    if shard == "params" and optimizer not in ("adam", "adamw"):
        raise PlanError(
            f"data_parallel_shard='params' with optimizer.type {optimizer!r}: a torch optimizer "
            "steps every parameter, so every rank needs them all; use 'adam' or 'adamw' "
            "(HybridAdam steps each rank's own chunks) or data_parallel_shard='optimizer'"
        )
    return shard == "params"


def load_unit(plan: Any) -> int:
    """Chunks one load brings to the compute tier: with sharded payloads a chunk's whole group,
    gathered by one all-gather into one block (ZeRO-3's gather); with mem_saving_comm, or
    without sharded payloads, the chunk alone (a broadcast from its owner, or a copy)."""
    size = data_parallel_size(plan)
    if size == 1 or plan.mem_saving_comm or not sharded_payloads(plan):
        return 1
    return size
