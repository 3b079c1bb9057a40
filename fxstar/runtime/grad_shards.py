"""Gradients of sharded chunks, reduced to their owners as soon as backward is done with them.

With the payloads sharded (data parallel, `data_parallel_shard='params'`), a rank has a
gradient buffer for its own chunks only. Autograd's gradients of every chunk are staged in a
buffer per *unit* (a chunk group of N chunks, or one chunk with `mem_saving_comm`); when every
parameter leaf fetched from the unit has handed its gradient over, the unit is reduced at once
(a reduce-scatter of the group, or a reduce to the chunk's owner), inside backward, and the
staging buffer is reused: a rank never holds more than the units backward is still working on,
not a gradient of the whole model (ZeRO-3's reduction by buckets, in PatrickStar's units).

The owner divides its sum by N and accumulates it into its chunk's gradient buffer, so the
gradient it steps is the average over the ranks, summed over micro-batches (reduced every
backward, as ZeRO-3 does, rather than only on the stepping one). A unit some leaf of never
produced a gradient (a parameter the loss does not reach, a checkpointed region's forward
leaves, whose recomputation made new ones) is reduced at the end of backward, in unit order.
Every rank fetches the same leaves and autograd runs them in the same order, so the ranks
reduce the same units in the same order; a rank that does not hangs the collective until
`plan.dist_timeout`, which names it.

At most MAX_STAGED units are staged at once: a unit that would be one more first reduces the
one staged longest with what it has (the sum is linear: what arrives for it later is staged
and reduced again, and the owner adds it), so the staging a compute tier must hold beside the
chunks is bounded (on a GPU the staging lives there, and the chunk plan leaves it its room).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from fxstar.runtime.chunk import Chunk
from fxstar.runtime.layout import MAX_STAGED, ChunkLayout, ParamSlot

__all__ = ["GradShards", "UnitReducers"]


class UnitReducers(Protocol):
    """The chunks' owners and the reduction of a staged unit to them
    (data_parallel.ChunkGroups)."""

    size: int
    mem_saving: bool
    pg: dist.ProcessGroup
    peak_staging_bytes: int

    def owner(self, chunk_id: int) -> int: ...

    def owns(self, chunk_id: int) -> bool: ...

    def reduce_unit(
        self, staged: torch.Tensor, owners: list[int], chunk_size: int
    ) -> torch.Tensor | None: ...


class GradShards:
    """Staged gradients of the units backward is working on, and their reduction."""

    def __init__(
        self,
        groups: UnitReducers,
        chunks: Sequence[Chunk],
        layout: ChunkLayout,
        take: Callable[[ParamSlot, torch.Tensor], None],
    ):
        self.groups = groups
        self.chunks = chunks
        self.chunk_size = layout.chunk_size
        self.dtype = layout.dtype
        self.take = take  # the owner's accumulation of its averaged share, slot by slot
        self.per_unit = 1 if groups.mem_saving else groups.size
        self.expected: dict[int, int] = {}  # unit -> leaves fetched whose gradients will come
        self.arrived: dict[int, int] = {}  # unit -> gradients handed over
        self.staged: dict[int, torch.Tensor] = {}  # unit -> its staging buffer
        self.names: dict[int, set[str]] = {}  # unit -> slots with a gradient staged
        self.spare: list[torch.Tensor] = []  # staging buffers kept for reuse (MAX_STAGED)
        self._flush_queued = False

    def unit(self, chunk_id: int) -> int:
        return chunk_id // self.per_unit

    def expect(self, chunk_id: int) -> None:
        """A parameter leaf of this chunk that wants a gradient was fetched."""
        unit = self.unit(chunk_id)
        self.expected[unit] = self.expected.get(unit, 0) + 1

    def add(self, slot: ParamSlot, grad: torch.Tensor) -> None:
        """A leaf's gradient, staged; its unit is reduced once all its leaves handed theirs."""
        unit = self.unit(slot.chunk)
        buffer = self.staged.get(unit)
        if buffer is None:
            if len(self.staged) >= MAX_STAGED:  # the longest staged goes with what it has
                self._reduce(next(iter(self.staged)), partial=True)
            buffer = self.staged[unit] = self._stage(grad.device)
            self.names[unit] = set()
        start = (slot.chunk - unit * self.per_unit) * self.chunk_size + slot.offset
        view = buffer[start : start + slot.numel].view(slot.shape)
        with torch.no_grad():
            if slot.name in self.names[unit]:
                view.add_(grad.to(view.device))
            else:
                view.copy_(grad)
                self.names[unit].add(slot.name)
        self.arrived[unit] = self.arrived.get(unit, 0) + 1
        if not self._flush_queued:  # backward's end reduces what is left
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)
            self._flush_queued = True
        if self.arrived[unit] >= self.expected.get(unit, 0):
            self._reduce(unit)

    def flush(self) -> None:
        """Reduce every unit still staged (in unit order: every rank alike)."""
        self._flush_queued = False
        for unit in sorted(self.staged):
            self._reduce(unit)
        self.expected.clear()
        self.arrived.clear()

    def _stage(self, device: torch.device) -> torch.Tensor:
        """A zeroed staging buffer where the gradients are (the compute tier: under NCCL a
        card, whose reduction stays on it; on the host the host group reduces it)."""
        numel = self.per_unit * self.chunk_size
        if self.spare and self.spare[-1].device == device:
            buffer = self.spare.pop()
            buffer.zero_()  # slots no leaf wrote are summed too
        else:
            buffer = torch.zeros(numel, dtype=self.dtype, device=device)
        held = (len(self.staged) + 1) * buffer.nbytes
        self.groups.peak_staging_bytes = max(self.groups.peak_staging_bytes, held)
        return buffer

    def _reduce(self, unit: int, *, partial: bool = False) -> None:
        """Reduce a staged unit; `partial`: before all its gradients arrived (the rest are
        still expected, and reduced when they have)."""
        buffer, names = self.staged.pop(unit), self.names.pop(unit)
        arrived = self.arrived.pop(unit, 0)
        expected = self.expected.pop(unit, 0)
        if partial:
            self.expected[unit] = expected - arrived
        first = unit * self.per_unit
        ids = range(first, first + self.per_unit)
        mine = self.groups.reduce_unit(buffer, [self.groups.owner(i) for i in ids],
                                       self.chunk_size)  # fmt: skip
        if mine is not None:
            chunk = next(self.chunks[i] for i in ids if self.groups.owns(i))
            mine.div_(self.groups.size)
            for slot in chunk.slots:
                if slot.name in names:
                    self.take(slot, mine[slot.offset : slot.offset + slot.numel].view(slot.shape))
        self._recycle(buffer)

    def _recycle(self, buffer: torch.Tensor) -> None:
        if len(self.spare) < MAX_STAGED:
            self.spare.append(buffer)

    def discard(self) -> None:
        """Forget what a backward that raised left staged (zero_grad)."""
        for unit in list(self.staged):
            self._recycle(self.staged.pop(unit))
        self.names.clear()
        self.expected.clear()
        self.arrived.clear()
