"""How the ranks of a torch.distributed run divide between tensor and data parallelism.

Launched under `torchrun` (an initialised default process group), an engine is data parallel
over the ranks that tensor parallelism does not take: world = tensor_parallel.size x data
parallel size. Data parallelism runs on the chunk engine (chunk groups, each chunk's optimizer
state on its owner), so it needs device_memory or bf16/fp16; a plan without either would train
N independent replicas without a word, so it is refused (`data_parallel=False` asks for that).
The 2-D mesh (both at once) is not built yet and is refused too.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from fxstar.errors import OptionNotImplementedError, PlanError

__all__ = ["DP_GROUP", "data_parallel_size", "sharded_payloads"]

DP_GROUP = "data_parallel_group"  # Program.shared key: the engine's data-parallel group


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def data_parallel_size(plan: Any) -> int:
    """The number of data-parallel replicas this process is one of (1: none)."""
    world = _world()
    if not plan.data_parallel:
        return 1
    tp = plan.tensor_parallel.size if plan.tensor_parallel is not None else 1
    if world == 1 or tp == world:
        return 1
    if tp > 1:
        raise OptionNotImplementedError(
            f"tensor_parallel.size {tp} in a world of {world} ranks: data parallelism across "
            "tensor-parallel groups (a 2-D mesh) is not built yet; launch tp ranks only"
        )
    from fxstar.passes.chunk_layout import uses_chunks  # the passes import this module

    if not uses_chunks(plan):
        raise PlanError(
            f"this process is one of {world} ranks (torch.distributed is initialised): fxstar "
            "trains them data parallel through the chunk engine, which runs with device_memory "
            "set (or bf16/fp16); set device_memory (e.g. 'auto'), or data_parallel=False to "
            "train a model of its own in each process"
        )
    return world


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
