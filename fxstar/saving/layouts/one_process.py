"""One process writes the whole checkpoint: the parameters in model.safetensors, the training
state in training.safetensors and training.json (fxstar/saving/file_format.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from fxstar.errors import CheckpointError
from fxstar.saving.directory import write_atomically
from fxstar.saving.file_format import (
    ALIASES_KEY,
    PARAMETERS,
    TENSORS,
    dedupe,
    rank_tensors_file,
    seal,
    training_json,
    write_tensors,
)
from fxstar.saving.json_tree import to_json
from fxstar.saving.layouts.base import Layout
from fxstar.saving.training_state import training_state
from fxstar.saving.view import TrainingView


class OneProcess(Layout):
    """A process that trains the model alone."""

    def write(self, view: TrainingView, path: str | os.PathLike) -> Path:
        params, aliases = dedupe(view.state_dict())
        state = to_json(training_state(view, deferred=True))  # written a disk chunk at a time
        return write_whole(view, path, params, aliases, [state])


def write_whole(view: TrainingView, path: str | os.PathLike, params: dict[str, torch.Tensor],
                aliases: dict[str, str], states: list[tuple[Any, dict]]) -> Path:  # fmt: skip
    """Write the whole parameters and every rank's training state (skeleton, tensors) from this
    process: rank 0's where a one-process save puts it, rank r's tensors in
    `training.rank<r>.safetensors` and its skeleton under "rank_states"/"<r>" of
    training.json."""
    ranks = view.world.ranks
    if len(states) != ranks:
        raise CheckpointError(f"{len(states)} training states for {ranks} ranks")
    skeleton, tensors = states[0]
    meta = training_json(view, ranks, aliases, skeleton, [PARAMETERS])
    files = [(PARAMETERS, params, {"format": "pt", ALIASES_KEY: json.dumps(aliases)}),
             (TENSORS, tensors, {"format": "pt"})]  # fmt: skip
    if ranks > 1:  # the other ranks' training states: their own RNG and optimizer shards
        meta["rank_states"] = {}
        for rank, (rank_skeleton, rank_tensors) in enumerate(states[1:], start=1):
            file = rank_tensors_file(rank)
            meta["rank_states"][str(rank)] = {"tensors": file, "state": rank_skeleton}
            files.append((file, rank_tensors, {"format": "pt"}))

    def write(tmp: Path) -> None:
        records = {name: write_tensors(tmp, name, content, metadata)  # tensor by tensor
                   for name, content, metadata in files}  # fmt: skip
        seal(tmp, meta, records)

    return write_atomically(path, write)
