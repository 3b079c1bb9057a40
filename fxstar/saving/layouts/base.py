"""What every layout does, and what a checkpoint's training.json says of the ranks that saved it.

A layout is how the ranks of one model share a checkpoint: who writes which files, what `load`
makes of them, and which training state each rank restores.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fxstar.errors import CheckpointError
from fxstar.saving.view import TrainingView, World

if TYPE_CHECKING:
    from fxstar.saving.checkpoint import Checkpoint


class Layout:
    """Writes a training-state view into a directory and reads it back (see the module)."""

    def write(self, view: TrainingView, path: str | os.PathLike) -> Path:
        """Write `view`'s checkpoint to directory `path`, replacing any there atomically; every
        rank of the view's world calls it."""
        raise NotImplementedError

    def read(
        self, directory: Path, meta: Mapping[str, Any], state: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[int, Any]]:
        """The training state `load` gives from rank 0's `state` as written, and each rank's
        RNG state by rank where that state joins several ranks'."""
        return state, {}

    def state_of_rank(self, checkpoint: Checkpoint, rank: int) -> dict[str, Any]:
        """The training state rank `rank` (> 0) of the saving world restores."""
        return checkpoint.state


def saved_tensor_parallel(meta: Mapping[str, Any]) -> int:
    """The tensor-parallel size a checkpoint was saved at (1: none)."""
    plan = meta.get("plan")
    saved = plan.get("tensor_parallel") if isinstance(plan, dict) else None
    return int(saved.get("size", 1)) if isinstance(saved, dict) else 1


def saved_data_parallel(meta: Mapping[str, Any]) -> int:
    """The data-parallel ranks a checkpoint was saved by (1: none)."""
    return int(meta.get("data_parallel", 1))


def check_resumable(path: Path, meta: Mapping[str, Any], world: World) -> None:
    """A tensor-parallel checkpoint resumes an engine of the same world and tensor-parallel
    size, each rank from its own training state; a data-parallel one (or a one-process one)
    resumes one without tensor parallelism at any number of data-parallel ranks, each
    taking the optimizer state of its own chunks from the consolidated state (the RNG
    states are the ranks' own at the same world size, rank 0's otherwise); anything else is
    refused here."""
    ranks, mine = meta.get("ranks", 1), world.ranks
    saved_tp, my_tp = saved_tensor_parallel(meta), world.tensor_parallel
    if saved_tp == my_tp == 1 and (saved_data_parallel(meta) > 1 or ranks == 1):
        return  # data parallel or one process: the optimizer state reshards by name
    if ranks != mine or (ranks != 1 and saved_tp != my_tp):
        raise CheckpointError(
            f"{path} was saved by {ranks} tensor-parallel ranks (tensor_parallel size "
            f"{saved_tp} x {saved_data_parallel(meta)} data-parallel replicas); this engine "
            f"runs on {mine} (size {my_tp} x {world.data_parallel}): a run resumes "
            "at the same world size and tensor-parallel size only (resharding tensor-"
            "parallel optimizer state is not supported); to start afresh from its weights, "
            "load its parameters into the model before compile (fxstar.load(dir, model))"
        )
    if "rank_states" not in meta:
        raise CheckpointError(
            f"{path} was saved by {ranks} tensor-parallel ranks with rank 0's training "
            "state only (an older fxstar), so it cannot resume a run; load its parameters "
            "into the model before compile (fxstar.load(dir, model)) and start the "
            "optimizer afresh"
        )
