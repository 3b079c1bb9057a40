"""A budgeted memory tier: one buffer allocated once, and tensors that are views into it.

`fxstar._C.Arena` decides offsets; this class owns the bytes (a torch tensor on the tier's
device: cuda where there is one, the CPU on CPU-only machines) and cuts typed views at those
offsets. The budget then holds by construction, and fragmentation is real and visible.
"""

from __future__ import annotations

import math

import torch

from fxstar import _C

ArenaOutOfMemory = _C.ArenaOutOfMemory


class ArenaBuffer:
    def __init__(
        self, capacity: int, device: torch.device | str = "cpu", *, alignment: int = 256
    ) -> None:
        self.allocator = _C.Arena(capacity, alignment)
        self.device = torch.device(device)
        self.buffer = torch.empty(self.allocator.capacity, dtype=torch.uint8, device=self.device)

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    def alloc(self, nbytes: int) -> int:
        """Reserve `nbytes`; returns the offset. Raises ArenaOutOfMemory when it does not fit."""
        return self.allocator.alloc(nbytes)

    def free(self, offset: int) -> None:
        self.allocator.free(offset)

    def view(
        self, offset: int, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype
    ) -> torch.Tensor:
        """A tensor of `shape` and `dtype` over the bytes reserved at `offset`."""
        nbytes = math.prod(shape) * dtype.itemsize
        reserved = self.allocator.block_size(offset)
        if nbytes > reserved:
            raise ValueError(
                f"shape {tuple(shape)} of {dtype} needs {nbytes} bytes but the block at offset "
                f"{offset} holds {reserved}"
            )
        return self.buffer[offset : offset + nbytes].view(dtype).view(shape)

    def stats(self) -> dict:
        return self.allocator.stats()

    def __repr__(self) -> str:
        s = self.allocator.stats()
        return (
            f"ArenaBuffer(device={self.device}, capacity={_C.format_bytes(s['capacity'])}, "
            f"in_use={_C.format_bytes(s['in_use'])}, peak={_C.format_bytes(s['peak_in_use'])})"
        )
