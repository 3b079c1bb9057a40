"""Where each chunk is: the resident set on the compute tier, and the moves that change it.

Residency follows one step's access plan (the order the chunk_schedule pass decided): an
access makes room for its chunk within the share of the budget that access may use, evicting
by Belady's rule (the resident chunk used again farthest ahead), copies the chunk in from its
host home when it is not resident or its resident copy is stale, and then starts copying the
next planned chunk when that fits without evicting anything (prefetch). It also hands out
tensors viewing a resident chunk's arena memory.

With sharded data-parallel payloads a load brings a chunk's whole group (`load_unit` N,
ChunkPlan.load_unit): the group's N chunks take one arena block, filled by one all-gather (each
rank copies its own chunk into its place first), and are evicted together, Belady's rule
weighing a group by its member used soonest (PatrickStar's and ZeRO-3's group fetch).

The ChunkManager owns one Residency and delegates to it (composition: the resident set, the
block cache and the step's plan are state nothing else writes); the other collaborators reach
the chunks through it.
"""

from __future__ import annotations

import bisect
import enum
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from fxstar.errors import FxstarError
from fxstar.runtime.arena import ArenaBuffer, ArenaOutOfMemory
from fxstar.runtime.chunk_stats import ChunkStats
from fxstar.runtime.layout import AccessPlan, ChunkLayout, ParamSlot, blocks_at_once
from fxstar.runtime.tier_copy import copy_payload
from fxstar.runtime.tracer import MemoryTracer

if TYPE_CHECKING:
    from torch import nn

    from fxstar.runtime.data_parallel import ChunkGroups
    from fxstar.runtime.reservations import ReservedBlocks


PREFETCH_LOOKAHEAD = 64  # accesses a prefetch looks ahead for a chunk that is not resident


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


@dataclass
class Chunk:
    id: int
    slots: list[ParamSlot]
    host: torch.Tensor  # `used` elements on the host tier: what the compute tier copies
    host_grad: torch.Tensor | None  # gradient buffer, or None for frozen chunks
    used: int = 0  # elements taken by parameters: only these are copied
    master: torch.Tensor | None = None  # fp32 master when the chunks hold a lower precision
    host_version: int = 0  # bumped when the host copy changes behind torch's back (our Adam)
    updates: int = 0  # optimizer steps that changed its parameters (saved views go stale)
    synced_versions: tuple[int, ...] = ()  # masters' versions when `host` was made from them
    state: ChunkState = ChunkState.FREE
    offset: int | None = None  # arena byte offset while resident
    pins: int = 0
    loaded_versions: tuple[int, ...] = ()  # host_version and stable versions when copied
    last_access: int = -1
    fixed: bool = False  # kept on the compute tier for good, optimizer included (fix())
    # bf16/fp16: the gradient takes the room of the host payload (`host_grad` views `host`),
    # slot by slot as backward produces it; `grad_slots` names the slots whose room holds a
    # gradient now. Their parameters are the rounded masters, which restore them. A chunk kept
    # on the compute tier for good has its payload there (`host` views its arena block): a
    # read of a slot whose room holds a gradient gets the rounded master instead (`rounded`).
    grads_in_host: bool = False
    grad_slots: set[str] = field(default_factory=set)
    # data parallel with sharded payloads: another rank owns it, this one has no host home
    # (`host` is empty) and gets its payload from the owner at each load
    remote: bool = False

    def move(self, new: ChunkState) -> None:
        if new not in LEGAL[self.state]:
            raise RuntimeError(
                f"chunk {self.id}: illegal state change {self.state.value} -> {new.value}"
            )
        self.state = new

    @property
    def resident(self) -> bool:
        return self.state in RESIDENT

    def sync_host(self, stable: Mapping[str, nn.Parameter]) -> None:
        """Round the fp32 masters into the chunk's low-precision host copy (a slot whose room
        holds its gradient keeps it)."""
        if self.master is None or self.fixed:  # a fixed chunk's copy is on the compute tier
            return
        if self.grad_slots:
            self.round_into(self.host, self.slots_holding_grads(False))
        else:
            self.host[: self.used].copy_(self.master[: self.used])
        self.synced_versions = tuple(stable[s.name]._version for s in self.slots)
        self.host_version += 1

    def slots_holding_grads(self, holding: bool = True) -> list[ParamSlot]:
        """The slots whose host room holds a gradient now (or, `holding=False`, the others)."""
        return [s for s in self.slots if (s.name in self.grad_slots) == holding]

    def round_into(self, payload: torch.Tensor, slots: Sequence[ParamSlot]) -> None:
        """These slots' parameters, rounded from their fp32 masters, into a payload laid out
        as the chunk (its host copy or its compute-tier copy)."""
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

    def restore_params(self) -> None:
        """Every slot whose host room holds a gradient gets its parameters back (the gradient
        was consumed or is dropped)."""
        if self.grad_slots:
            self.round_into(self.host, self.slots_holding_grads())
            self.grad_slots.clear()


