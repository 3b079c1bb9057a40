"""The layouts of a checkpoint, one a module, each behind `Layout`: which one writes a
training-state view, and which one reads a checkpoint back."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fxstar.saving.layouts.base import (
    Layout,
    check_resumable,
    saved_data_parallel,
    saved_tensor_parallel,
)
from fxstar.saving.layouts.data_parallel import DataParallelRanks
from fxstar.saving.layouts.logical_state import LogicalState
from fxstar.saving.layouts.one_process import OneProcess
from fxstar.saving.layouts.reshard import resharded, reshards
from fxstar.saving.layouts.tensor_parallel import TensorParallelRanks
from fxstar.saving.view import World

__all__ = [
    "DataParallelRanks",
    "Layout",
    "LogicalState",
    "OneProcess",
    "TensorParallelRanks",
    "check_resumable",
    "layout_for",
    "layout_of",
    "resharded",
    "reshards",
]


def layout_for(world: World) -> Layout:
    """How the ranks of `world` write a checkpoint."""
    if world.data_parallel > 1 and world.tensor_parallel == 1:
        return DataParallelRanks()
    return OneProcess() if world.ranks == 1 else TensorParallelRanks()


def layout_of(meta: Mapping[str, Any]) -> Layout:
    """How the checkpoint whose training.json is `meta` was written: data parallel alone joins
    the ranks' optimizer states on reading (each rank's moments are whole parameters' of its
    own chunks; under tensor parallelism they are shards)."""
    if saved_data_parallel(meta) > 1 and saved_tensor_parallel(meta) == 1:
        return DataParallelRanks()
    return OneProcess() if meta.get("ranks", 1) == 1 else TensorParallelRanks()
