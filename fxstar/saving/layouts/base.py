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
from fxstar.saving.file_format import TENSOR_SPLITS
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
    """A checkpoint resumes an engine of any (data-parallel x tensor-parallel) mesh: at the
    saved one each rank restores its own training state; without tensor parallelism on either
    side each data-parallel rank takes its own chunks' state from the joined one; else each
    rank takes its share of the logical state (layouts/reshard.py). Refused here: a
    checkpoint of several ranks with rank 0's training state only, and one that tensor
    parallelism split without recording how (both of an older fxstar), at another mesh."""
    ranks, saved_tp = meta.get("ranks", 1), saved_tensor_parallel(meta)
    if saved_tp == world.tensor_parallel == 1 and (saved_data_parallel(meta) > 1 or ranks == 1):
        return  # data parallel or one process: the optimizer state reshards by name
    if ranks != 1 and "rank_states" not in meta:
        raise CheckpointError(
            f"{path} was saved by {ranks} tensor-parallel ranks with rank 0's training "
            "state only (an older fxstar), so it cannot resume a run; load its parameters "
            "into the model before compile (fxstar.load(dir, model)) and start the "
            "optimizer afresh"
        )
    same = (ranks, saved_tp) == (world.ranks, world.tensor_parallel)
    if not same and saved_tp > 1 and TENSOR_SPLITS not in meta:
        raise CheckpointError(
            f"{path} was saved by {ranks} tensor-parallel ranks (tensor_parallel size "
            f"{saved_tp} x {saved_data_parallel(meta)} data-parallel replicas) by an fxstar "
            f"that did not record how it split the parameters; this engine runs on "
            f"{world.ranks} (size {world.tensor_parallel} x {world.data_parallel}): it "
            "resumes at the same world size and tensor-parallel size only; to start afresh "
            "from its weights, load its parameters into the model before compile "
            "(fxstar.load(dir, model))"
        )
