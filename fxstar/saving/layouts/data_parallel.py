"""Data-parallel ranks (runtime/data_parallel.py) each write their own files into one scratch
directory rank 0 made, and any number of ranks reads them back.

Each rank writes its training state (the moments of its own chunks, its RNG; rank 0's is
training.safetensors, rank r's training.rank<r>.safetensors) and, with sharded payloads, its
own chunks' parameters (model.rank<r>.safetensors, rank 0's with the buffers; training.json's
"parameters" lists the files); replicated, rank 0 writes model.safetensors. Rank 0 checks the
target as a one-process save does, before any rank writes; it gathers only the records
(skeletons, checksums), writes training.json and the manifest and swaps the directory in; no
rank's tensors pass through another. training.json says "data_parallel": N.

Loading consolidates: the optimizer states of all ranks are joined into one (`fxstar.load`
returns that), and each rank of any number of data-parallel ranks, or one process, takes what
its own chunks need, so a checkpoint of 2 ranks resumes at 1, 2 or 4 (and on a mesh with
tensor parallelism, each rank cutting its shards from the joined state: reshard.py). At the
same world size each rank gets its own RNG state back, at another rank 0's.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fxstar.errors import CheckpointError
from fxstar.saving.collective import (
    checked,
    from_rank_zero,
    gather_to_rank_zero,
    on_rank_zero,
    rank_in,
)
from fxstar.saving.directory import new_scratch, prepare, swap_in
from fxstar.saving.file_format import (
    ALIASES_KEY,
    PARAMETERS,
    dedupe,
    rank_parameters_file,
    rank_tensors_file,
    seal,
    training_json,
    write_tensors,
)
from fxstar.saving.json_tree import to_json
from fxstar.saving.layouts.base import Layout
from fxstar.saving.training_state import training_state
from fxstar.saving.verified_reads import read_rank_state
from fxstar.saving.view import TrainingView

if TYPE_CHECKING:
    from fxstar.saving.checkpoint import Checkpoint

KEPT_CHUNKS = "fxstar_device_chunks"  # HybridAdam's device half, in its state dict


class DataParallelRanks(Layout):
    """Replicas of one model (no tensor parallelism): each writes its own part."""

    def write(self, view: TrainingView, path: str | os.PathLike) -> Path:
        """Every rank writes its own files into one scratch directory that rank 0 made: its
        training state (the moments of its own chunks, its RNG) and, with sharded payloads, the
        parameters of its own chunks (rank 0 adds the buffers; replicated, rank 0 writes them
        all). Rank 0 gathers the small records (skeletons, checksums), writes training.json and
        swaps the directory in: never a rank's state through another."""
        group = view.world.group
        rank = rank_in(group)
        made: Any = None
        if rank == 0:  # the same checks as a one-process save, before any rank writes
            try:
                target = prepare(path)
                scratch = new_scratch(target, "tmp")
                (scratch / target.name).mkdir()
                made = str(scratch / target.name)
            except CheckpointError as refused:
                made = refused
            except Exception as caught:
                made = CheckpointError(
                    f"rank 0 could not make the checkpoint's directory: {caught}"
                )
        made = from_rank_zero(made, group)
        if isinstance(made, Exception):
            raise made
        tmp = Path(made)
        parts = gather_to_rank_zero(group, lambda: _write_part(view, rank, tmp))

        def finish() -> Path:
            gathered = checked(parts, "write its part of the checkpoint")
            files = [f for _, records, _ in gathered for f in records
                     if f == PARAMETERS or f.startswith("model.")]  # fmt: skip
            aliases = {k: v for _, _, a in gathered for k, v in a.items()}
            meta = training_json(view, len(gathered), aliases, gathered[0][0], files)
            meta["rank_states"] = {
                str(r): {"tensors": rank_tensors_file(r), "state": skeleton}
                for r, (skeleton, _, _) in enumerate(gathered) if r > 0
            }  # fmt: skip
            seal(tmp, meta, {f: r for _, records, _ in gathered for f, r in records.items()})
            return swap_in(tmp.parent, target)

        def saved() -> Path:
            try:
                return finish()
            except BaseException:
                shutil.rmtree(tmp.parent, ignore_errors=True)
                raise

        return on_rank_zero(saved, group)

    def read(
        self, directory: Path, meta: Mapping[str, Any], state: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[int, Any]]:
        """Rank 0's training state, its optimizer state joined with every other rank's (each
        held the moments of its own chunks only, under the positions of the same parameter
        list); and each rank's RNG state, read on the way."""
        merged = dict(state["optimizer"]["state"])
        rngs = {0: state["rng"]}
        kept = state["optimizer"].get(KEPT_CHUNKS)
        for rank in range(1, int(meta["ranks"])):
            other = read_rank_state(directory, meta, rank)
            merged.update(other["optimizer"]["state"])
            rngs[rank] = other["rng"]
            theirs = other["optimizer"].get(KEPT_CHUNKS)
            if kept is not None and theirs is not None:
                kept = sorted({*kept, *theirs})
        optimizer = {**state["optimizer"], "state": merged}
        if KEPT_CHUNKS in optimizer:
            optimizer[KEPT_CHUNKS] = kept
        return {**state, "optimizer": optimizer}, rngs

    def state_of_rank(self, checkpoint: Checkpoint, rank: int) -> dict[str, Any]:
        """The consolidated state, with the rank's own RNG."""
        return {**checkpoint.state, "rng": checkpoint.rank_rngs[rank]}


def _write_part(
    view: TrainingView, rank: int, tmp: Path
) -> tuple[Any, dict[str, Any], dict[str, str]]:
    """This rank's files in `tmp`: (its state's skeleton, the files' records, aliases)."""
    if view.sharded or rank == 0:
        mine = {k: v for k, v in view.rank_state_dict().items()  # sharded: meta are others'
                if not v.is_meta and (rank == 0 or k in view.parameter_names)}  # fmt: skip
        params, aliases = dedupe(mine)
    else:
        params, aliases = {}, {}
    skeleton, tensors = to_json(training_state(view, deferred=True))
    state_file = rank_tensors_file(rank)
    records = {state_file: write_tensors(tmp, state_file, tensors, {"format": "pt"})}
    file = rank_parameters_file(rank) if view.sharded else PARAMETERS
    if params or rank == 0:
        header = {"format": "pt", ALIASES_KEY: json.dumps(aliases)}
        records[file] = write_tensors(tmp, file, params, header)
    return skeleton, records, aliases
