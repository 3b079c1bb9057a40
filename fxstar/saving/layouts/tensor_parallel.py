"""Ranks that each hold shards of the model (tensor parallelism, or a 2-D mesh of tensor x data
parallelism) save one checkpoint through rank 0.

Every rank calls `save`: the parameters are gathered from the shards and every rank's training
state (its RNG, its shards of the optimizer moments, keyed by the fed names every rank shares)
is gathered to rank 0 over the engine's group (the mesh's: every rank), which alone writes
(one_process.write_whole); training.json records how the tensor_parallel pass cut each
parameter ("tensor_splits"), the mapping from the ranks' states to the logical one
(logical_state.py). Every rank returns once the checkpoint is whole (or raises rank 0's
error). Every rank calls `Checkpoint.apply` (`engine.load`) too: the full parameters are cut
into its shards by the store; at the same world size and tensor-parallel size it restores its
own rank's training state, so the run resumes bit for bit, and at another mesh it takes its
share of the logical state (reshard.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fxstar.saving.collective import checked, gather_to_rank_zero, on_rank_zero
from fxstar.saving.file_format import dedupe
from fxstar.saving.json_tree import to_json
from fxstar.saving.layouts.base import Layout
from fxstar.saving.layouts.one_process import write_whole
from fxstar.saving.training_state import training_state
from fxstar.saving.verified_reads import read_rank_state
from fxstar.saving.view import TrainingView

if TYPE_CHECKING:
    from fxstar.saving.checkpoint import Checkpoint


class TensorParallelRanks(Layout):
    """Ranks that hold shards: rank 0 writes everything, each rank restores its own state."""

    def write(self, view: TrainingView, path: str | os.PathLike) -> Path:
        params, aliases = dedupe(view.state_dict())  # collective: the shards gathered
        group = view.world.group
        # collective: every rank's training state to rank 0
        states = gather_to_rank_zero(group, lambda: to_json(training_state(view)))

        def write() -> Path:
            return write_whole(view, path, params, aliases,
                               checked(states, "give its training state"))  # fmt: skip

        return on_rank_zero(write, group)

    def state_of_rank(self, checkpoint: Checkpoint, rank: int) -> dict[str, Any]:
        return read_rank_state(checkpoint.path, checkpoint.meta, rank)
