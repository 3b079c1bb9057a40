"""A chunk of parameters, owner of its state: where its home lies, whether the compute tier
holds a copy, who pins it, and which slots' payload room a gradient has taken.

Nothing else assigns a chunk's fields; each change is a verb, and the three kinds of change
are checked against a table: the residency state (LEGAL: loaded, in use, evictable,
released), the tier the home lies on (HOME_MOVES: kept on the compute tier for good, given
back to the host), and each slot's payload room (ROOMS). The room is the rule of bf16/fp16
chunks whose gradients share their payload (PatrickStar's): the gradient takes its slot's room
in the low-precision payload as backward produces it, the fp32 master restores the parameters
when the gradient is consumed or dropped, and a read of a slot whose room holds a gradient is
given the rounded master instead.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fxstar.errors import FxstarError
from fxstar.runtime.layout import ParamSlot
from fxstar.runtime.tiers import ComputeTier, Tier

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "HOME_MOVES",
    "LEGAL",
    "MASTER_PART",
    "RESIDENT",
    "ROOMS",
    "Chunk",
    "ChunkBudgetError",
    "ChunkState",
    "Home",
    "Room",
]


class ChunkBudgetError(FxstarError, MemoryError):
    """What one moment of the step needs does not fit the compute tier's budget."""


class ChunkState(enum.Enum):
    FREE = "free"  # no payload yet
    RELEASED = "released"  # on the host tier only
    COMPUTE = "compute"  # on the compute tier and in use: pinned
    HOLD = "hold"  # on the compute tier, not in use (prefetched)
    HOLD_AFTER_FWD = "hold_after_fwd"  # forward is done with it; evictable
    HOLD_AFTER_BWD = "hold_after_bwd"  # backward is done with it; evictable


S = ChunkState
LEGAL: dict[ChunkState, set[ChunkState]] = {
    S.FREE: {S.RELEASED},
    S.RELEASED: {S.COMPUTE, S.HOLD},
    S.COMPUTE: {S.COMPUTE, S.HOLD_AFTER_FWD, S.HOLD_AFTER_BWD},
    S.HOLD: {S.COMPUTE, S.RELEASED},
    S.HOLD_AFTER_FWD: {S.COMPUTE, S.RELEASED},
    S.HOLD_AFTER_BWD: {S.COMPUTE, S.RELEASED},
}
RESIDENT = {S.COMPUTE, S.HOLD, S.HOLD_AFTER_FWD, S.HOLD_AFTER_BWD}

# a chunk's fp32 master as a part of the disk tier (plan.disk.masters): the Home's `master`
# is then a mapped view of its file
MASTER_PART = "master"

# the tiers a home may move between, by Tier.name (a disk tier adds its own)
HOME_MOVES: dict[str, set[str]] = {"host": {"compute"}, "compute": {"host"}}


class Room(enum.Enum):
    """What a slot's room in the payload holds (chunks whose gradients share the payload)."""

    PARAMS = "params"
    GRAD = "grad"  # backward's gradient took it; the fp32 master holds the parameters


ROOMS: dict[Room, set[Room]] = {
    Room.PARAMS: {Room.GRAD},
    Room.GRAD: {Room.GRAD, Room.PARAMS},  # more gradient accumulates; parameters back
}


@dataclass(frozen=True)
class Home:
    """A chunk's lasting parts and the tier they lie on: the payload (`used` elements the
    compute tier copies: low precision, or the fp32 parameters), the gradient buffer (None for
    a frozen chunk, the payload itself where gradients share its room), the fp32 master (bf16
    and fp16 chunks)."""

    tier: Tier
    payload: torch.Tensor
    grad: torch.Tensor | None
    master: torch.Tensor | None = None
    grad_in_payload: bool = False  # the gradient takes its slot's room in the payload


