"""Saving an engine and reading a checkpoint back: `save`, `load` and what it returns.

Docs: docs/checkpoints.md. A save builds the engine's training-state view (view.py) and hands it
to the layout of its world (layouts/); a load reads and checks the files (verified_reads.py),
and `Checkpoint.apply` restores an engine through its view.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fxstar.errors import CheckpointError
from fxstar.saving.directory import resolve
from fxstar.saving.file_format import STATE, TENSORS
from fxstar.saving.layouts import check_resumable, layout_for, layout_of, resharded, reshards
from fxstar.saving.training_state import fitted, restore
from fxstar.saving.verified_reads import (
    parameter_files,
    parameter_shapes,
    parameter_values,
    read_meta,
    read_state,
    reading,
)
from fxstar.saving.view import one_by_one, view_of
from fxstar.weights import WeightSource

if TYPE_CHECKING:
    from fxstar.engine import Engine


def save(engine: Engine, path: str | os.PathLike) -> Path:
    """Write `engine`'s checkpoint to directory `path`, replacing any there atomically. Under
    tensor or data parallelism every rank must call it."""
    view = view_of(engine)
    return layout_for(view.world).write(view, path)


def load(
    path: str | os.PathLike, model: nn.Module | None = None, *, read_parameters: bool = True
) -> Checkpoint:
    """Read a checkpoint; with `model`, also check it against the model and load its
    parameters into it one tensor at a time (before `fxstar.compile`: a model keeps its
    weights through compile); `parameters` are then the model's own tensors.
    `Checkpoint.apply(engine)` or `engine.load(dir)` restores an engine. With
    `read_parameters=False` the parameters' file is checked (size, checksum) but its tensors
    are read only when applied, one at a time."""
    directory = resolve(path)
    meta = read_meta(directory)
    with reading(directory / STATE):
        skeleton = meta.pop("state")
    state = read_state(directory, meta, meta.get("tensors", TENSORS), skeleton)
    state, rank_rngs = layout_of(meta).read(directory, meta, state)
    if read_parameters and model is None:
        checkpoint = Checkpoint(directory, parameter_values(directory, meta), state, meta,
                                rank_rngs=rank_rngs)  # fmt: skip
    else:
        checkpoint = Checkpoint(directory, parameter_shapes(directory, meta), state, meta,
                                streamed=True, rank_rngs=rank_rngs)  # fmt: skip
    if model is not None:
        checkpoint.load_into(model)
    return checkpoint


def load_parameters(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The parameters of a checkpoint under every model name (tied names share one tensor):
    `model.load_state_dict(load_parameters(dir))` works on the original eager model."""
    directory = resolve(path)
    return parameter_values(directory, read_meta(directory))


@dataclass
class Checkpoint:
    """A loaded checkpoint: `parameters` by the model's names (tied names share one tensor),
    `state` as `engine.training_state()` gave it, `meta` from training.json."""

    path: Path
    parameters: dict[str, torch.Tensor]
    state: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)
    # loaded without the parameters' values: `parameters` holds meta tensors (names and
    # shapes, for `check`) and `parameters_one_by_one` reads them when applied
    streamed: bool = False
    # data parallel: each rank's RNG state by rank (the consolidated `state` holds rank 0's)
    rank_rngs: dict[int, Any] = field(default_factory=dict)

    @property
    def step(self) -> int:
        """Optimizer steps taken when the checkpoint was written."""
        return int(self.state["step"]["optimizer_steps"])

    def check(self, expected: Mapping[str, torch.Tensor]) -> None:
        """Raise CheckpointError listing every missing name, unexpected name and shape
        mismatch against `expected` (a state dict, or anything with shapes by name)."""
        problems = mismatches(self.parameters, expected)
        if problems:
            raise CheckpointError(
                f"checkpoint {self.path} does not match the model:\n  " + "\n  ".join(problems)
            )

    def parameters_one_by_one(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of every stored parameter, read one at a time when the checkpoint was
        loaded without them (`engine.load`): a model larger than half the host resumes."""
        if not self.streamed:
            yield from self.parameters.items()
            return
        for file in parameter_files(self.meta):
            with WeightSource(self.path / file, verify=False) as source:  # verified by load
                for name in source.names():
                    yield name, source.read(name)

    def load_into(self, model: nn.Module) -> None:
        """Copy the parameters into an eager model (in place, like `load_state_dict`). Read
        without them, they are read one tensor at a time into the model's own, which then
        are this checkpoint's `parameters`."""
        own = model.state_dict(keep_vars=True)
        self.check(own)
        if not self.streamed:
            model.load_state_dict(self.parameters)
            return
        one_by_one(self.parameters_one_by_one(), lambda name, value: own[name].copy_(value))
        self.parameters = {name: t.detach() for name, t in own.items()}
        self.streamed = False

    def apply(self, engine: Engine, *, strict: bool = True, rng: bool = True) -> None:
        """Restore parameters (copied into the engine's own tensors: the optimizer and the
        chunk homes keep theirs), optimizer, scheduler, loss scaler, step and RNG."""
        view = view_of(engine)
        world, ranks = view.world, self.meta.get("ranks", 1)
        if ranks != 1 or world.ranks != 1:
            check_resumable(self.path, self.meta, world)
        # collective under tensor parallelism (the parameters are gathered): every rank is here;
        # sharded payloads: names and shapes suffice (other ranks' chunks are meta here)
        self.check(view.rank_state_dict())
        if reshards(self.meta, world):  # another mesh: this rank's share of the logical state
            state, view = resharded(self, view)
        else:
            rank = world.rank() if ranks != 1 and world.ranks == ranks else 0
            state = self.state if rank == 0 else layout_of(self.meta).state_of_rank(self, rank)
        optimizer_state = fitted(view, state, strict=strict, rng=rng, file=self.path / STATE)
        # checked: from here the engine's state is written, whole only once all of it is
        with engine.state_guard.writing(f"engine.load of {self.path}", replaces=True):
            view.copy_parameters(self.parameters_one_by_one())  # a rank's shards cut by the store
            view.zero_grad()
            restore(view, state, optimizer_state, rng=rng)


def mismatches(
    found: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]
) -> list[str]:
    """Every difference of names and shapes, not just the first."""
    problems = [f"missing: {n} {tuple(t.shape)}" for n, t in expected.items() if n not in found]
    problems += [f"unexpected: {n} {tuple(t.shape)}" for n, t in found.items()
                 if n not in expected]  # fmt: skip
    problems += [
        f"shape mismatch: {n} is {tuple(t.shape)} in the checkpoint, "
        f"{tuple(expected[n].shape)} in the model"
        for n, t in found.items()
        if n in expected and tuple(t.shape) != tuple(expected[n].shape)
    ]
    return problems
