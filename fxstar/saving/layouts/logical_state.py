"""A checkpoint's optimizer state as one logical state: each parameter's whole state (its
moments of the whole parameter's shape, its step), drawn one parameter at a time from the
ranks that saved it, whatever mesh saved it.

Every layout writes the mapping to it. Rank r of a mesh of `tp` tensor-parallel ranks per
replica sits at tensor-parallel coordinate r % tp (fxstar/mesh.py: tensor parallel the inner
dimension); its training state names the parameters its optimizer holds ("optimizer_params")
and holds the state of those it steps (HybridAdam under data parallelism: its own chunks'),
of its own shard where the tensor_parallel pass split one; training.json's "tensor_splits"
records how the pass cut each ({name: [dim, parts]}, a fused projection's parts each split on
their own). So a split parameter's state is its shards, one from any rank of each coordinate,
glued by the pass's own `unshard`; an unsplit one is coordinate 0's (every rank of a
tensor-parallel group steps it alike).

Rank 0's training state is read whole by `load`, as for any resume; the other ranks' tensors
are read when a parameter needs them, each file checked against its checksum first: a
parameter's whole state is made from its shards and let go by the caller, so no rank holds the
whole model's state for this.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from fxstar.errors import CheckpointError
from fxstar.passes.tensor_parallel import shard_of, unshard
from fxstar.saving.file_format import FIX, STATE, TENSOR_SPLITS
from fxstar.saving.json_tree import from_json
from fxstar.saving.layouts.base import saved_tensor_parallel
from fxstar.saving.verified_reads import checked_member, reading

if TYPE_CHECKING:
    from fxstar.saving.checkpoint import Checkpoint

__all__ = ["LogicalState", "Split", "saved_splits", "take_share"]

Split = tuple[int, int]  # (dim, parts): how tensor_parallel.shard_of cuts a parameter


def saved_splits(path: Path, meta: Mapping[str, Any]) -> dict[str, Split]:
    """training.json's record of the split parameters, checked: names to two ints, a dim
    and a number of fused parts >= 1."""
    recorded = meta.get(TENSOR_SPLITS, {})
    splits: dict[str, Split] = {}
    if not isinstance(recorded, Mapping):
        raise CheckpointError(f"{path / STATE}: {TENSOR_SPLITS} must be a mapping; {FIX}")
    for name, split in recorded.items():
        plain = isinstance(split, list) and [type(v) for v in split] == [int, int]
        if not (plain and split[0] >= 0 and split[1] >= 1):
            raise CheckpointError(
                f"{path / STATE}: {TENSOR_SPLITS}.{name} must be [dim >= 0, parts >= 1], got "
                f"{split!r}; {FIX}"
            )
        splits[name] = (split[0], split[1])
    return splits


class _Deferred(Mapping):
    """A safetensors file of the checkpoint whose tensors are read one at a time when asked:
    `json_tree.from_json` puts a `_Stored` wherever the skeleton names one. The file is
    checked against its checksum before its first tensor is read."""

    def __init__(self, directory: Path, meta: Mapping[str, Any], name: Any):
        self.directory, self.meta, self.name = directory, meta, name
        self.file: Path | None = None  # once checked

    def read(self, key: str) -> torch.Tensor:
        if self.file is None:
            self.file = checked_member(self.directory, self.meta, self.name)
        with reading(self.file), safe_open(self.file, "pt") as f:
            return f.get_tensor(key)

    def __getitem__(self, key: str) -> _Stored:
        return _Stored(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


class _Stored:
    """One tensor of a `_Deferred` file, not read yet."""

    def __init__(self, source: _Deferred, key: str):
        self.source, self.key = source, key

    def read(self) -> torch.Tensor:
        return self.source.read(self.key)


def _value(value: Any) -> Any:
    """`value`, its tensors read where they are still `_Stored`."""
    if isinstance(value, _Stored):
        return value.read()
    if isinstance(value, dict):
        return {k: _value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_value(v) for v in value)
    return value


def _by_name(state: Mapping[str, Any], where: str) -> dict[str, dict[str, Any]]:
    """A saved training state's optimizer entries by parameter name."""
    names = state.get("optimizer_params")
    if names is None:
        raise CheckpointError(
            f"{where} does not name its optimizer's parameters (an optimizer over tensors the "
            "engine does not name): its state cannot be matched to another mesh's parameters"
        )
    flat = [name for group in names for name in group]
    entries = state["optimizer"].get("state", {})
    try:
        return {flat[index]: dict(entry) for index, entry in entries.items()}
    except (IndexError, TypeError) as error:
        raise CheckpointError(f"{where}: an optimizer entry names no parameter; {FIX}") from error


