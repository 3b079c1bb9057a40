"""Room on the compute tier kept for good beside the chunks: HybridAdam's device half.

After a traced training step the optimizer asks how much of the budget the step never needed
(the margin), reserves blocks of the arena for the moments of some chunks, and keeps those
chunks on the compute tier for good (fix), so their optimizer step runs there. A plan with
less room (a later, larger input) has some go back to the host tier first (unfix). Composition,
in two parts so that nothing points back: ReservedBlocks is the state (the arena blocks lent
out), which Residency reads because reserved bytes come out of the chunks' share; Reservations
makes the decisions and moves, through the Residency and GradAccumulator it is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from fxstar.runtime.arena import ArenaBuffer
from fxstar.runtime.grad_copies import GradAccumulator
from fxstar.runtime.host import release_pages
from fxstar.runtime.layout import kept_room, spare_bytes
from fxstar.runtime.residency import ChunkBudgetError, ChunkState, Residency
from fxstar.runtime.tier_copy import copy_payload


@dataclass
class _KeptHomes:
    """A chunk fix() keeps: its host homes as it found them, and its reserved blocks."""

    host: torch.Tensor  # the host payload (its pages given back while kept)
    master: torch.Tensor | None
    host_grad: torch.Tensor | None
    grads_in_host: bool  # its gradients took the host payload's room
    blocks: list[torch.Tensor] = field(default_factory=list)  # moments, gradient, master
    released: int = 0  # host bytes given back to the system


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

    def size(self, block: torch.Tensor) -> int:
        """Bytes the arena gave the block `block` starts (a tensor take() returned)."""
        return self.arena.allocator.block_size(block.data_ptr() - self.arena.buffer.data_ptr())

    def free(self, block: torch.Tensor) -> None:
        """Free the block `block` starts (a tensor take() returned)."""
        offset = block.data_ptr() - self.arena.buffer.data_ptr()
        self.offsets.remove(offset)
        self.arena.free(offset)


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
        # what fix() took for each chunk it keeps: its host homes as they were (their pages
        # given back, their tensors kept for unfix), its reserved blocks, the pages released
        self._kept: dict[int, _KeptHomes] = {}

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
        spare -= self.reserved_bytes()
        if residency.plan is not None:  # never more than the plan it follows holds kept
            room = kept_room(
                residency.budget,
                residency.arena.capacity,
                residency.static_share,
                residency.plan,
                residency.layout.chunk_bytes,
            )
            spare = min(spare, room - self.kept_bytes())
        return max(spare, 0)

    def reserved_bytes(self) -> int:
        return self.blocks.bytes()

    def kept_bytes(self) -> int:
        """Compute-tier bytes the chunks kept there for good hold: their payloads and the
        blocks reserved beside them (gradients, masters, moments)."""
        fixed = sum(c.fixed for c in self.residency.chunks)
        return fixed * self.residency.layout.chunk_bytes + self.reserved_bytes()

    def kept_chunk_bytes(self, chunk_id: int) -> int:
        """What one kept chunk holds on the compute tier: its payload and its blocks."""
        kept = self._kept.get(chunk_id)
        blocks = kept.blocks if kept is not None else []
        return self.residency.layout.chunk_bytes + sum(map(self.blocks.size, blocks))

    def unreserve(self, count: int) -> None:
        """Give back the last `count` reserved blocks (a keep that could not complete)."""
        self.blocks.give_back(count)

    def reserve(self, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """`nbytes` of the compute tier for good, out of the chunks' share (zeroed)."""
        self.residency.drop_unused()
        return self.blocks.take(nbytes, dtype)  # ArenaOutOfMemory when fragmented: caller stops

    def fix(self, chunk_id: int, *, share_room: bool = False,
            beside: Sequence[torch.Tensor] = ()) -> None:  # fmt: skip
        """Keep a chunk on the compute tier for good, with its gradient buffer and (bf16/fp16)
        its fp32 master there too: its optimizer step runs there and nothing of it crosses
        tiers again (until a plan without room for it: unfix). The stable parameters become
        views of the compute-tier copy. `beside`: blocks reserved for it already (its
        moments), freed with its own when it goes back.

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
        kept = _KeptHomes(chunk.host, chunk.master, chunk.host_grad, chunk.grads_in_host,
                          list(beside))  # fmt: skip
        grad = None
        if chunk.host_grad is not None and not share_room:
            grad = self.reserve(layout.chunk_bytes, layout.dtype)
            kept.blocks.append(grad)
        master = self.reserve(n * 4, torch.float32) if chunk.master is not None else None
        if master is not None:
            kept.blocks.append(master)
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
        self._view_homes(chunk, home)
        chunk.fixed = True
        residency.round_master(chunk)
        kept.released = sum(release_pages(t[used]) for t in left if t is not None)
        self.released_bytes += kept.released
        self._kept[chunk_id] = kept

    def unfix(self, chunk_id: int) -> None:
        """A chunk kept on the compute tier goes back to the host tier: payload, gradients
        (in the payload's room again where they had it) and master into its host homes as
        fix() found them, its blocks freed (its moments too: the optimizer copied them out
        first), the stable parameters views of the host homes; it is then paged like any
        other. Between steps only: nothing may be using it."""
        residency = self.residency
        chunk = residency.chunks[chunk_id]
        kept = self._kept.pop(chunk_id, None)
        if not chunk.fixed or kept is None:
            raise ValueError(f"chunk {chunk_id} is not kept on the compute tier by fix()")
        if chunk.state is ChunkState.COMPUTE:  # pins left by an abandoned step
            chunk.pins = 0
            chunk.move(ChunkState.HOLD_AFTER_FWD)
        used = slice(0, chunk.used)
        payload = residency.chunk_view(chunk)
        present = [s for s in chunk.slots if self.grads.has_grad(s)]
        # written through `.data`: the values do not change, so neither may the version the
        # stable parameters share with every view of their host buffer (what autograd saved
        # of any chunk before this would read as modified)
        host = kept.host.data
        copy_payload(host[used], payload[used])  # gradients where they had the room
        grad_slots = set(chunk.grad_slots)
        if kept.host_grad is not None and not chunk.grads_in_host:  # a gradient block of its own
            if kept.grads_in_host:  # back into the payload's room, as fix() found them
                for slot in present:
                    span = slice(slot.offset, slot.offset + slot.numel)
                    copy_payload(host[span], chunk.host_grad[span])
                grad_slots = {s.name for s in present}
            else:
                copy_payload(kept.host_grad.data[used], chunk.host_grad[used])
        if kept.master is not None:
            copy_payload(kept.master.data[used], chunk.master[used])
        chunk.host, chunk.master, chunk.host_grad = kept.host, kept.master, kept.host_grad
        chunk.grads_in_host = kept.grads_in_host
        chunk.grad_slots = grad_slots if kept.grads_in_host else set()
        chunk.fixed = False
        self._view_homes(chunk, chunk.master if chunk.master is not None else chunk.host)
        chunk.sync_host(residency.stable)  # the payload's parameters from the masters
        chunk.host_version += 1  # the host copy is the latest; the resident one goes
        residency.evict(chunk)
        for block in kept.blocks:
            self.blocks.free(block)
        self.released_bytes -= kept.released

    def _view_homes(self, chunk, home: torch.Tensor) -> None:
        """The chunk's stable parameters (and their gradients) view `home` and its buffers."""
        for slot in chunk.slots:
            stable = self.residency.stable[slot.name]
            stable.data = home[slot.offset : slot.offset + slot.numel].view(slot.shape)
            self.homes[slot.name] = stable.data
            if stable.grad is not None:
                stable.grad = self.grads.grad_view(slot)

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
