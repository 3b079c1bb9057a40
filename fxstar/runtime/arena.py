"""A budgeted memory tier: one buffer allocated once, and tensors that are views into it
(ArenaBuffer); or blocks of their own from the device's allocator (PooledBlocks, below).

`fxstar._C.Arena` decides offsets; this class owns the bytes (a torch tensor on the tier's
device: cuda where there is one, the CPU on CPU-only machines) and cuts typed views at those
offsets. The budget then holds by construction, and fragmentation is real and visible.
"""

from __future__ import annotations

import bisect
import math
import operator
import os
from typing import TYPE_CHECKING

import torch

from fxstar import _C
from fxstar.runtime.host import give_back_freed, release_pages

if TYPE_CHECKING:
    from fxstar.runtime.device import Device

ArenaOutOfMemory = _C.ArenaOutOfMemory
ALIGNMENT = 256  # bytes: every block is rounded up to this (the C++ arena's minimum)


def device_memory_bytes(device: torch.device) -> int | None:
    """What the device could ever hold: a cuda card's memory, the CPU's physical RAM; None
    when unknown."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, ValueError, OSError):  # not a POSIX system
            return None
    return None


class ArenaBuffer:
    def __init__(
        self, capacity: int, device: torch.device | str = "cpu", *, alignment: int = ALIGNMENT
    ) -> None:
        """Allocate `capacity` bytes on `device` at once; MemoryError (not an allocator's
        traceback) when the device could never hold them or the allocation fails."""
        self.device = torch.device(device)
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"capacity: must be an int of bytes >= 0, got {capacity!r}")
        limit = device_memory_bytes(self.device)
        if limit is not None and capacity > limit:
            raise MemoryError(
                f"cannot allocate an arena of {_C.format_bytes(capacity)} on {self.device}: "
                f"it has {_C.format_bytes(limit)} in all; lower the compute tier's budget "
                "(plan.device_memory)"
            )
        self.allocator = _C.Arena(capacity, alignment)
        try:
            self.buffer = torch.empty(self.allocator.capacity, dtype=torch.uint8,
                                      device=self.device)  # fmt: skip
        except RuntimeError as error:  # torch.OutOfMemoryError is one too
            raise MemoryError(
                f"cannot allocate an arena of {_C.format_bytes(capacity)} on {self.device} "
                f"({str(error).splitlines()[0]}); lower the compute tier's budget "
                "(plan.device_memory)"
            ) from error

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    def alloc(self, nbytes: int) -> int:
        """Reserve `nbytes`; returns the offset. Raises ArenaOutOfMemory when it does not fit.
        On a CPU-only machine the block's pages are fresh (see free): the heap's freed pages
        (activations backward let go of, which glibc keeps) go back to the system first, so
        the arena and the activations together stay within the budget, as on a card."""
        offset = self.allocator.alloc(nbytes)
        if self.device.type == "cpu":
            give_back_freed()
        return offset

    def free(self, offset: int) -> None:
        """Give the block back; on a CPU-only machine its whole pages go back to the system
        too, so that what the arena holds resident is what its live blocks hold: with the
        activations beside it (ordinary memory there), the compute tier stays within its
        budget at every moment, as a GPU's arena and activations share one card."""
        if self.device.type == "cpu":
            size = self.allocator.block_size(offset)
            release_pages(self.buffer[offset : offset + size])
        self.allocator.free(offset)

    def view(
        self, offset: int, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype
    ) -> torch.Tensor:
        """A tensor of `shape` and `dtype` over the bytes reserved at `offset`.

        Every dimension must be given (no -1): the view must stay inside its block, and a
        negative size would slice the arena from its end.
        """
        dims = tuple(shape)
        for dim in dims:
            if isinstance(dim, bool) or operator.index(dim) < 0:
                raise ValueError(
                    f"shape {dims}: every dimension must be an int >= 0 (no -1 to infer one)"
                )
        if operator.index(offset) < 0:
            raise ValueError(f"offset: must be >= 0, got {offset}")
        nbytes = math.prod(dims) * dtype.itemsize
        reserved = self.allocator.block_size(offset)
        if nbytes > reserved:
            raise ValueError(
                f"shape {dims} of {dtype} needs {nbytes} bytes but the block at offset "
                f"{offset} holds {reserved}"
            )
        return self.buffer[offset : offset + nbytes].view(dtype).view(dims)

    def held_bytes(self) -> int:
        """Device bytes the tier holds: the whole buffer, whatever its blocks hold."""
        return self.capacity

    def bytes_at(self, offset: int) -> tuple[torch.Tensor, int]:
        """The tensor holding byte `offset`, and where in it that byte lies."""
        return self.buffer, offset

    def position(self, t: torch.Tensor) -> int | None:
        """Where in the arena `t`'s first element lies; None if it is not the arena's."""
        storage = self.buffer.untyped_storage().data_ptr()
        if t.device != self.device or t.untyped_storage().data_ptr() != storage:
            return None
        return t.storage_offset() * t.element_size()

    def stats(self) -> dict:
        return self.allocator.stats()

    def __repr__(self) -> str:
        s = self.allocator.stats()
        return (
            f"ArenaBuffer(device={self.device}, capacity={_C.format_bytes(s['capacity'])}, "
            f"in_use={_C.format_bytes(s['in_use'])}, peak={_C.format_bytes(s['peak_in_use'])})"
        )


