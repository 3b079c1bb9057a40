"""What a checkpoint region's call node runs: the region's submodule under torch's
non-reentrant checkpoint, so only the region's inputs are saved for backward and its
activations are recomputed (with the forward's RNG state, so dropout replays) in backward."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["run_region"]


def run_region(region: nn.Module, *inputs: Any) -> Any:
    """Run `region(*inputs)`, recomputing it in backward instead of saving its activations."""
    if not torch.is_grad_enabled():
        return region(*inputs)  # nothing is saved without grad: no need to checkpoint
    return checkpoint(region, *inputs, use_reentrant=False, preserve_rng_state=True)
