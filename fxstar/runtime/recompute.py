"""What a checkpoint region's call node runs: the region's submodule under torch's
non-reentrant checkpoint, so only the region's inputs are saved for backward and its
activations are recomputed (with the forward's RNG state, so dropout replays) in backward.

A region that fetches chunks recomputes from the parameters as they are at backward time;
if an optimizer step (or an in-place edit) changed them since the forward, the recomputation
would silently differ from what the forward computed. Eager PyTorch refuses the same thing
("modified by an inplace operation"), and so does the recomputation here.

A region that writes tensors in place (BatchNorm's running statistics, a counter) would write
them a second time when it is recomputed, and would read them as they are at backward time.
The region's inputs named under `COPIED_INPUTS_KEY` in its meta (the `checkpoint_regions`
analysis: the ones written in place from its forward on) are copied when its forward starts;
the forward runs on the tensors themselves, every recomputation on fresh copies of those
copies. The buffers so see the forward's update once, the recomputation computes from the
values the forward saw, and checkpoint saves the copies rather than tensors the forward
changes (which autograd's version check refuses)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import fx, nn
from torch.utils.checkpoint import checkpoint

from fxstar.runtime import rng_tracker
from fxstar.runtime.ops import RUNTIME

__all__ = ["COPIED_INPUTS_KEY", "run_region"]

COPIED_INPUTS_KEY = "fxstar.recompute_copies"
"""GraphModule.meta key of a region: the names of its placeholders the recomputation takes
from copies made at the forward (see the module docstring)."""


class _Replay:
    """The recompute context: each recomputation starts the trackers from the forward's
    states. torch enters one context object per recomputation, and a second backward of one
    forward (retain_graph) recomputes again: a generator context manager enters only once."""

    def __init__(self, states: list) -> None:
        self.states = states
        self.entered: list[contextlib.AbstractContextManager] = []

    def __enter__(self) -> None:
        replay = rng_tracker.replaying(self.states)
        replay.__enter__()
        self.entered.append(replay)

    def __exit__(self, *exc: Any) -> Any:
        return self.entered.pop().__exit__(*exc)


def _checkpoint(region: nn.Module, fn: Any, *inputs: Any) -> Any:
    """torch's checkpoint of `fn`, whose recompute starts the tensor-parallel RNG trackers the
    region's graph holds where the forward started them (torch replays the default
    generators only)."""
    streams = rng_tracker.streams_of(region)

    def replay_rank_streams() -> tuple[Any, Any]:
        return contextlib.nullcontext(), _Replay(rng_tracker.snapshot(streams))

    return checkpoint(fn, *inputs, use_reentrant=False, preserve_rng_state=True,
                      context_fn=replay_rank_streams)  # fmt: skip


def _copied_positions(region: nn.Module) -> list[int]:
    """Positions of the inputs the recomputation takes from copies."""
    names = region.meta.get(COPIED_INPUTS_KEY) if isinstance(region, fx.GraphModule) else None
    if not names:
        return []
    placeholders = [n.name for n in region.graph.find_nodes(op="placeholder")]
    missing = [name for name in names if name not in placeholders]
    if missing:
        raise RuntimeError(
            f"checkpoint region {type(region).__name__}: inputs {missing} it "
            "writes in place are no longer among its placeholders (a pass that rewrote the "
            "region must keep them, or update meta[COPIED_INPUTS_KEY])"
        )
    return [placeholders.index(name) for name in names]


def _on_copies(fn: Any, inputs: tuple, positions: list[int]) -> tuple[Any, tuple]:
    """(fn', inputs'): inputs' holds copies of the inputs at `positions` taken now; fn' runs
    `fn` on the inputs themselves the first time (the forward: its writes land in them), on
    fresh copies of the copies every time after (a recomputation: its writes go nowhere)."""
    originals: dict[int, torch.Tensor] | None = {i: inputs[i] for i in positions}
    saved = list(inputs)
    for i in positions:
        saved[i] = inputs[i].detach().clone().requires_grad_(inputs[i].requires_grad)

    def run(*args: Any) -> Any:
        nonlocal originals
        args = list(args)
        if originals is not None:  # the forward; the originals are not kept past it
            for i, original in originals.items():
                args[i] = original
            originals = None
        else:
            for i in positions:
                args[i] = args[i].clone()
        return fn(*args)

    return run, tuple(saved)


def run_region(region: nn.Module, *inputs: Any) -> Any:
    """Run `region(*inputs)`, recomputing it in backward instead of saving its activations."""
    if not torch.is_grad_enabled():
        return region(*inputs)  # nothing is saved without grad: no need to checkpoint
    runtime = getattr(region, RUNTIME, None)
    manager = runtime.manager if runtime is not None else None
    fn: Any = region
    if manager is not None:
        fn = _check_versions(region, manager)
    positions = _copied_positions(region)
    if positions:
        fn, inputs = _on_copies(fn, inputs, positions)
    return _checkpoint(region, fn, *inputs)


def _check_versions(region: nn.Module, manager: Any) -> Any:
    """`region`, refusing to be recomputed from parameters changed since its forward."""
    token = manager.version_token()
    calls = 0

    def body(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls > 1 and manager.version_token() != token:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                "inplace operation: the parameters a checkpointed region recomputes from "
                "changed after its forward (an optimizer step, or an in-place edit, between "
                "this loss's forward and its backward). Call backward before engine.step(), "
                "or run the forward again."
            )
        return region(*args)

    return body
