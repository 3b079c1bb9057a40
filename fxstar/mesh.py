"""How the ranks of a torch.distributed run divide between tensor and data parallelism.

World = tensor_parallel.size x data-parallel size, a 2-D mesh laid out as torch's
`init_device_mesh(..., (dp, tp))` lays it out: tensor parallel is the inner dimension, so a
tensor-parallel group is tp consecutive ranks ([0, 1], [2, 3] at tp 2 x dp 2; their
collectives run every layer, the ranks nearest each other get them) and a data-parallel group
takes one rank of each ([0, 2], [1, 3]; they meet at the step). `MeshLayout` is that
arithmetic, plain and testable without a process group; fxstar/topology.py holds the groups an
engine makes from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from fxstar.errors import PlanError

__all__ = ["MeshLayout"]


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
