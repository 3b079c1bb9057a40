"""Room on the compute tier kept for good beside the chunks: HybridAdam's device half.

After a traced training step the optimizer asks how much of the budget the step never needed
(the margin), reserves blocks of the arena for the moments of some chunks, and keeps those
chunks on the compute tier for good (fix), so their optimizer step runs there. A plan with
less room (a later, larger input) has some go back to the host tier first (give_back). The blocks
are the compute tier's (runtime/tiers.py), which Residency reads because reserved bytes come
out of the chunks' share; Reservations makes the decisions and moves the chunks' homes,
through the Residency and GradAccumulator it is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from fxstar.runtime.chunk import Chunk, ChunkBudgetError, ChunkState, Home
from fxstar.runtime.grad_copies import GradAccumulator
from fxstar.runtime.layout import kept_room, spare_bytes
from fxstar.runtime.residency import Residency
from fxstar.runtime.tier_copy import copy_payload

__all__ = ["Reservations"]


@dataclass
class _KeptHomes:
    """A chunk keep() keeps: its host home as it found it, and its reserved blocks."""

    home: Home  # on the host tier (its pages given back while kept)
    blocks: list[torch.Tensor] = field(default_factory=list)  # moments, gradient, master
    released: int = 0  # host bytes given back to the system


class Reservations:
    """How much may be kept on the compute tier, and the chunks kept there."""

    def __init__(
        self,
        residency: Residency,
        grads: GradAccumulator,
        homes: dict[str, torch.Tensor],
    ):
        self.residency = residency
        self.compute = residency.compute  # the arena, whose blocks are reserved
        self.grads = grads
        self.homes = homes  # what each stable parameter is a view of: a kept chunk's moves
        self.released_bytes = 0  # host pages of kept chunks given back to the system
        # what keep() took for each chunk it keeps: its host home as it was (its pages given
        # back, its tensors kept for give_back), its reserved blocks, the pages released
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
        budget = residency.chunk_budget
        if budget is None:
            return 0  # nothing to plan a margin from
        used = [(m.pinned_bytes, m.nonmodel_bytes) for m in moments]
        spare = spare_bytes(budget, residency.arena.capacity, used, ratio)
        spare -= self.reserved_bytes()
        if residency.plan is not None:  # never more than the plan it follows holds kept
            room = kept_room(
                budget,
                residency.arena.capacity,
                residency.static_share,
                residency.plan,
                residency.layout.chunk_bytes,
            )
            spare = min(spare, room - self.kept_bytes())
        return max(spare, 0)

    def reserved_bytes(self) -> int:
        return self.compute.reserved_bytes()

    def kept_bytes(self) -> int:
        """Compute-tier bytes the chunks kept there for good hold: their payloads and the
        blocks reserved beside them (gradients, masters, moments)."""
        kept = sum(c.kept for c in self.residency.chunks)
        return kept * self.residency.layout.chunk_bytes + self.reserved_bytes()

    def kept_chunk_bytes(self, chunk_id: int) -> int:
        """What one kept chunk holds on the compute tier: its payload and its blocks."""
        kept = self._kept.get(chunk_id)
        blocks = kept.blocks if kept is not None else []
        return self.residency.layout.chunk_bytes + sum(map(self.compute.block_size, blocks))

    def unreserve(self, count: int) -> None:
        """Give back the last `count` reserved blocks (a keep that could not complete)."""
        self.compute.unreserve(count)

    def reserve(self, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """`nbytes` of the compute tier for good, out of the chunks' share (zeroed)."""
        self.residency.drop_unused()
        return self.compute.reserve(nbytes, dtype)  # ArenaOutOfMemory when fragmented

    def keep(self, chunk_id: int, *, share_room: bool = False,
            beside: Sequence[torch.Tensor] = ()) -> None:  # fmt: skip
        """Keep a chunk on the compute tier for good, with its gradient buffer and (bf16/fp16)
        its fp32 master there too: its optimizer step runs there and nothing of it crosses
        tiers again (until a plan without room for it: give_back). Its home is then its compute
        copy, which the stable parameters view (or its master). `beside`: blocks reserved for
        it already (its moments), freed with its own when it goes back.

        `share_room` (bf16/fp16, gradients in the payload's room): the gradient takes the room
        of the compute payload itself, as it took the host payload's (14 bytes per parameter
        kept instead of 16, so the margin keeps more): the payload is the rounded master, and
        a read of a slot whose room holds its gradient is given the rounded master instead
        (ChunkManager.fetch, SavedTensors.unpack)."""
        residency, layout = self.residency, self.residency.layout
        chunk = residency.chunks[chunk_id]
        if chunk.kept:
            return
        used = slice(0, chunk.used)
        if chunk.remote:  # another rank's (sharded payloads): its fetched payload stays
            self._resident(chunk)
            chunk.keep_on_compute(Home(self.compute, residency.chunk_view(chunk), None))
            return
        host = chunk.home
        share_room = share_room and host.grad_in_payload
        kept = _KeptHomes(host, list(beside))
        grad = None
        if host.grad is not None and not share_room:
            grad = self.reserve(layout.chunk_bytes, layout.dtype)
            kept.blocks.append(grad)
        master = self.reserve(layout.chunk_size * 4, torch.float32) if host.master is not None \
            else None  # fmt: skip
        if master is not None:
            kept.blocks.append(master)
        self._resident(chunk)  # the payload's slots holding gradients: rounded masters
        payload = residency.chunk_view(chunk)
        if grad is not None:
            copy_payload(grad[used], host.grad[used])
        elif share_room:  # this step's gradients move into the compute payload's room
            for slot in chunk.slots_holding_grads():
                span = slice(slot.offset, slot.offset + slot.numel)
                copy_payload(payload[span], host.payload[span])
        if master is not None:
            copy_payload(master[used], host.master[used])
        else:  # the host home is the latest (a resident copy may predate an optimizer step)
            copy_payload(payload[used], host.payload[used])
        chunk.keep_on_compute(Home(self.compute, payload, payload if share_room else grad,
                                   master, grad_in_payload=share_room))  # fmt: skip
        self._view_homes(chunk)
        residency.round_master(chunk)
        # what stays behind on the host is never read again: its pages go back
        left = [host.payload, host.master, None if host.grad_in_payload else host.grad]
        kept.released = host.tier.give_back([t[used] for t in left if t is not None])
        self.released_bytes += kept.released
        self._kept[chunk_id] = kept

    def give_back(self, chunk_id: int) -> None:
        """A chunk kept on the compute tier goes back to the host tier: payload, gradients
        (in the payload's room again where they had it) and master into its host home as
        keep() found it, its blocks freed (its moments too: the optimizer copied them out
        first), the stable parameters views of the host home; it is then paged like any
        other. Between steps only: nothing may be using it."""
        residency = self.residency
        chunk = residency.chunks[chunk_id]
        kept = self._kept.pop(chunk_id, None)
        if not chunk.kept or kept is None:
            raise ValueError(f"chunk {chunk_id} is not kept on the compute tier by keep()")
        chunk.drop_pins()  # pins left by an abandoned step
        used = slice(0, chunk.used)
        here, host = chunk.home, kept.home
        present = [s for s in chunk.slots if self.grads.has_grad(s)]
        # written through `.data`: the values do not change, so neither may the version the
        # stable parameters share with every view of their host buffer (what autograd saved
        # of any chunk before this would read as modified)
        payload = host.payload.data
        copy_payload(payload[used], here.payload[used])  # gradients where they had the room
        grad_rooms = set(chunk.grad_slots)
        if host.grad is not None and not here.grad_in_payload:  # a gradient block of its own
            if host.grad_in_payload:  # back into the payload's room, as keep() found them
                for slot in present:
                    span = slice(slot.offset, slot.offset + slot.numel)
                    copy_payload(payload[span], here.grad[span])
                grad_rooms = {s.name for s in present}
            else:
                copy_payload(host.grad.data[used], here.grad[used])
        if host.master is not None:
            copy_payload(host.master.data[used], here.master[used])
        chunk.back_to_host(host, grad_rooms)
        self._view_homes(chunk)
        chunk.sync_host(residency.stable)  # the payload's parameters from the masters
        residency.evict(chunk)  # the host copy is the latest: the resident one goes
        for block in kept.blocks:
            self.compute.free(block)
        self.released_bytes -= kept.released

    def _view_homes(self, chunk: Chunk) -> None:
        """The chunk's stable parameters (and their gradients) view its fp32 home and its
        gradient buffer."""
        home = chunk.fp32_home
        for slot in chunk.slots:
            stable = self.residency.stable[slot.name]
            stable.data = home[slot.offset : slot.offset + slot.numel].view(slot.shape)
            self.homes[slot.name] = stable.data
            if stable.grad is not None:
                stable.grad = self.grads.grad_view(slot)

    def _resident(self, chunk: Chunk) -> None:
        """The chunk loaded into a block of its own, if it is not resident already."""
        if chunk.resident:
            return
        residency = self.residency
        residency.drop_unused()
        offset = residency.take_block()
        if offset is None:
            raise ChunkBudgetError(f"no arena block left to keep chunk {chunk.id} in")
        residency.load(chunk, offset, ChunkState.HOLD)
