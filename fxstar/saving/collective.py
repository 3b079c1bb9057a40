"""The collectives ranks that save one checkpoint together run, on the engine's process group:
each bounded by plan.dist_timeout and named when it fails (rank_group.guard), never a hang."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from fxstar.errors import CheckpointError
from fxstar.runtime.rank_group import RankGroup, guard, host_process_group, process_group


def rank_in(group: RankGroup | None) -> int:
    """This process's rank in `group` (a tensor-parallel row of a mesh starts anywhere)."""
    return dist.get_rank(process_group(group))


def gather_to_rank_zero(group: RankGroup | None, give: Callable[[], Any]) -> list[Any]:
    """Every rank's `give()` on rank 0, in rank order (empty elsewhere). A rank whose `give`
    raised sends the error's text instead (see `checked`), so no rank waits for a part that
    never comes."""
    try:
        mine: Any = give()
    except Exception as caught:
        mine = _Failed(f"{type(caught).__name__}: {caught}")
    pg = host_process_group(group)
    rank = rank_in(group)
    gathered: list[Any] | None = [None] * dist.get_world_size(pg) if rank == 0 else None
    # on the engine's group: bounded by plan.dist_timeout, a failure named (not a hang)
    with guard("gather_object (checkpoint save)", group):
        dist.gather_object(mine, gathered, group=pg, group_dst=0)
    return gathered if rank == 0 else []


class _Failed(str):
    """What a rank sent `gather_to_rank_zero` instead of its part: why it could not give it."""


def checked(gathered: list[Any], doing: str) -> list[Any]:
    """`gathered`, or a CheckpointError naming the first rank that could not do `doing`. Run
    inside `on_rank_zero`, so every rank learns of it."""
    for rank, part in enumerate(gathered):
        if isinstance(part, _Failed):
            raise CheckpointError(f"rank {rank} could not {doing}: {part}")
    return gathered


def on_rank_zero(save: Callable[[], Path], group: RankGroup | None = None) -> Path:
    """Run `save` on rank 0 alone; every rank returns its path, or raises if it failed, so none
    goes on before the checkpoint is whole (a barrier that carries the outcome)."""
    outcome: Any = None
    error = None
    if rank_in(group) == 0:
        try:
            outcome = save()
        except Exception as caught:  # told to the other ranks first, then raised here
            error = caught
            outcome = CheckpointError(f"rank 0 failed to save the checkpoint: {caught}")
    outcome = from_rank_zero(outcome, group)
    if error is not None:
        raise error
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def from_rank_zero(value: Any, group: RankGroup | None) -> Any:
    """Rank 0's `value` on every rank (the others' is ignored)."""
    box = [value]
    with guard("broadcast_object_list (checkpoint save)", group):
        dist.broadcast_object_list(box, group=host_process_group(group), group_src=0)
    return box[0]