class LogicalState:
    """The optimizer state of a checkpoint's model, parameter by parameter (see the module)."""

    def __init__(self, checkpoint: Checkpoint):
        path, meta = checkpoint.path, checkpoint.meta
        self.path = path
        self.tensor_parallel = saved_tensor_parallel(meta)
        self.splits = saved_splits(path, meta)
        self.shapes = {name: tuple(t.shape) for name, t in checkpoint.parameters.items()}
        # every saved rank's training state: rank 0's as `load` read it, the others' tensors
        # read when asked
        self._states = [checkpoint.state]
        # per name, one entry for each tensor-parallel coordinate: the first rank that has it
        self._held: dict[str, list[dict[str, Any] | None]] = {}
        with reading(path / STATE):
            for rank in range(int(meta.get("ranks", 1))):
                if rank > 0:
                    saved = meta["rank_states"][str(rank)]
                    tensors = _Deferred(path, meta, saved["tensors"])
                    self._states.append(from_json(saved["state"], tensors))
                coordinate = rank % self.tensor_parallel
                where = f"{path / STATE} (rank {rank})"
                for name, entry in _by_name(self._states[rank], where).items():
                    held = self._held.setdefault(name, [None] * self.tensor_parallel)
                    if held[coordinate] is None:
                        held[coordinate] = entry

    def rank_stream(self, rank: int) -> dict[str, Any] | None:
        """The tensor-parallel RNG stream rank `rank` saved (None: it saved none)."""
        with reading(self.path / STATE):
            return _value(self._states[rank]["rng"].get("tensor_parallel"))

    def entry(self, name: str) -> dict[str, Any] | None:
        """Parameter `name`'s whole state (None: no rank saved any, it was never stepped)."""
        held = self._held.get(name)
        if held is None:
            return None
        split = self.splits.get(name)
        first = held[0]
        if first is None or (split is not None and None in held):
            missing = held.index(None)
            raise CheckpointError(
                f"{self.path}: no rank at tensor-parallel coordinate {missing} saved the "
                f"optimizer state of {name}; {FIX}"
            )
        whole = {}
        for key, stored in first.items():
            value = _value(stored)
            if split is None or not isinstance(value, torch.Tensor) or value.dim() == 0:
                whole[key] = value
                continue
            shards = [value] + [_value(entry[key]) for entry in held[1:]]
            for coordinate, shard in enumerate(shards):
                expected = self._shard_shape(name, split, coordinate)
                if tuple(shard.shape) != expected:
                    raise _not_its_shape(self.path, name, key, tuple(shard.shape), expected)
            whole[key] = unshard(shards, *split)
            del shards
        return whole

    def _shard_shape(self, name: str, split: Split, coordinate: int) -> tuple[int, ...]:
        full = torch.empty(self.parameter_shape(name), device="meta")
        return tuple(shard_of(full, *split, self.tensor_parallel, coordinate).shape)

    def parameter_shape(self, name: str) -> tuple[int, ...]:
        """The whole parameter's shape, as the checkpoint holds it."""
        if name not in self.shapes:
            raise CheckpointError(
                f"{self.path}: the optimizer state of {name} is cut across tensor-parallel "
                "ranks, but the checkpoint holds no parameter of that name to cut it by"
            )
        return self.shapes[name]


def take_share(state: LogicalState, name: str, whole: Mapping[str, Any], split: Split | None,
               ranks: int, rank: int) -> dict[str, Any]:  # fmt: skip
    """Rank `rank`'s share of a parameter's whole state: each tensor of the parameter's shape
    cut as `split` cuts the parameter over `ranks` tensor-parallel ranks (a copy: the whole
    is let go), anything else (a step) as it is."""
    if split is None:
        return dict(whole)
    shape = state.parameter_shape(name)
    share = {}
    for key, value in whole.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            share[key] = value
            continue
        if tuple(value.shape) != shape:
            raise _not_its_shape(state.path, name, key, tuple(value.shape), shape)
        share[key] = shard_of(value, *split, ranks, rank).clone()
    return share


def _not_its_shape(path: Path, name: str, key: str, shape: tuple, expected: tuple) -> Exception:
    return CheckpointError(
        f"{path}: optimizer state {key} of {name} is {list(shape)}, not its parameter's "
        f"{list(expected)}: a state that is not per element (8-bit moments, whose blocks "
        "follow each rank's shard) cannot be cut for another tensor-parallel size; resume "
        "at the tensor-parallel size it was saved at"
    )
