"""Room on the compute tier kept for good beside the chunks: HybridAdam's device half.

After a traced training step the optimizer asks how much of the budget the step never needed
(the margin), reserves blocks of the arena for the moments of some chunks, and keeps those
chunks on the compute tier for good (fix), so their optimizer step runs there. Composition,
in two parts so that nothing points back: ReservedBlocks is the state (the arena blocks lent
out), which Residency reads because reserved bytes come out of the chunks' share; Reservations
makes the decisions and moves, through the Residency and GradAccumulator it is given.
"""

from __future__ import annotations

import torch

from fxstar.runtime.arena import ArenaBuffer
from fxstar.runtime.grad_copies import GradAccumulator
from fxstar.runtime.host import release_pages
from fxstar.runtime.layout import spare_bytes
from fxstar.runtime.residency import ChunkBudgetError, ChunkState, Residency
from fxstar.runtime.tier_copy import copy_payload


class ReservedBlocks:
    """The arena blocks kept beside the chunks, by offset, in the order they were taken."""

    def __init__(self, arena: ArenaBuffer):
        self.arena = arena
        self.offsets: list[int] = []

    def bytes(self) -> int:
        return sum(self.arena.allocator.block_size(offset) for offset in self.offsets)

    def take(self, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """A new zeroed block; ArenaOutOfMemory when the arena has none that large."""
        offset = self.arena.alloc(nbytes)
        self.offsets.append(offset)
        block = self.arena.buffer[offset : offset + nbytes]
        block.zero_()
        return block.view(dtype)

    def give_back(self, count: int) -> None:
        """Free the last `count` blocks taken."""
        for _ in range(count):
            self.arena.free(self.offsets.pop())


class Reservations:
    """How much may be kept on the compute tier, and the chunks kept there."""

    def __init__(
        self,
        residency: Residency,
        blocks: ReservedBlocks,
        grads: GradAccumulator,
        homes: dict[str, torch.Tensor],
    ):
        self.residency = residency
        self.blocks = blocks
        self.grads = grads
        self.homes = homes  # what each stable parameter is a view of: a fixed chunk's moves
        self.released_bytes = 0  # host pages of fixed chunks given back to the system

    def margin(self, ratio: float) -> int:
        """What the compute tier can spare for good, from the last traced training step: the
        budget less the chunks in use and the activations at its fullest moment, times `ratio`
        (PatrickStar's margin_use_ratio). 0 before a training step ran, or with a static
        partition (nothing was traced to plan from)."""
        residency = self.residency
        moments = residency.tracer.training_step()
        if residency.static_share is not None or not any(m.phase == "backward" for m in moments):
            return 0
        if residency.budget is None:
            return 0  # nothing to plan a margin from
        used = [(m.pinned_bytes, m.nonmodel_bytes) for m in moments]
        spare = spare_bytes(residency.budget, residency.arena.capacity, used, ratio)
        return max(spare - self.reserved_bytes(), 0)

    def reserved_bytes(self) -> int:
        return self.blocks.bytes()

    def unreserve(self, count: int) -> None:
        """Give back the last `count` reserved blocks (a keep that could not complete)."""
        self.blocks.give_back(count)

    def reserve(self, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """`nbytes` of the compute tier for good, out of the chunks' share (zeroed)."""
        self.residency.drop_unused()
        return self.blocks.take(nbytes, dtype)  # ArenaOutOfMemory when fragmented: caller stops

    def fix(self, chunk_id: int, *, share_room: bool = False) -> None:
        """Keep a chunk on the compute tier for good, with its gradient buffer and (bf16/fp16)
        its fp32 master there too: its optimizer step runs there and nothing of it crosses
        tiers again. The stable parameters become views of the compute-tier copy.

        `share_room` (bf16/fp16, gradients in the payload's room): the gradient takes the room
        of the compute payload itself, as it took the host payload's (14 bytes per parameter
        kept instead of 16, so the margin keeps more): the payload is the rounded master, and
        a read of a slot whose room holds its gradient is given the rounded master instead
        (ChunkManager.fetch, SavedTensors.unpack)."""
        residency, layout = self.residency, self.residency.layout
        chunk = residency.chunks[chunk_id]
        if chunk.fixed:
            return
        if chunk.remote:  # another rank's (sharded payloads): its fetched payload stays
            self._resident(chunk)
            chunk.fixed = True
            return
        n = layout.chunk_size
        share_room = share_room and chunk.grads_in_host
        grad = None
        if chunk.host_grad is not None and not share_room:
            grad = self.reserve(layout.chunk_bytes, layout.dtype)
        master = self.reserve(n * 4, torch.float32) if chunk.master is not None else None
        self._resident(chunk)  # the payload's slots holding gradients: rounded masters
        used = slice(0, chunk.used)
        # what stays behind on the host is never read again: its pages go back (below)
        left = [chunk.host[used], chunk.master, None if chunk.grads_in_host else chunk.host_grad]
        if grad is not None:
            copy_payload(grad[used], chunk.host_grad[used])
            chunk.host_grad = grad
            chunk.grads_in_host = False  # its gradients live beside it on the compute tier now
            chunk.grad_slots.clear()
        elif share_room:  # this step's gradients move into the compute payload's room
            payload = residency.chunk_view(chunk)
            for slot in chunk.slots_holding_grads():
                span = slice(slot.offset, slot.offset + slot.numel)
                copy_payload(payload[span], chunk.host[span])
            chunk.host = chunk.host_grad = payload
        home = residency.chunk_view(chunk)
        if master is not None:
            copy_payload(master[used], chunk.master[used])
            chunk.master = home = master
        else:  # the host home is the latest (a resident copy may predate an optimizer step)
            copy_payload(home[used], chunk.host[used])
        for slot in chunk.slots:
            stable = residency.stable[slot.name]
            stable.data = home[slot.offset : slot.offset + slot.numel].view(slot.shape)
            self.homes[slot.name] = stable.data
            if stable.grad is not None:
                stable.grad = self.grads.grad_view(slot)
        chunk.fixed = True
        residency.round_master(chunk)
        self.released_bytes += sum(release_pages(t[used]) for t in left if t is not None)

    def _resident(self, chunk) -> None:
        """The chunk loaded into a block of its own, if it is not resident already."""
        if chunk.resident:
            return
        residency = self.residency
        residency.drop_unused()
        offset = residency.take_block()
        if offset is None:
            raise ChunkBudgetError(f"no arena block left to keep chunk {chunk.id} in")
        residency.load(chunk, offset, ChunkState.HOLD)

    def compute_updated(self, chunk_id: int) -> None:
        """The optimizer wrote a fixed chunk's compute copy (and master) itself."""
        chunk = self.residency.chunks[chunk_id]
        chunk.updates += 1
        chunk.loaded_versions = self.residency.versions(chunk)
