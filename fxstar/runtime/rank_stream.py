"""One rank's random stream for tensor parallelism: its generator states, swapped into the
default generators while a sharded op runs (Megatron's RNG tracker keeps one per rank).

A module of its own below the process group (`rank_group.RankGroup.stream` holds one) and the
graph-node functions that draw from it (runtime/rng_tracker.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["RankStream"]


class RankStream:
    """This rank's generator states (CPU, and per CUDA device once used), swapped into the
    default generators while a sharded op runs."""

    def __init__(self, seed: int):
        self.seed = seed
        self.cpu = torch.Generator().manual_seed(seed).get_state()
        self.cuda: dict[int, torch.Tensor] = {}

    def _cuda_state(self, index: int) -> torch.Tensor:
        if index not in self.cuda:
            self.cuda[index] = torch.cuda.Generator(index).manual_seed(self.seed).get_state()
        return self.cuda[index]

    @contextlib.contextmanager
    def fork(self, device: torch.device) -> Iterator[None]:
        """Draw from this rank's stream inside the block; the shared one is left as it was."""
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            shared = torch.cuda.get_rng_state(index)
            torch.cuda.set_rng_state(self._cuda_state(index), index)
            try:
                yield
            finally:
                self.cuda[index] = torch.cuda.get_rng_state(index)
                torch.cuda.set_rng_state(shared, index)
            return
        shared = torch.get_rng_state()
        torch.set_rng_state(self.cpu)
        try:
            yield
        finally:
            self.cpu = torch.get_rng_state()
            torch.set_rng_state(shared)

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "cpu": self.cpu.clone(),
                "cuda": {str(i): s.clone() for i, s in self.cuda.items()}}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed = int(state["seed"])
        self.cpu = state["cpu"].clone()
        self.cuda = {int(i): s.clone() for i, s in state.get("cuda", {}).items()}
