"""What an optimizer step and the data-parallel collectives see of the chunks.

HybridAdam updates the rank's own trainable chunks: for each it needs the slots, the gradient
buffer and a slot's gradient, the fp32 home it updates and the payload the update rounds into,
and to say what it wrote. Under data parallelism the collectives read and write the same parts
of every chunk (gradients to their owners, updated parameters from them). Neither sees the
ChunkManager: this view is what they are given, and every change it makes goes through the
chunks' own verbs (runtime/chunk.py). The device half (chunks kept on the compute tier with
their optimizer state) is reached through the same view.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from fxstar.runtime.chunk import Chunk
from fxstar.runtime.grad_copies import GradAccumulator
from fxstar.runtime.layout import ChunkLayout, ParamSlot
from fxstar.runtime.reservations import Reservations
from fxstar.runtime.residency import Residency
from fxstar.runtime.saved_tensors import SavedTensors
from fxstar.runtime.tracer import Moment

__all__ = ["StepChunks"]


class StepChunks:
    """The chunks as a step updates them: gradients, fp32 homes, payloads, the device half."""

    def __init__(
        self,
        residency: Residency,
        grads: GradAccumulator,
        saved: SavedTensors,
        reservations: Reservations,
        *,
        owns: Callable[[int], bool],
        grads_in_payload: bool,
    ):
        self._residency = residency
        self._grads = grads
        self._saved = saved
        self._reservations = reservations
        self._owns = owns
        self.layout: ChunkLayout = residency.layout
        self.device: torch.device = residency.device
        self.grads_in_payload = grads_in_payload  # bf16/fp16 gradients share the payload

    # -- the chunks -----------------------------------------------------------------------------

    @property
    def chunks(self) -> Sequence[Chunk]:
        """Every chunk of the layout, in order (data parallel: every rank's)."""
        return self._residency.chunks

    def chunk(self, chunk_id: int) -> Chunk:
        return self._residency.chunks[chunk_id]

    def owns(self, chunk_id: int) -> bool:
        """This rank steps the chunk (data parallel: its owner; else every chunk)."""
        return self._owns(chunk_id)

    def own_trainable(self) -> list[Chunk]:
        """The chunks this rank updates: its own, with a gradient buffer."""
        return [c for c in self.chunks if c.grad is not None and self._owns(c.id)]

    def param(self, slot: ParamSlot) -> nn.Parameter:
        """The stable parameter users and optimizers see for a slot."""
        return self._residency.stable[slot.name]

    def params(self) -> Sequence[nn.Parameter]:
        return list(self._residency.stable.values())

    # -- gradients ------------------------------------------------------------------------------

    def slot_grad(self, slot: ParamSlot) -> torch.Tensor | None:
        """This step's gradient of a parameter, or None when it got none."""
        return self._grads.slot_grad(slot)

    def has_grad(self, slot: ParamSlot) -> bool:
        return self._grads.has_grad(slot)

    def set_has_grad(self, slot: ParamSlot, has: bool) -> None:
        """The slot's gradient is what its buffer holds now (`has`), or it has none."""
        self._grads.set_has_grad(slot, has)

    def grad_view(self, slot: ParamSlot) -> torch.Tensor:
        return self._grads.grad_view(slot)

    def is_grad_buffer(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is some chunk's gradient buffer itself."""
        return any(tensor is c.grad for c in self.chunks)

    def wait_for_grads(self) -> None:
        """Every gradient copy in flight has landed."""
        self._grads.wait()

    def gradients_reduced(self) -> None:
        """Sharded payloads: what backward staged is with its owners (a backward whose
        end-of-graph callback did not run leaves units staged: reduced here)."""
        self._grads.wait()
        shards = self._grads.shards
        if shards is not None and shards.staged:
            shards.flush()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._grads.zero_grad(set_to_none)

    # -- what a step wrote ----------------------------------------------------------------------

    def payload_written(self, chunk: Chunk, slots: Sequence[ParamSlot]) -> None:
        """The optimizer wrote these slots' updated parameters into the payload, over the
        gradients that had its room: those are consumed until zero_grad."""
        chunk.params_written(slots)
        for slot in slots:
            self._grads.consumed_by_step(slot)

    def stepped(self, chunk: Chunk) -> None:
        """The optimizer updated the chunk's home: a copy made before is stale (a kept
        chunk's compute copy is its home, current once the masters' versions are read)."""
        if chunk.kept:
            chunk.compute_changed(self._residency.versions(chunk))
        else:
            chunk.host_changed()

    def masters_from_owner(self, chunk: Chunk) -> None:
        """Another rank wrote the chunk's fp32 home: its payload is rounded from it again."""
        chunk.sync_host(self._residency.stable)
        chunk.host_changed()

    def masters_written(self, settled: Callable[[int], object] | None = None) -> None:
        """The stable parameters (the fp32 masters under bf16/fp16) were written from outside
        the step: every chunk's payload follows them; `settled(chunk_id)` after each (the
        masters' mapped pages go back, a chunk at a time)."""
        for chunk in self.chunks:
            chunk.sync_host(self._residency.stable)
            chunk.host_changed()
            if settled is not None:
                settled(chunk.id)

    # -- the device half ------------------------------------------------------------------------

    def traced_step(self) -> list[Moment]:
        """The moments of the last traced training step (empty before one ran)."""
        return self._residency.tracer.training_step()

    @property
    def load_unit(self) -> int:
        return self._residency.load_unit

    def drop_unused(self) -> None:
        """Every chunk nothing uses leaves the compute tier (all ranks alike: the same set)."""
        self._residency.drop_unused()

    def margin(self, ratio: float) -> int:
        """What the compute tier can spare for good (see Reservations.margin)."""
        return self._reservations.margin(ratio)

    def reserved_count(self) -> int:
        """Blocks reserved on the compute tier beside the chunks."""
        return len(self._residency.compute.reserved)

    def reserve(self, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """`nbytes` of the compute tier for good, out of the chunks' share (zeroed)."""
        return self._reservations.reserve(nbytes, dtype)

    def unreserve(self, count: int) -> None:
        """Give back the last `count` reserved blocks (a keep that could not complete)."""
        self._reservations.unreserve(count)

    def keep(self, chunk_id: int, *, share_room: bool = False,
             beside: Sequence[torch.Tensor] = ()) -> None:  # fmt: skip
        """Keep a chunk on the compute tier for good (see Reservations.keep)."""
        self._reservations.keep(chunk_id, share_room=share_room, beside=beside)

    def give_back(self, chunk_id: int) -> None:
        """A kept chunk back to the host tier, its blocks freed (see Reservations.give_back).
        Between steps: what the last backward left (copies in flight, its last node's pins)
        ends first, as at the start of a step."""
        self._grads.wait()
        self._saved.unpin_all()
        self._reservations.give_back(chunk_id)

    def kept_bytes(self) -> int:
        """Compute-tier bytes the chunks kept there for good hold, with their blocks."""
        return self._reservations.kept_bytes()

    def kept_chunk_bytes(self, chunk_id: int) -> int:
        return self._reservations.kept_chunk_bytes(chunk_id)
