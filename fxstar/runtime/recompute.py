"""What a checkpoint region's call node runs: the region's submodule under torch's
non-reentrant checkpoint, so only the region's inputs are saved for backward and its
activations are recomputed (with the forward's RNG state, so dropout replays) in backward.

A region that fetches chunks recomputes from the parameters as they are at backward time;
if an optimizer step (or an in-place edit) changed them since the forward, the recomputation
would silently differ from what the forward computed. Eager PyTorch refuses the same thing
("modified by an inplace operation"), and so does the recomputation here."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fxstar.runtime import rng_tracker
from fxstar.runtime.ops import RUNTIME
from fxstar.runtime.tp_group import TPGroup

__all__ = ["run_region"]


def _checkpoint(region: nn.Module, fn: Any, *inputs: Any) -> Any:
    """torch's checkpoint of `fn`, whose recompute starts the tensor-parallel RNG trackers the
    region's graph holds where the forward started them (torch replays the default
    generators only)."""
    streams = [m.stream for m in region.modules() if isinstance(m, TPGroup) and m.stream]

    def replay_rank_streams() -> tuple[Any, Any]:
        return contextlib.nullcontext(), rng_tracker.replaying(rng_tracker.snapshot(streams))

    return checkpoint(fn, *inputs, use_reentrant=False, preserve_rng_state=True,
                      context_fn=replay_rank_streams)  # fmt: skip


def run_region(region: nn.Module, *inputs: Any) -> Any:
    """Run `region(*inputs)`, recomputing it in backward instead of saving its activations."""
    if not torch.is_grad_enabled():
        return region(*inputs)  # nothing is saved without grad: no need to checkpoint
    runtime = getattr(region, RUNTIME, None)
    manager = runtime.manager if runtime is not None else None
    if manager is None:
        return _checkpoint(region, region, *inputs)
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

    return _checkpoint(region, body, *inputs)
