"""Topology: how an engine's ranks divide between tensor and data parallelism, the process
groups each kind of collective runs on, and the facts the passes and the runtime derive from
them (torchtitan's `ParallelDims` plays this part there).

Launched under `torchrun` (an initialised default process group), an engine is data parallel
over the ranks that tensor parallelism does not take: world = tensor_parallel.size x data
parallel size, the [dp, tp] grid of `MeshLayout` (fxstar/mesh.py). Data parallelism runs on
the chunk engine (chunk groups, each chunk's optimizer state on its owner), so it needs
device_memory or bf16/fp16; a plan without either would train N independent replicas without
a word, so it is refused (`data_parallel=False` asks for that).

One engine has one Topology; every capture reads it (`Program.topology`). It makes the
engine's process groups, at the first compile, in the same order on every rank (torch makes
every group on every rank), and has the ranks agree on each program before any pass runs
(`agree`, runtime/agreement.py). The groups, by name: TENSOR (this rank's tensor-parallel
group), DATA (its data-parallel group) and MESH (every rank, made on a 2-D mesh only: a
checkpoint save gathers every rank's state).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from fxstar.errors import PlanError
from fxstar.mesh import MeshLayout
from fxstar.runtime import agreement
from fxstar.runtime.rank_group import RankGroup, new_group, release_group

if TYPE_CHECKING:
    from fxstar.program import Program

__all__ = ["DATA", "MESH", "TENSOR", "Topology"]

TENSOR = "tensor-parallel"  # the group names, as step_check's errors name the ranks
DATA = "data-parallel"
MESH = "mesh"


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class Topology:
    """The plan's parallelism over this run's world: sizes, groups and what follows from them.
    Facts are read when asked (each refuses a plan that cannot run, where it is asked)."""

    def __init__(self, plan: Any, world: int | None = None):
        self.plan = plan
        self.world = _world() if world is None else world  # the default group's ranks
        self._groups: dict[str, RankGroup] = {}

    # -- sizes ----------------------------------------------------------------------------------

    @property
    def tp_size(self) -> int:
        """The ranks one tensor-parallel group has (1: none)."""
        config = self.plan.tensor_parallel
        return config.size if config is not None else 1

    @property
    def tensor_parallel(self) -> bool:
        return self.tp_size > 1

    @property
    def mesh(self) -> MeshLayout:
        """The world as a [dp, tp] grid; refuses a world the tensor-parallel size does not
        divide."""
        return MeshLayout(self.world, self.tp_size)

    @property
    def uses_chunks(self) -> bool:
        """A budget pages parameters through chunks; bf16/fp16 keep their low-precision copies
        and fp32 masters in chunks too (all resident when there is no budget)."""
        return self.plan.device_memory is not None or self.plan.precision != "fp32"

    @property
    def data_parallel_size(self) -> int:
        """The number of data-parallel replicas this process is one of (1: none)."""
        world, tp = self.world, self.tp_size
        if world == 1 or tp == world:
            return 1
        mesh = self.mesh  # refuses a world that tp does not divide
        if not self.plan.data_parallel:
            return 1
        if not self.uses_chunks:
            raise PlanError(
                f"this process is one of {world} ranks (torch.distributed is initialised): "
                "fxstar trains them data parallel through the chunk engine, which runs with "
                "device_memory set (or bf16/fp16); set device_memory (e.g. 'auto'), or "
                "data_parallel=False to train a model of its own in each process"
            )
        return mesh.dp

    @property
    def sharded_payloads(self) -> bool:
        """Whether the data-parallel ranks shard the chunks' payloads (plan.data_parallel_shard):
        'auto' does with Adam/AdamW, whose HybridAdam steps each rank's own chunks; a torch
        optimizer steps every parameter, so it needs them all on every rank."""
        shard, optimizer = self.plan.data_parallel_shard, self.plan.optimizer.type
        if shard == "auto":
            return optimizer in ("adam", "adamw")
        if shard == "params" and optimizer not in ("adam", "adamw"):
            raise PlanError(
                f"data_parallel_shard='params' with optimizer.type {optimizer!r}: a torch "
                "optimizer steps every parameter, so every rank needs them all; use 'adam' or "
                "'adamw' (HybridAdam steps each rank's own chunks) or "
                "data_parallel_shard='optimizer'"
            )
        return shard == "params"

    @property
    def load_unit(self) -> int:
        """Chunks one load brings to the compute tier: with sharded payloads a chunk's whole
        group, gathered by one all-gather into one block (ZeRO-3's gather); with
        mem_saving_comm, or without sharded payloads, the chunk alone (a broadcast from its
        owner, or a copy)."""
        size = self.data_parallel_size
        if size == 1 or self.plan.mem_saving_comm or not self.sharded_payloads:
            return 1
        return size

    # -- process groups -------------------------------------------------------------------------

    @property
    def tensor_group(self) -> RankGroup | None:
        """This rank's tensor-parallel group, once made."""
        return self._groups.get(TENSOR)

    @property
    def data_group(self) -> RankGroup | None:
        """This rank's data-parallel group, once made."""
        return self._groups.get(DATA)

    @property
    def whole_group(self) -> RankGroup | None:
        """The group over every rank of the engine's model: the mesh's, else the tensor- or the
        data-parallel one (one of them spans the world)."""
        for name in (MESH, TENSOR, DATA):
            if name in self._groups:
                return self._groups[name]
        return None

    def groups(self) -> dict[str, RankGroup]:
        """The groups made, by name."""
        return dict(self._groups)

    def agree(self, program: Program) -> None:
        """Before any pass, while nothing can have failed on one rank only: tensor parallel,
        the ranks of a group agree on the plan, the graph and (the first compile) the full
        parameters; data parallel, on the plan and the graph (the replicas' parameters are
        rank 0's, broadcast once the chunks hold them); on a 2-D mesh both, each over its own
        groups (tp groups are consecutive ranks, dp groups one rank of each), which together
        link every rank. Every rank raises the same error otherwise (runtime/agreement.py).
        The first call makes the groups, with plan.dist_timeout."""
        if not (dist.is_available() and dist.is_initialized()):
            return  # the tensor_parallel pass says what is missing
        mesh = self.mesh if self.tensor_parallel else None
        if self.data_parallel_size > 1:
            if DATA not in self._groups:
                self._make(DATA, mesh.dp_groups() if mesh is not None else None)
                if mesh is not None:
                    self._make(MESH, None)
            agreement.agree(program, self._groups[DATA], tensors=False)
        if mesh is None:
            return
        first = TENSOR not in self._groups
        if first:
            self._make(TENSOR, mesh.tp_partition())
        agreement.agree(program, self._groups[TENSOR], tensors=first)

    def _make(self, name: str, partition: list[list[int]] | None) -> None:
        """A group (collective: every rank, in the same order), destroyed once this topology
        is freed (or `release`d)."""
        group = self._groups[name] = new_group(self.plan.dist_timeout, partition)
        weakref.finalize(self, release_group, group).atexit = False

    def release(self) -> None:
        """Destroy the groups (the engine is closed or freed); twice is harmless."""
        for name in (TENSOR, DATA, MESH):
            release_group(self._groups.pop(name, None))
