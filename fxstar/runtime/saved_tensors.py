"""What autograd saves of chunk memory, kept by where its values live rather than by address.

In forward, a tensor autograd saves that views the arena is packed as a Handle (chunk, offset,
size, stride, and the chunk's content version); in backward it is unpacked by accessing the
chunk again, possibly at a new place, so backward never reads memory that was reused
meanwhile, and a chunk whose values changed since (an optimizer step, an in-place edit) is the
error eager autograd would raise. The chunks backward unpacks, or a recomputation fetches, stay
pinned until backward moves on to another node. The ChunkManager owns one SavedTensors and
delegates to it (composition: the pins of the current backward node are state nothing else
writes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fxstar.runtime.chunk import Chunk, ChunkState
from fxstar.runtime.residency import Residency

Pins = tuple[object | None, list[Chunk]]  # the backward node that pinned them, and the chunks


@dataclass(frozen=True)
class Handle:
    """A saved arena tensor, by where its values live rather than by its address."""

    chunk: int
    offset: int  # elements from the chunk's start
    size: tuple[int, ...]
    stride: tuple[int, ...]
    version: tuple[int, ...] = ()  # the chunk's content version when saved


class SavedTensors:
    """The saved-tensor hooks' two halves, and the pins they leave while backward runs."""

    def __init__(self, residency: Residency):
        self.residency = residency
        self.node_pins: Pins = (None, [])  # chunks the current backward node unpacked
        self.recompute_pins: Pins = (None, [])  # chunks a recomputation in it fetched

    # -- the hooks ------------------------------------------------------------------------------

    def pack(self, t: torch.Tensor) -> object:
        residency = self.residency
        byte = residency.position(t)
        if byte is not None:
            layout = residency.layout
            if t.dtype != layout.dtype:
                raise RuntimeError(f"a saved {t.dtype} view of {layout.dtype} chunk memory")
            for chunk in residency.chunks:
                if chunk.resident and chunk.offset <= byte < chunk.offset + layout.chunk_bytes:
                    offset = (byte - chunk.offset) // t.element_size()
                    return Handle(chunk.id, offset, tuple(t.shape), tuple(t.stride()),
                                  self.content_version(chunk))  # fmt: skip
            raise RuntimeError("a saved arena tensor belongs to no resident chunk")
        # detached: the tensor autograd saves may be the node's own output, whose grad_fn is
        # the node that keeps what this returns; holding it with its grad_fn would be a
        # reference cycle, freed by the cycle collector only (an eval loop without no_grad
        # would grow until then). The detached tensor shares storage and version counter;
        # autograd gives the unpacked tensor back its grad_fn itself.
        return residency.tracer.saved(t.detach())  # counted as activation memory

    def unpack(self, packed: object) -> torch.Tensor:
        if not isinstance(packed, Handle):
            return self.residency.tracer.unpacked(packed)
        node = torch._C._current_autograd_node()
        if node is not self.node_pins[0]:
            self._unpin_node()
            self.node_pins = (node, [])
        if node is not self.recompute_pins[0]:
            self._unpin(self.recompute_pins[1])
            self.recompute_pins = (None, [])
        chunk = self.residency.chunks[packed.chunk]
        if self.content_version(chunk) != packed.version:  # before anything is fetched
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: parameters of chunk {chunk.id} "
                f"({', '.join(s.name for s in chunk.slots)}) changed after the forward that "
                "saved them (an optimizer step, or an in-place edit, between this loss's "
                "forward and its backward). Call backward before engine.step(), or run the "
                "forward again."
            )
        chunk = self.residency.access(packed.chunk, "backward")
        chunk.pin()
        self.node_pins[1].append(chunk)
        if chunk.kept and chunk.grad_slots:  # a gradient may have taken the room it read
            extent = sum((n - 1) * s for n, s in zip(packed.size, packed.stride, strict=True))
            if chunk.holds_grad_within(packed.offset, packed.offset + extent + 1):
                return chunk.rounded(packed.offset, packed.size, self.residency.layout.dtype,
                                     packed.stride)  # fmt: skip
        return self.residency.view(chunk, packed.offset, packed.size, packed.stride)

    def access_in_recomputation(self, chunk_id: int) -> Chunk:
        """A chunk fetched in backward, where a checkpointed region recomputes. A
        recomputation saves what backward needs as plain tensors, not through the hooks:
        every chunk it fetched stays pinned until backward moves on to another node (the
        region's gradients are done), whatever its release nodes say."""
        node = torch._C._current_autograd_node()
        if node is not self.node_pins[0]:
            self._unpin_node()  # the node that unpacked them is done
        if node is not self.recompute_pins[0]:
            self._unpin(self.recompute_pins[1])
            self.recompute_pins = (node, [])
        chunk = self.residency.access(chunk_id, "backward")
        self.recompute_pins[1].append(chunk)
        return chunk

    # -- pins -----------------------------------------------------------------------------------

    def unpin_all(self) -> None:
        """Backward is over (or was abandoned): no node holds a chunk any more."""
        self._unpin_node()
        self._unpin(self.recompute_pins[1])
        self.recompute_pins = (None, [])

    def _unpin_node(self) -> None:
        """The backward node that unpacked these chunks is done: they are evictable again."""
        self._unpin(self.node_pins[1])
        self.node_pins = (None, [])

    @staticmethod
    def _unpin(chunks: list[Chunk]) -> None:
        for chunk in chunks:
            chunk.unpin(ChunkState.HOLD_AFTER_BWD)

    # -- content versions -----------------------------------------------------------------------

    def content_version(self, chunk: Chunk) -> tuple[int, ...]:
        """Changes whenever the chunk's parameter values do: optimizer updates, in-place edits."""
        stable = self.residency.stable
        return (chunk.updates, *(stable[s.name]._version for s in chunk.slots))

    def version_token(self) -> tuple[int, int]:
        """Changes whenever any parameter's values do (a recomputation's staleness check)."""
        return (
            sum(c.updates for c in self.residency.chunks),
            sum(p._version for p in self.residency.stable.values()),
        )
