"""A reusable flat buffer per purpose, handed out as views: recompute mode gathers each
column linear's input into the same memory in forward and again in backward, one linear at a
time, and mem_saving_comm reduces through one scratch buffer. A `RankGroup` holds its pool."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["BufferPool"]


class BufferPool:
    """One flat buffer per (purpose, dtype, device), grown on demand."""

    def __init__(self) -> None:
        self._flat: dict[tuple, torch.Tensor] = {}

    def get(self, purpose: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A view of `shape` of the purpose's buffer. A fake `like` (shape_memory measures the
        graph on fake tensors) gets a fresh fake of its own: a pooled fake would be handed to
        the real run later (an op mixing fake and real tensors fails) and would outlive its
        FakeTensorMode."""
        if isinstance(like, FakeTensor):
            return torch.empty(shape, dtype=like.dtype, device=like.device)
        key = (purpose, like.dtype, like.device)
        numel = 1
        for s in shape:
            numel *= s
        flat = self._flat.get(key)
        if flat is None or flat.numel() < numel:
            flat = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._flat[key] = flat
        return flat[:numel].view(shape)

    def clear(self) -> None:
        self._flat.clear()