class Chunk:
    """One chunk's state; every change is a method, and the tables above check them."""

    def __init__(
        self, chunk_id: int, slots: list[ParamSlot], home: Home, used: int = 0, *,
        remote: bool = False,
    ):  # fmt: skip
        self._id = chunk_id
        self._slots = slots
        self._used = used  # elements taken by parameters: only these are copied
        # data parallel with sharded payloads: another rank owns it, this one has no home on
        # the host (an empty payload) and gets its payload from the owner at each load
        self._remote = remote
        self._home = home
        self._rooms: dict[str, Room] = {}  # slots whose room is not their parameters'
        self._state = ChunkState.FREE
        self._offset: int | None = None  # arena byte offset while resident
        self._pins = 0
        self._last_access = -1
        self._host_version = 0  # bumped when the host copy changes behind torch's back
        self._updates = 0  # optimizer steps that changed its parameters (saved views go stale)
        self._synced_versions: tuple[int, ...] = ()  # masters' versions the payload rounds
        self._loaded_versions: tuple[int, ...] = ()  # host and stable versions when copied

    def __repr__(self) -> str:
        return (f"Chunk({self._id}, {self._state.value}, {self._home.tier.name}, "
                f"pins={self._pins})")  # fmt: skip

    # -- what it is -----------------------------------------------------------------------------

    @property
    def id(self) -> int:
        return self._id

    @property
    def slots(self) -> list[ParamSlot]:
        return self._slots

    @property
    def used(self) -> int:
        return self._used

    @property
    def remote(self) -> bool:
        return self._remote

    @property
    def home(self) -> Home:
        return self._home

    @property
    def payload(self) -> torch.Tensor:
        """The home's payload: on the host, or (kept, gradients in its room) on the compute
        tier."""
        return self._home.payload

    @property
    def grad(self) -> torch.Tensor | None:
        """The gradient buffer, None for a frozen chunk."""
        return self._home.grad

    @property
    def master(self) -> torch.Tensor | None:
        return self._home.master

    @property
    def fp32_home(self) -> torch.Tensor:
        """Its fp32 parameters, which the stable ones view (`used` elements): the master, or
        the payload of an fp32 chunk, wherever the home lies."""
        home = self.master if self.master is not None else self.payload
        return home[: self._used]

    @property
    def grads_in_payload(self) -> bool:
        return self._home.grad_in_payload

    @property
    def kept(self) -> bool:
        """Its home is on the compute tier for good (HybridAdam's device half)."""
        return isinstance(self._home.tier, ComputeTier)

    # -- residency ------------------------------------------------------------------------------

    @property
    def state(self) -> ChunkState:
        return self._state

    @property
    def resident(self) -> bool:
        return self._state in RESIDENT

    @property
    def offset(self) -> int | None:
        """Its block in the arena while resident."""
        return self._offset

    @property
    def pins(self) -> int:
        return self._pins

    @property
    def last_access(self) -> int:
        return self._last_access

    def move(self, new: ChunkState) -> None:
        if new not in LEGAL[self._state]:
            raise RuntimeError(
                f"chunk {self._id}: illegal state change {self._state.value} -> {new.value}"
            )
        self._state = new

    def homed(self) -> None:
        """Its home holds its values: on the host tier from now on (FREE -> RELEASED)."""
        self.move(ChunkState.RELEASED)

    def placed(self, offset: int) -> None:
        """A load is copying it into the arena block at `offset`."""
        if self.resident:
            raise RuntimeError(f"chunk {self._id}: loaded again while resident")
        self._offset = offset

    def loaded(self, versions: tuple[int, ...], state: ChunkState) -> None:
        """Its load finished: the copy is of `versions`, the chunk in `state`."""
        self._loaded_versions = versions
        self.move(state)

    def evicted(self) -> None:
        """Its block on the compute tier is gone: the host home holds it alone."""
        self.move(ChunkState.RELEASED)
        self._offset = None

    def accessed(self, t: int) -> None:
        """In use at access t of the step."""
        if self._state is not ChunkState.COMPUTE:
            self.move(ChunkState.COMPUTE)
        self._last_access = t

    def pin(self) -> None:
        """One more reader of its compute copy (a fetch, an unpack): not evictable."""
        if self._state is not ChunkState.COMPUTE:
            raise RuntimeError(f"chunk {self._id}: pinned while {self._state.value}")
        self._pins += 1

    def unpin(self, then: ChunkState) -> None:
        """A reader is done; the last one leaves it evictable in state `then`."""
        if self._pins <= 0:
            raise RuntimeError(f"chunk {self._id}: unpinned more often than pinned")
        self._pins -= 1
        if self._pins == 0:
            self.move(then)

    def drop_pins(self) -> None:
        """Readers an abandoned step left behind are gone: evictable again."""
        if self._state is ChunkState.COMPUTE:
            self._pins = 0
            self.move(ChunkState.HOLD_AFTER_FWD)

    # -- versions -------------------------------------------------------------------------------

    @property
    def host_version(self) -> int:
        return self._host_version

    @property
    def updates(self) -> int:
        return self._updates

    @property
    def loaded_versions(self) -> tuple[int, ...]:
        return self._loaded_versions

    def host_changed(self) -> None:
        """The optimizer (or a collective) wrote its home behind torch's back: a resident
        copy is stale, and so is what autograd saved of it."""
        self._host_version += 1
        self._updates += 1

    def compute_changed(self, versions: tuple[int, ...]) -> None:
        """The optimizer wrote its kept compute copy itself: current as of `versions`."""
        self._updates += 1
        self._loaded_versions = versions

    def copy_current(self, versions: tuple[int, ...]) -> None:
        """Its compute copy was made again, from `versions` (a kept chunk's, from masters)."""
        self._loaded_versions = versions

    def sync_host(self, stable: Mapping[str, nn.Parameter]) -> None:
        """Round the fp32 masters into the low-precision payload (a slot whose room holds its
        gradient keeps it)."""
        if self.master is None or self.kept:  # a kept chunk's copy is on the compute tier
            return
        if self._rooms:
            self.round_into(self.payload, self.slots_holding_grads(False))
        else:
            self.payload[: self._used].copy_(self.master[: self._used])
        self._synced_versions = tuple(stable[s.name]._version for s in self._slots)
        self._host_version += 1

    def masters_changed(self, stable: Mapping[str, nn.Parameter]) -> bool:
        """Whether the stable parameters (the masters) changed since the payload was rounded."""
        if self.master is None:
            return False
        return tuple(stable[s.name]._version for s in self._slots) != self._synced_versions

    # -- kept on the compute tier ---------------------------------------------------------------

    def _move_home(self, home: Home) -> None:
        here, there = self._home.tier.name, home.tier.name
        if there not in HOME_MOVES.get(here, set()):
            raise RuntimeError(f"chunk {self._id}: its home cannot move from {here} to {there}")
        self._home = home

    def keep_on_compute(self, home: Home) -> None:
        """Its home moves to the compute tier for good. A gradient of its own there (not in
        the payload's room) gives the payload's rooms back: its compute copy is rounded from
        the master afresh."""
        self._move_home(home)
        if not home.grad_in_payload:
            self._rooms.clear()

    def back_to_host(self, home: Home, grad_rooms: Collection[str] = ()) -> None:
        """Its home moves back to the host tier; `grad_rooms`: the slots whose gradient went
        back into its payload room there."""
        self._move_home(home)
        self._rooms = {name: Room.GRAD for name in grad_rooms} if home.grad_in_payload else {}

    # -- the payload's room ---------------------------------------------------------------------

    def _set_room(self, slot: ParamSlot, room: Room) -> None:
        if not self.grads_in_payload:
            raise RuntimeError(f"chunk {self._id}: its gradients have a buffer of their own")
        now = self._rooms.get(slot.name, Room.PARAMS)
        if room not in ROOMS[now]:
            raise RuntimeError(
                f"chunk {self._id}: slot {slot.name}'s room cannot go from {now.value} to "
                f"{room.value}"
            )
        if room is Room.PARAMS:
            self._rooms.pop(slot.name, None)
        else:
            self._rooms[slot.name] = room

    @property
    def grad_slots(self) -> frozenset[str]:
        """The slots whose payload room holds a gradient now."""
        return frozenset(self._rooms)

    def take_room(self, slot: ParamSlot) -> None:
        """The slot's gradient takes (or keeps) its room in the payload, where gradients
        share it; a chunk whose gradients have a buffer of their own is unchanged."""
        if self.grads_in_payload:
            self._set_room(slot, Room.GRAD)

    def params_written(self, slots: Sequence[ParamSlot]) -> None:
        """The optimizer wrote these slots' updated parameters over their gradients."""
        for slot in slots:
            if slot.name in self._rooms:
                self._set_room(slot, Room.PARAMS)

    def restore_params(self) -> None:
        """Every slot whose room holds a gradient gets its parameters back (the gradient was
        consumed or is dropped)."""
        if self._rooms:
            self.round_into(self.payload, self.slots_holding_grads())
            for slot in self.slots_holding_grads():
                self._set_room(slot, Room.PARAMS)

    def keep_grads_only(self, owned: Collection[ParamSlot]) -> None:
        """A collective wrote gradients over the whole payload: the `owned` slots' rooms hold
        gradients, every other slot gets its parameters back."""
        if not self.grads_in_payload:
            return
        self.round_into(self.payload, [s for s in self._slots if s not in owned])
        for slot in self._slots:
            if slot in owned:
                self._set_room(slot, Room.GRAD)
            elif slot.name in self._rooms:
                self._set_room(slot, Room.PARAMS)

    def slots_holding_grads(self, holding: bool = True) -> list[ParamSlot]:
        """The slots whose room holds a gradient now (or, `holding=False`, the others)."""
        return [s for s in self._slots if (s.name in self._rooms) == holding]

    def round_into(self, payload: torch.Tensor, slots: Sequence[ParamSlot]) -> None:
        """These slots' parameters, rounded from their fp32 masters, into a payload laid out
        as the chunk (its home's, or its compute-tier copy)."""
        for slot in slots:
            span = slice(slot.offset, slot.offset + slot.numel)
            payload[span].copy_(self.master[span])

    def holds_grad_within(self, start: int, stop: int) -> bool:
        """Whether a gradient has the room of any element in [start, stop) of the payload."""
        return any(
            slot.offset < stop and start < slot.offset + slot.numel
            for slot in self.slots_holding_grads()
        )

    def rounded(
        self,
        offset: int,
        size: Sequence[int],
        dtype: torch.dtype,
        stride: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Payload elements (contiguous, or as strided) as a tensor of their own, rounded from
        the fp32 master: what the payload holds where no gradient took its room (a read of a
        slot whose room does)."""
        if stride is None:
            stride = torch.empty(tuple(size), device="meta").stride()
        start = self.master.storage_offset() + offset  # as_strided counts from the storage's
        return self.master.as_strided(tuple(size), tuple(stride), start).to(dtype, copy=True)
