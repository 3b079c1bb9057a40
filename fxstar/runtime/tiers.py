"""The tiers a chunk's parts live on, each an object that holds its own memory.

A chunk's home (its payload, its gradient buffer, its fp32 master: runtime/chunk.py's Home)
lies on one tier. The host tier allocates homes (payloads and gradients in the buffers the
compute Device copies asynchronously with: page-locked on an accelerator) and gives the pages
of a home no longer read back to the system. The compute tier is one arena of `device_memory`
bytes on the compute Device (runtime/device.py, whose streams order the copies between the
tiers): the blocks residency loads chunks into, tensors viewing them, and the blocks kept there
for good beside the chunks (HybridAdam's device half: moments, gradients, masters); on a card
and the simulated device those blocks are tensors of the Device's allocator, shared with
activations (arena.PooledBlocks: dynamic partition), elsewhere one buffer (ArenaBuffer). Whether a
copy crosses tiers is a matter of tiers, not of `tensor.device`: on a CPU-only machine, and on
the simulated device the tests use, both tiers are host memory. A tier below the host (a disk)
is another subclass of Tier, not new fields on the chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from fxstar.runtime.arena import ArenaBuffer, PooledBlocks
from fxstar.runtime.device import Device
from fxstar.runtime.host import host_empty, release_pages
from fxstar.runtime.layout import ParamSlot

__all__ = ["ComputeTier", "HostTier", "Tier"]


class Tier:
    """Where a chunk's home may lie; `name` keys the moves a home may make (chunk.HOME_MOVES)."""

    name: ClassVar[str]


class HostTier(Tier):
    """Ordinary memory: every chunk's home until the compute tier keeps it for good."""

    name = "host"

    def __init__(self, compute_device: Device):
        self.compute_device = compute_device  # whose side streams copy payloads and gradients

    def empty(self, numel: int, dtype: torch.dtype, *, payload: bool = True) -> torch.Tensor:
        """`numel` zeroed elements; a payload or gradient in the compute device's host buffers
        (page-locked on an accelerator), a master or moments in the core's (only the CPU
        Adam reads them)."""
        nbytes = numel * dtype.itemsize
        if payload:
            return self.compute_device.host_empty(nbytes, zero=True).view(dtype)
        return host_empty(nbytes, zero=True).view(dtype)

    @staticmethod
    def give_back(tensors: Sequence[torch.Tensor | None]) -> int:
        """Return the pages of tensors no one reads again to the system; the bytes given."""
        return sum(release_pages(t) for t in tensors if t is not None)


class ComputeTier(Tier):
    """The arena: blocks chunks are loaded into, and blocks kept for good beside them."""

    name = "compute"

    def __init__(self, arena: ArenaBuffer | PooledBlocks, dtype: torch.dtype,
                 compute_device: Device):  # fmt: skip
        self.arena = arena
        self.compute_device = compute_device  # the streams and events of its copies
        self.device = arena.device
        self.dtype = dtype  # the chunks' elements
        self.reserved: list[int] = []  # offsets of the blocks kept beside the chunks, in order

    # -- blocks kept for good -------------------------------------------------------------------

    def reserved_bytes(self) -> int:
        return sum(self.arena.allocator.block_size(offset) for offset in self.reserved)

    def reserve(self, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """A new zeroed block kept beside the chunks; ArenaOutOfMemory when none is that large."""
        offset = self.arena.alloc(nbytes)
        self.reserved.append(offset)
        buffer, start = self.arena.bytes_at(offset)
        block = buffer[start : start + nbytes]
        block.zero_()
        return block.view(dtype)

    def unreserve(self, count: int) -> None:
        """Free the last `count` blocks reserved."""
        for _ in range(count):
            self.arena.free(self.reserved.pop())

    def block_size(self, block: torch.Tensor) -> int:
        """Bytes the arena gave the reserved block `block` starts."""
        return self.arena.allocator.block_size(self.arena.position(block))

    def free(self, block: torch.Tensor) -> None:
        """Free the reserved block `block` starts."""
        offset = self.arena.position(block)
        self.reserved.remove(offset)
        self.arena.free(offset)

    # -- tensors viewing the arena --------------------------------------------------------------

    def position(self, t: torch.Tensor) -> int | None:
        """Where in the arena's blocks `t`'s first element lies (a byte offset, as a chunk's
        block is named); None when `t` is not compute-tier chunk memory."""
        return self.arena.position(t)

    def _elements(self, block: int) -> tuple[torch.Tensor, int]:
        """The chunks' elements holding the block at byte `block`, and its first element."""
        buffer, start = self.arena.bytes_at(block)
        return buffer.view(self.dtype), start // self.dtype.itemsize

    def view(
        self,
        block: int,
        offset: int,
        shape: Sequence[int],
        stride: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Elements from `offset` (elements) on of the chunk loaded at byte `block`."""
        elements, base = self._elements(block)
        base += offset
        if stride is None:
            numel = 1
            for d in shape:
                numel *= d
            return elements[base : base + numel].view(shape)
        return elements.as_strided(shape, stride, base)

    def leaf(self, block: int, slot: ParamSlot) -> torch.Tensor:
        """A parameter's values in the arena as a tensor of its own: not an autograd view of
        the arena buffer (views of a view would route their gradient to the buffer, not to
        this leaf), and with a version counter of its own (`detach` would share the buffer's,
        which every chunk load bumps: a custom Function handing the parameter on as-is would
        then see its input "modified in place")."""
        leaf = torch.empty(0, dtype=self.dtype, device=self.device)
        elements, base = self._elements(block)
        stride = torch.empty(slot.shape, device="meta").stride()
        return leaf.set_(elements.untyped_storage(), base + slot.offset, slot.shape, stride)