class Residency:
    """The chunks, which of them the compute tier holds, and the step's plan it follows."""

    def __init__(
        self,
        layout: ChunkLayout,
        chunks: list[Chunk],
        stable: dict[str, nn.Parameter],
        *,
        arena: ArenaBuffer,
        reserved: ReservedBlocks,
        stats: ChunkStats,
        tracer: MemoryTracer,
        budget: int | None,
        static_share: int | None,
        mem_cache: int,
        prefetch: bool,
        copy_stream: torch.cuda.Stream | None,
        owners: ChunkGroups | None = None,
        load_unit: int = 1,
    ):
        self.layout = layout
        self.device = arena.device
        self.chunks = chunks
        self.stable = stable  # the parameters users see: their versions tell a stale copy
        self.arena = arena
        self.arena_elements = arena.buffer.view(layout.dtype)
        self.reserved = reserved  # arena blocks kept beside the chunks, out of their share
        self.stats = stats
        self.tracer = tracer
        self.budget = budget
        self.static_share = static_share
        self.cache_capacity = mem_cache
        self.prefetch = prefetch
        self.copy_stream = copy_stream
        # sharded payloads: every load is a collective with the chunks' owners (each rank
        # makes the same choices, following one plan under one budget)
        self.owners = owners
        # chunks one load brings and one eviction drops: 1, or (sharded, ChunkPlan.load_unit)
        # a whole group in one block of its N chunks
        self.load_unit = load_unit
        self.unit_bytes = load_unit * layout.chunk_bytes
        self.inflight: dict[int, object] = {}  # chunk -> its prefetch's collective (sharded)
        self.prefetched: set[int] = set()  # chunks a prefetch loaded, not yet accessed
        self.checking = False  # verify the residency invariants after every access (tests)
        self.cache: list[int] = []  # freed chunk blocks kept for reuse (mem_cache)
        self.plan: AccessPlan | None = None
        self.positions: dict[int, list[int]] = {}  # each chunk's accesses in the plan
        self.cursor = 0
        self.recorded: list[tuple[int, str]] = []  # this step's accesses: chunk, phase
        self.step_bytes = 0  # bytes moved host->compute in this step
        self.step_started = 0.0  # perf_counter() at this step's first access

    def begin_step(self, plan: AccessPlan) -> None:
        """Follow `plan` from its first access; what the last step moved is counted."""
        for chunk in self.chunks:  # pins left by an abandoned step
            if chunk.state is S.COMPUTE:
                chunk.pins = 0
                chunk.move(S.HOLD_AFTER_FWD)
        now = time.perf_counter()
        if any(phase == "backward" for _, phase in self.recorded):  # a training step ended
            self.stats.end_step(self.step_bytes, now - self.step_started)
        self.step_started = now
        self.step_bytes = 0
        self.stats.steps += 1
        self.plan = plan
        self.positions = {}
        for i, c in enumerate(plan.chunks):
            self.positions.setdefault(c, []).append(i)
        self.cursor = 0
        self.recorded = []
        self.prefetched.clear()
        self.tracer.begin_step()

    def close(self) -> None:
        self.cache.clear()

    # -- accesses -------------------------------------------------------------------------------

    def access(self, chunk_id: int, phase: str) -> Chunk:
        """The chunk resident and in use, its copy current: the next access of the step."""
        t = self.advance(chunk_id)
        self.recorded.append((chunk_id, phase))
        chunk = self.chunks[chunk_id]
        if chunk.fixed:  # fp32: the stable parameters are its payload, never stale
            if chunk.master is not None and self._stale(chunk):
                self.round_master(chunk)  # someone changed the masters on the compute tier
        elif (chunk.resident and not chunk.pins  # pinned: its readers keep the copy they saw
              and any(self._stale(c) for c in self.unit(chunk))):  # fmt: skip
            self._evict_stale(chunk)  # a host copy changed (an optimizer step)
        if chunk.id in self.prefetched:  # not a group member that came along with another
            self.prefetched.discard(chunk.id)
            self.stats.prefetch_hits += chunk.resident
        self._make_room(t, chunk)
        self._arrived(chunk)
        if chunk.state is not S.COMPUTE:
            chunk.move(S.COMPUTE)
        chunk.last_access = t
        pinned = blocks_at_once({c.id for c in self.chunks if c.pins or c is chunk},
                                self.load_unit) * self.layout.chunk_bytes  # fmt: skip
        self.tracer.record(t, phase, chunk_id, self.resident_bytes(), self.share(t), pinned)
        if self.checking:
            self._check(t)
        if self.prefetch:
            self._prefetch_after(t)
        return chunk

    def advance(self, chunk_id: int) -> int:
        """The position of this access in the plan; unplanned accesses do not move it."""
        positions = self.positions.get(chunk_id, [])
        i = bisect.bisect_left(positions, self.cursor)
        if i == len(positions):
            self.stats.unexpected_accesses += 1
            return min(self.cursor, max(len(self.plan) - 1, 0))
        self.cursor = positions[i] + 1
        return positions[i]

    # -- the resident set -----------------------------------------------------------------------

    def unit(self, chunk: Chunk) -> list[Chunk]:
        """The chunks loaded and evicted with `chunk`: itself, or its whole group."""
        if self.load_unit == 1:
            return [chunk]
        first = chunk.id - chunk.id % self.load_unit
        return self.chunks[first : first + self.load_unit]

    def units(self) -> list[list[Chunk]]:
        return [self.unit(c) for c in self.chunks[:: self.load_unit]]

    def share(self, t: int) -> int:
        """Bytes chunks may hold on the compute tier at access t."""
        if self.static_share is not None:
            return self.static_share
        plan = self.plan
        nonmodel = plan.nonmodel_bytes[t] if plan is not None and t < len(plan) else 0
        if self.budget is None:  # no device_memory: the arena holds every chunk
            return self.arena.capacity - self.reserved.bytes()
        return min(self.arena.capacity, self.budget - nonmodel) - self.reserved.bytes()

    def resident_bytes(self) -> int:
        return sum(self.layout.chunk_bytes for c in self.chunks if c.resident)

    def _make_room(self, t: int, chunk: Chunk) -> None:
        """Evict until the chunks resident with `chunk` fit the share at access t (which may
        have shrunk since the last access: activations grow), then load `chunk` if needed."""
        need = 0 if chunk.resident else self.unit_bytes
        while self.resident_bytes() + need > self.share(t):
            self._evict_one(t, chunk, "every other resident chunk is in use")
        if chunk.resident:
            return
        while (offset := self.take_block()) is None:
            self._evict_one(t, chunk, "the arena has no block left")
        self.load(chunk, offset)

    def take_block(self) -> int | None:
        """A block for one load (a chunk, or a group): a cached one (mem_cache), else a new
        one from the arena."""
        if self.cache:
            self.stats.cache_hits += 1
            return self.cache.pop()
        try:
            return self.arena.alloc(self.unit_bytes)
        except ArenaOutOfMemory:
            return None

    def _evict_one(self, t: int, keep: Chunk, why: str) -> None:
        victim = self._victim(t, keep)
        if victim is None:
            raise self._budget_error(t, why)
        self._evict(victim)

    def _victim(self, t: int, keep: Chunk) -> Chunk | None:
        """Belady: of the resident units none of whose chunks is pinned, the one used again
        farthest in the future (a group: by its member used soonest)."""
        best, best_key = None, None
        for unit in self.units():
            if (not unit[0].resident or keep in unit
                    or any(c.pins or c.fixed for c in unit)):  # fmt: skip
                continue
            key = (min(self._next_use(c, t) for c in unit), -max(c.last_access for c in unit))
            if best_key is None or key > best_key:
                best, best_key = unit[0], key
        return best

    def _next_use(self, chunk: Chunk, t: int) -> int:
        """The plan position of the chunk's next access after t (the next step's first
        access, counted on from this step's end, when this step has none left)."""
        n = len(self.plan) if self.plan is not None else 0
        positions = self.positions.get(chunk.id, [])
        i = bisect.bisect_right(positions, t)
        if i < len(positions):
            return positions[i]
        return n + positions[0] if positions else 2 * n + 1

    def _arrived(self, chunk: Chunk) -> None:
        """Wait for the prefetch of the chunk's unit (a broadcast, or its group's gather), if
        one is in flight."""
        works = {}
        for member in self.unit(chunk):
            work = self.inflight.pop(member.id, None)
            if work is not None:
                works[id(work)] = work
        for work in works.values():
            self.owners.arrived(chunk.id, work)

    def _evict(self, chunk: Chunk, count: bool = True) -> None:
        """Drop the chunk's unit from the compute tier (the host holds the master copy:
        this moves no bytes)."""
        unit = self.unit(chunk)
        self._arrived(chunk)  # its block is about to be reused
        block = unit[0].offset
        for member in unit:
            member.move(S.RELEASED)
            member.offset = None
        if len(self.cache) < self.cache_capacity:
            self.cache.append(block)
        else:
            self.arena.free(block)
        if count:
            self.stats.evictions += len(unit)

    def evict(self, chunk: Chunk) -> None:
        """Drop a resident chunk nothing uses from the compute tier, outside a step's
        choices (a kept chunk going back to the host tier): no eviction is counted."""
        if chunk.resident:
            self._evict(chunk, count=False)

    def _evict_stale(self, chunk: Chunk) -> None:
        """A resident chunk whose host copy (or a group member's) changed is dropped, to be
        loaded afresh. A group is loaded as one: a member in use (no step leaves one in use
        when the optimizer steps) would be overwritten under its readers, so that is an
        error, not a reload."""
        busy = [c.id for c in self.unit(chunk) if c.pins or c.fixed]
        if busy:
            raise RuntimeError(
                f"chunk {chunk.id} changed while chunks {busy} of its group are in use or kept: "
                "a group is loaded as one, so it cannot be refreshed now; change parameters "
                "between steps (or set mem_saving_comm=True, which loads chunk by chunk)"
            )
        self._evict(chunk, count=False)

    def drop_unused(self) -> None:
        """Evict every unit none of whose chunks is in use and empty the block cache: room to
        reserve from."""
        for unit in self.units():
            if unit[0].resident and not any(
                c.pins or c.fixed or c.state is S.COMPUTE for c in unit
            ):
                self._evict(unit[0], count=False)
        while self.cache:
            self.arena.free(self.cache.pop())

    def _prefetch_after(self, t: int) -> None:
        """Start loading the next chunk the plan needs that is not resident (with group loads
        the next group, its gather beside this one's compute), if it fits without evicting
        anything at any access until it is needed."""
        plan = self.plan
        if plan is None:
            return
        need = self.resident_bytes() + self.unit_bytes
        for u in range(t + 1, min(t + 1 + PREFETCH_LOOKAHEAD, len(plan))):
            if need > self.share(u):
                return
            chunk = self.chunks[plan.chunks[u]]
            if not chunk.resident:
                break
        else:
            return
        offset = self.take_block()
        if offset is not None:
            self.load(chunk, offset, S.HOLD)
            self.prefetched.add(chunk.id)

    # -- copies between the tiers ---------------------------------------------------------------

    def load(self, chunk: Chunk, offset: int, state: ChunkState = S.COMPUTE) -> None:
        """Copy the chunk's unit into the arena block at `offset`: each member's host home
        into its place (a rank's own chunks), then, with sharded payloads, what other ranks
        own from them. The other members of a group come in as prefetched (HOLD)."""
        unit = self.unit(chunk)
        for i, member in enumerate(unit):
            versions = self.versions(member)  # first: it may refresh the host copy
            member.offset = offset + i * self.layout.chunk_bytes
            if not member.remote:
                payload = self.view(member, 0, (member.used,))
                self.copy(payload, member.host[: member.used], to_host=False)
                if member.grad_slots:  # their host room holds gradients: masters' values
                    member.round_into(payload, member.slots_holding_grads())
            member.loaded_versions = versions
        if self.owners is not None:
            self._from_owners(unit, wait=state is not S.HOLD)
        for member in unit:
            member.move(state if member is chunk else S.HOLD)
            self.stats.loads += 1

    def _from_owners(self, unit: list[Chunk], *, wait: bool) -> None:
        """Sharded payloads: the unit's chunks from their owners, a broadcast of one chunk or
        an all-gather of a group. `wait=False` (a prefetch): the collective runs beside
        compute, waited for at the chunk's access or eviction (_arrived)."""
        if len(unit) == 1:
            chunk = unit[0]
            if not chunk.used:
                return
            payload = self.view(chunk, 0, (chunk.used,))
            work = self.owners.fetch(chunk.id, payload, wait=wait)
            fetched = payload.nbytes if chunk.remote else 0
        else:
            block = self.view(unit[0], 0, (len(unit) * self.layout.chunk_size,))
            work = self.owners.gather(unit[0].id, block, wait=wait)
            fetched = sum(c.remote for c in unit) * self.layout.chunk_bytes
        self.step_bytes += fetched
        if work is not None:
            for member in unit:
                self.inflight[member.id] = work

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, to_host: bool) -> None:
        """One copy between the tiers (on the copy stream on CUDA), timed and counted."""
        start = time.perf_counter()
        nbytes = src.numel() * src.element_size()
        if self.copy_stream is not None and dst.device != src.device:
            # after what the compute stream queued: it produced `src` or still reads `dst`
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.copy_stream)
            torch.cuda.current_stream(self.device).wait_event(event)
            if to_host:
                event.synchronize()  # the host reads it right away
        else:
            copy_payload(dst, src)
        self.stats.copy_seconds += time.perf_counter() - start
        self.stats.copy_bytes += nbytes
        if to_host:
            if dst.device != src.device:
                self.stats.bytes_to_host += nbytes
        else:
            self.stats.bytes_to_compute += nbytes
            self.step_bytes += nbytes

    def round_master(self, chunk: Chunk) -> None:
        """A fixed chunk's compute copy made again from its fp32 master (if it has one); a
        slot whose room holds its gradient keeps it."""
        if chunk.master is not None and chunk.grad_slots:
            chunk.round_into(self.chunk_view(chunk), chunk.slots_holding_grads(False))
        elif chunk.master is not None:
            self.view(chunk, 0, (chunk.used,)).copy_(chunk.master[: chunk.used])
        chunk.loaded_versions = self.versions(chunk)

    def versions(self, chunk: Chunk) -> tuple[int, ...]:
        """What the chunk's copy was made from: host version and stable parameters' versions."""
        stable = tuple(self.stable[s.name]._version for s in chunk.slots)
        if chunk.master is not None and stable != chunk.synced_versions:
            chunk.sync_host(self.stable)  # someone changed the masters: round them again
        return (chunk.host_version, *stable)

    def _stale(self, chunk: Chunk) -> bool:
        return chunk.loaded_versions != self.versions(chunk)

    # -- tensors of the arena -------------------------------------------------------------------

    def arena_ptr(self) -> int:
        return self.arena.buffer.untyped_storage().data_ptr()

    def leaf(self, chunk: Chunk, slot: ParamSlot) -> torch.Tensor:
        """A parameter's values in the arena as a tensor of its own: not an autograd view of
        the arena buffer (views of a view would route their gradient to the buffer, not to
        this leaf), and with a version counter of its own (`detach` would share the buffer's,
        which every chunk load bumps: a custom Function handing the parameter on as-is would
        then see its input "modified in place")."""
        leaf = torch.empty(0, dtype=self.layout.dtype, device=self.device)
        base = chunk.offset // self.layout.dtype.itemsize + slot.offset
        stride = torch.empty(slot.shape, device="meta").stride()
        return leaf.set_(self.arena_elements.untyped_storage(), base, slot.shape, stride)

    def view(
        self,
        chunk: Chunk,
        offset: int,
        shape: Sequence[int],
        stride: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Elements of a resident chunk's arena copy, from `offset` (elements) on."""
        base = chunk.offset // self.layout.dtype.itemsize + offset
        if stride is None:
            numel = 1
            for d in shape:
                numel *= d
            return self.arena_elements[base : base + numel].view(shape)
        return self.arena_elements.as_strided(shape, stride, base)

    def chunk_view(self, chunk: Chunk) -> torch.Tensor:
        """A resident chunk's compute-tier copy, all its elements."""
        return self.view(chunk, 0, (self.layout.chunk_size,))

    # -- invariants -----------------------------------------------------------------------------

    def _check(self, t: int) -> None:
        """The compute tier never holds more than its share: by the arena, and by a sum over
        the chunks resident on it."""
        resident = self.resident_bytes()
        in_arena = (
            self.arena.stats()["in_use"]
            - len(self.cache) * self.arena.allocator.round_up(self.unit_bytes)
            - self.reserved.bytes()
        )
        if in_arena != sum(
            self.arena.allocator.block_size(unit[0].offset)
            for unit in self.units()
            if unit[0].resident
        ):
            raise AssertionError(f"access {t}: arena bookkeeping disagrees with resident chunks")
        if resident > self.share(t):
            raise AssertionError(
                f"access {t}: {resident} bytes of chunks resident, share {self.share(t)}"
            )

    def _budget_error(self, t: int, why: str) -> ChunkBudgetError:
        pinned = [c.id for c in self.chunks if c.pins and not c.fixed]
        kept = [c.id for c in self.chunks if c.fixed]
        groups = (f" (a load brings a whole group of {self.load_unit}: mem_saving_comm=True "
                  "loads one chunk)" if self.load_unit > 1 else "")  # fmt: skip
        beside = ""
        if kept:  # their payloads count as resident chunks, their blocks come off the share
            beside = (
                f"; chunks {kept} are kept on the compute tier for good with their optimizer "
                f"state (HybridAdam), {len(kept) * self.layout.chunk_bytes:,} bytes of payloads "
                f"and {self.reserved.bytes():,} bytes reserved beside them"
            )
        return ChunkBudgetError(
            f"chunk budget exceeded at access {t} ({why}): chunks {pinned} are in use, "
            f"{self.layout.chunk_bytes:,} bytes each{groups}{beside}; the share there is "
            f"{self.share(t):,} of device_memory {self.budget or self.arena.capacity:,} bytes "
            "(less what is reserved). Use a smaller chunk_size, checkpointing, or a larger "
            "device_memory" + (", or hybrid_adam=False (nothing kept)" if kept else "") + "."
        )