class PooledBlocks:
    """A budgeted tier whose blocks are tensors of their own from the compute Device's
    allocator, the pool activations come from too (torch's caching allocator on a card).

    Why: a card's arena allocated once holds its bytes for the whole step, so it can only be
    the budget less the activations' peak; chunks would never use the room activations leave
    early in forward and late in backward. Blocks given back to the device's allocator can
    hold activations instead, and the chunks' share of the budget follows each moment's bytes
    besides chunks (Residency.share), as on a CPU-only machine where the arena's freed pages go
    back to the system. PatrickStar pages chunks through torch's allocator the same way; with
    `expandable_segments:True` (PYTORCH_CUDA_ALLOC_CONF) a freed chunk block is remapped to
    hold tensors of other sizes instead of fragmenting the card.

    Offsets still come from `fxstar._C.Arena` over `capacity` bytes: they name blocks (the
    residency, the saved-tensor handles and the reserved blocks keep one notion of a block),
    and the arena's bookkeeping (in use, peak, a block's size) reads the same as ArenaBuffer's.
    """

    def __init__(self, capacity: int, device: Device, *, alignment: int = ALIGNMENT) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"capacity: must be an int of bytes >= 0, got {capacity!r}")
        self.compute_device = device
        self.device = device.torch_device
        self.allocator = _C.Arena(capacity, alignment)
        self.blocks: dict[int, torch.Tensor] = {}  # offset -> its bytes
        self._by_storage: dict[int, int] = {}  # a block's storage address -> its offset

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    def alloc(self, nbytes: int) -> int:
        """A zeroed block of `nbytes` (rounded up as the arena's blocks are); its offset.
        ArenaOutOfMemory when the blocks in use leave no room for it; MemoryError when the
        device's allocator has none."""
        offset = self.allocator.alloc(nbytes)
        size = self.allocator.block_size(offset)
        try:
            block = self.compute_device.empty((size,), torch.uint8)
        except RuntimeError as error:  # torch.OutOfMemoryError is one too
            self.allocator.free(offset)
            raise MemoryError(
                f"cannot allocate a chunk block of {_C.format_bytes(size)} on {self.device} "
                f"({str(error).splitlines()[0]}); lower the compute tier's budget "
                "(plan.device_memory)"
            ) from error
        block.zero_()  # fresh, as a CPU arena's released pages read
        self.blocks[offset] = block
        self._by_storage[block.untyped_storage().data_ptr()] = offset
        return offset

    def held_bytes(self) -> int:
        """Device bytes the tier holds: its blocks in use."""
        return sum(block.numel() for block in self.blocks.values())

    def free(self, offset: int) -> None:
        """Give the block back to the device's allocator (activations may take it)."""
        block = self.blocks.pop(offset)
        del self._by_storage[block.untyped_storage().data_ptr()]
        self.allocator.free(offset)

    def bytes_at(self, offset: int) -> tuple[torch.Tensor, int]:
        """The tensor holding byte `offset` (a block's start, or a place inside one: a group's
        member), and where in it that byte lies."""
        block = self.blocks.get(offset)
        if block is not None:
            return block, 0
        starts = sorted(self.blocks)
        start = starts[bisect.bisect_right(starts, offset) - 1] if starts else -1
        if start < 0 or offset >= start + self.blocks[start].numel():
            raise KeyError(f"no block holds byte {offset}")
        return self.blocks[start], offset - start

    def position(self, t: torch.Tensor) -> int | None:
        """Where in the tier's offsets `t`'s first element lies; None if it is not a block's."""
        if t.device != self.device:
            return None
        offset = self._by_storage.get(t.untyped_storage().data_ptr())
        if offset is None:
            return None
        return offset + t.storage_offset() * t.element_size()

    def stats(self) -> dict:
        return self.allocator.stats()

    def __repr__(self) -> str:
        s = self.allocator.stats()
        return (
            f"PooledBlocks(device={self.device}, capacity={_C.format_bytes(s['capacity'])}, "
            f"in_use={_C.format_bytes(s['in_use'])}, peak={_C.format_bytes(s['peak_in_use'])})"
        )
