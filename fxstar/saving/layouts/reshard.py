"""A checkpoint resumed on another (data-parallel x tensor-parallel) mesh: tensor parallel
2 -> 1, 1 -> 2, 2x2 -> 1x4, 4 -> 2x2, one process -> any.

Each rank of the resuming engine takes its share of the checkpoint's logical state
(logical_state.py), one parameter at a time: a parameter's whole state is glued from the saved
ranks' shards, cut as this rank's tensor_parallel pass cut the parameter (its own
`tensor_splits`, the pass's own `shard_of`), and let go. A rank takes the state of the
parameters it steps only (HybridAdam under data parallelism: its own chunks'), so it holds
its own share of the optimizer state, as at the size it was saved at, and one parameter's
whole state at a time. The parameters themselves are cut by the parameter store as on every
load. Gluing and cutting move values, never compute them: right after the load every rank's
parameters and optimizer state are the saved run's, bit for bit.

What another mesh cannot take over:
- the random generators of each process (torch's CPU and CUDA generators, Python's, NumPy's)
  are saved rank 0's on every rank: one per saved rank exists, and the ranks of another
  mesh are other processes;
- the tensor-parallel RNG streams (dropout on split tensors) are the saved streams of the same
  tensor-parallel coordinate when the tensor-parallel size is the same (another number of
  replicas); at another size the masks are drawn on shards of another width, so no saved
  stream continues them: each rank keeps the stream its engine was compiled with;
- HybridAdam's choice of the chunks kept on the compute tier names chunks of the saved
  layout: it is made again at the next step;
- the step counters, the loss scaler, an attached scheduler and registered objects are
  rank 0's (every rank holds the same, but for registered objects a user keeps per rank).
Training goes on from the same state, but a tensor-parallel matmul of another split sums in
another order: the losses after the resume differ from the uninterrupted run's by rounding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fxstar.checkpoint_values import check_state
from fxstar.saving.file_format import STATE
from fxstar.saving.layouts.base import saved_tensor_parallel
from fxstar.saving.layouts.data_parallel import KEPT_CHUNKS
from fxstar.saving.layouts.logical_state import LogicalState, take_share
from fxstar.saving.view import TrainingView, World

if TYPE_CHECKING:
    from fxstar.saving.checkpoint import Checkpoint

__all__ = ["reshards", "resharded"]


def reshards(meta: Mapping[str, Any], world: World) -> bool:
    """Whether `world` resumes the checkpoint on another mesh through a logical state: any
    change where tensor parallelism takes part (without it, the data-parallel layout joins
    the ranks' states by name)."""
    saved_tp = saved_tensor_parallel(meta)
    if saved_tp == world.tensor_parallel == 1:
        return False
    return (int(meta.get("ranks", 1)), saved_tp) != (world.ranks, world.tensor_parallel)


def resharded(checkpoint: Checkpoint, view: TrainingView) -> tuple[dict[str, Any], TrainingView]:
    """This rank's training state from a checkpoint of another mesh (see the module), and the
    view to restore it through: without the rank's RNG stream where none continues it."""
    logical = LogicalState(checkpoint)
    world = view.world
    tp_ranks, tp_rank = world.tensor_parallel, world.mesh.tp_rank(world.rank())
    saved = checkpoint.state
    names = [name for group in saved["optimizer_params"] for name in group]
    entries = {}
    for index, name in enumerate(names):
        if view.stepped is not None and name not in view.stepped:
            continue  # another data-parallel rank steps it
        whole = logical.entry(name)
        if whole is not None:
            split = view.tensor_splits.get(name)
            entries[index] = take_share(logical, name, whole, split, tp_ranks, tp_rank)
        del whole
    optimizer = {**saved["optimizer"], "state": entries}
    if KEPT_CHUNKS in optimizer:  # chunk ids of the saved layout: chosen again
        optimizer[KEPT_CHUNKS] = None
    rng = {key: value for key, value in saved["rng"].items() if key != "tensor_parallel"}
    stream = None
    if tp_ranks == logical.tensor_parallel > 1:  # saved rank tp_rank: coordinate (0, tp_rank)
        stream = logical.rank_stream(tp_rank)
    if stream is not None:
        rng["tensor_parallel"] = stream
    else:
        view = dataclasses.replace(view, rank_stream=None)
    state = {**saved, "rng": rng, "optimizer": optimizer}
    check_state(state, checkpoint.path / STATE)
    return state, view
