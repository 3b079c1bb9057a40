"""The training state: everything besides the parameters that a resumed run needs.

The step count, the RNG states (fxstar/saving/rng.py), the optimizer's `state_dict()`, the
names of the parameters its integer ids stand for (so a checkpoint loads even if the parameter
order changed), and the state of everything the engine saves along: its loss scaler (fp16's
`engine.scaler`) under "loss_scaler", a scheduler given to `engine.attach_scheduler`, objects
given to `engine.register_state`. Restoring checks all of it against the engine before
anything changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fxstar.checkpoint_values import check_fits
from fxstar.errors import CheckpointError
from fxstar.runtime.moments import MOMENT_KEYS
from fxstar.runtime.optim import HybridAdam
from fxstar.saving.file_format import STATE
from fxstar.saving.rng import check_stream, rng_state, set_rng_state, set_stream_state, stream_state
from fxstar.saving.view import TrainingView

RESERVED = ("step", "rng", "optimizer", "optimizer_params")  # keys no saved-along object takes


def training_state(view: TrainingView, *, deferred: bool = False) -> dict[str, Any]:
    """Everything besides the parameters that a resumed run needs (tensors still in place).
    `deferred`: the optimizer's state below host memory (HybridAdam's disk tier) stays
    DeferredTensors, read a chunk at a time by the writer of this process's file."""
    optimizer = view.optimizer
    state: dict[str, Any] = {
        "step": {
            "micro_steps": view.step_count,
            "optimizer_steps": view.step_count // view.accumulation_steps,
        },
        "rng": {**rng_state(), **stream_state(view.rank_stream)},
        "optimizer": optimizer.deferred_state_dict()
        if deferred and isinstance(optimizer, HybridAdam)
        else optimizer.state_dict(),
        "optimizer_params": _optimizer_names(view),
    }
    for name, obj in view.objects.items():
        state[name] = obj.state_dict()
    return state


def restore_training_state(
    view: TrainingView, state: Mapping[str, Any], *, strict: bool = True, rng: bool = True
) -> None:
    """Put a `training_state()` back: optimizer, saved-along objects, step, then RNG last;
    everything that can refuse it is checked before anything changes."""
    restore(view, state, fitted(view, state, strict=strict, rng=rng), rng=rng)


def fitted(view: TrainingView, state: Mapping[str, Any], *, strict: bool, rng: bool,
           file: Path | None = None) -> dict[str, Any]:  # fmt: skip
    """The optimizer state to load, once `state` is known to fit the engine (its objects,
    parameter names and counts, the moments' shapes, the RNG streams): a refusal leaves the
    engine as it was."""
    if rng:
        check_stream(view.rank_stream, state["rng"])
    objects = view.objects
    if strict:
        problems = [f"the checkpoint has {n!r} state but the engine has nothing to load it into"
                    for n in state if n not in RESERVED and n not in objects]  # fmt: skip
        problems += [f"the engine's {n!r} has no state in the checkpoint"
                     for n in objects if n not in state]  # fmt: skip
        if problems:
            raise CheckpointError(
                "training state does not match the engine:\n  " + "\n  ".join(problems)
                + "\n(attach or register the missing objects, or pass strict=False)"
            )  # fmt: skip
    optimizer_state = state["optimizer"]
    if state.get("optimizer_params") is not None:
        optimizer_state = _remap_optimizer(view, optimizer_state, state["optimizer_params"])
    groups = getattr(view.optimizer, "param_groups", None)
    if groups is not None:
        saved = [len(g["params"]) for g in optimizer_state.get("param_groups", [])]
        if saved != [len(g["params"]) for g in groups]:
            raise CheckpointError(
                f"optimizer state does not match: the checkpoint's param groups hold {saved} "
                f"parameters, the optimizer's {[len(g['params']) for g in groups]}"
            )
        params = [p for g in groups for p in g["params"]]
        check_same_optimizer(view.optimizer, optimizer_state, file or Path(STATE))
        check_fits(optimizer_state, params, objects, state, file or Path(STATE))
    return optimizer_state


def check_same_optimizer(optimizer: Any, optimizer_state: Mapping[str, Any], file: Path) -> None:
    """Adam's state into Adam, another's into its own: SGD's momentum loaded into Adam (or
    Adam's moments into SGD) would be dropped or misread, and the run go on from fresh state."""
    adam = isinstance(optimizer, (HybridAdam, torch.optim.Adam, torch.optim.AdamW))
    for index, entry in optimizer_state.get("state", {}).items():
        keys = set(entry) - {"step"}
        if keys and bool(keys & set(MOMENT_KEYS)) != adam:
            saved_by = "an optimizer other than Adam" if adam else "Adam"
            raise CheckpointError(
                f"{file}: optimizer.state[{index}] holds {sorted(keys)}, the state of "
                f"{saved_by}, but this engine's optimizer is {type(optimizer).__name__}: "
                "load it into an engine compiled with the optimizer.type that saved it"
            )


def restore(view: TrainingView, state: Mapping[str, Any], optimizer_state: dict[str, Any], *,
            rng: bool) -> None:  # fmt: skip
    """Load a `fitted` state: optimizer, saved-along objects, step, then RNG last."""
    view.optimizer.load_state_dict(optimizer_state)
    for name, obj in view.objects.items():
        if name in state:
            obj.load_state_dict(state[name])
    view.set_step_count(int(state["step"]["micro_steps"]))
    if rng:
        set_rng_state(state["rng"])
        set_stream_state(view.rank_stream, state["rng"])


def _optimizer_names(view: TrainingView) -> list[list[str]] | None:
    """Per param group, the engine's name of each parameter the optimizer holds."""
    groups = getattr(view.optimizer, "param_groups", None)
    if groups is None:
        return None
    name_of = {id(p): n for n, p in view.parameters.items()}
    try:
        return [[name_of[id(p)] for p in group["params"]] for group in groups]
    except KeyError:
        return None  # an optimizer over tensors the engine does not name: keep torch's ids


def _remap_optimizer(view: TrainingView, saved: dict[str, Any], names: list[list[str]]) -> dict:
    """torch keys optimizer state by position; map the saved positions to today's by name."""
    current = _optimizer_names(view)
    groups = saved.get("param_groups")
    if current is None or groups is None:
        return saved
    problems = []
    if len(current) != len(names) or len(groups) != len(names):
        problems.append(f"{len(names)} param groups saved, the optimizer has {len(current)}")
    for i, (was, now) in enumerate(zip(names, current)):
        missing, unexpected = sorted(set(now) - set(was)), sorted(set(was) - set(now))
        if missing:
            problems.append(f"group {i}: missing in the checkpoint: {', '.join(missing)}")
        if unexpected:
            problems.append(f"group {i}: not in the optimizer: {', '.join(unexpected)}")
    if problems:
        raise CheckpointError("optimizer state does not match:\n  " + "\n  ".join(problems))
    index = {n: i for i, n in enumerate(n for group in current for n in group)}
    new_id = {}
    for group, group_names in zip(groups, names):
        for old, name in zip(group["params"], group_names):
            new_id[old] = index[name]
    return {
        **saved,
        "state": {new_id[k]: v for k, v in saved.get("state", {}).items()},
        # torch pairs a group's ids with the optimizer's tensors by position: today's order
        "param_groups": [
            {**group, "params": [index[n] for n in now]} for group, now in zip(groups, current)
        ],
    }
