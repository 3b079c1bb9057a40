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

Copies between the tiers run on a side stream of the compute Device (runtime/device.py): a
load's copy is waited for by the current stream before anything reads or writes the block
(at once; a prefetch's at its chunk's access, or when its block is given up), a copy to the
host by the host before it returns.

The ChunkManager owns one Residency and delegates to it (composition: the resident set, the
block cache and the step's plan are state nothing else writes); the other collaborators reach
the chunks through it.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from fxstar.runtime.arena import ArenaOutOfMemory
from fxstar.runtime.chunk import Chunk, ChunkBudgetError, ChunkState
from fxstar.runtime.chunk_stats import ChunkStats
from fxstar.runtime.device import QueuedCopy
from fxstar.runtime.layout import AccessPlan, ChunkLayout, ParamSlot, blocks_at_once
from fxstar.runtime.tiers import ComputeTier
from fxstar.runtime.tracer import MemoryTracer

if TYPE_CHECKING:
    from torch import nn

__all__ = ["PREFETCH_LOOKAHEAD", "PayloadOwners", "Residency"]

PREFETCH_LOOKAHEAD = 64  # accesses a prefetch looks ahead for a chunk that is not resident
S = ChunkState


class PayloadOwners(Protocol):
    """Sharded payloads: the ranks that own the chunks and the collectives a load runs
    (data_parallel.ChunkGroups)."""

    def fetch(self, chunk_id: int, payload: torch.Tensor, *, wait: bool = True) -> object: ...

    def gather(self, first: int, block: torch.Tensor, *, wait: bool = True) -> object: ...

    def arrived(self, chunk_id: int, work: object) -> None: ...


class Residency:
    """The chunks, which of them the compute tier holds, and the step's plan it follows."""

    def __init__(
        self,
        layout: ChunkLayout,
        chunks: list[Chunk],
        stable: dict[str, nn.Parameter],
        *,
        compute: ComputeTier,
        stats: ChunkStats,
        tracer: MemoryTracer,
        budget: int | None,
        static_share: int | None,
        mem_cache: int,
        prefetch: bool,
        owners: PayloadOwners | None = None,
        load_unit: int = 1,
        staging: int = 0,
    ):
        self.layout = layout
        self.compute = compute  # the arena, and the blocks kept beside the chunks
        self.device = compute.device
        self.compute_device = compute.compute_device
        self.copy_stream = self.compute_device.new_stream()  # every copy between the tiers
        self.chunks = chunks
        self.stable = stable  # the parameters users see: their versions tell a stale copy
        self.arena = compute.arena
        self.stats = stats
        self.tracer = tracer
        self.budget = budget
        # compute-tier bytes besides chunks and activations all step (ChunkPlan.staging_bytes)
        self.staging = staging
        self.static_share = static_share
        self.cache_capacity = mem_cache
        self.prefetch = prefetch
        # sharded payloads: every load is a collective with the chunks' owners (each rank
        # makes the same choices, following one plan under one budget)
        self.owners = owners
        # chunks one load brings and one eviction drops: 1, or (sharded, ChunkPlan.load_unit)
        # a whole group in one block of its N chunks
        self.load_unit = load_unit
        self.unit_bytes = load_unit * layout.chunk_bytes
        self.inflight: dict[int, object] = {}  # chunk -> its prefetch's collective (sharded)
        self.loading: dict[int, QueuedCopy] = {}  # chunk -> its prefetch's copy in flight
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
            chunk.drop_pins()
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
        if chunk.kept:  # fp32: the stable parameters are its payload, never stale
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
        chunk.accessed(t)
        pinned = blocks_at_once({c.id for c in self.chunks if c.pins or c is chunk},
                                self.load_unit) * self.layout.chunk_bytes  # fmt: skip
        self.tracer.record(t, phase, chunk_id, self.resident_bytes(), self.share(t), pinned)
        if self.checking:
            self._check(t)
        if self.compute_device.audits_budget:
            self._audit_budget(t)
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

    @property
    def chunk_budget(self) -> int | None:
        """What chunks and activations share at every moment: the budget less the staging."""
        return None if self.budget is None else self.budget - self.staging

    def share(self, t: int) -> int:
        """Bytes chunks may hold on the compute tier at access t."""
        if self.static_share is not None:
            return self.static_share
        plan = self.plan
        nonmodel = plan.nonmodel_bytes[t] if plan is not None and t < len(plan) else 0
        budget = self.chunk_budget
        if budget is None:  # no device_memory: the arena holds every chunk
            return self.arena.capacity - self.compute.reserved_bytes()
        return min(self.arena.capacity, budget - nonmodel) - self.compute.reserved_bytes()

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
                    or any(c.pins or c.kept for c in unit)):  # fmt: skip
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
        """Wait for the prefetch of the chunk's unit (its copies, a broadcast, or its group's
        gather), if one is in flight."""
        works = {}
        for member in self.unit(chunk):
            self._copied(member)
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
            member.evicted()
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
        busy = [c.id for c in self.unit(chunk) if c.pins or c.kept]
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
            if unit[0].resident and not any(c.pins or c.kept or c.state is S.COMPUTE for c in unit):
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
            self.load(chunk, offset, S.HOLD, prefetch=True)
            self.prefetched.add(chunk.id)

    # -- copies between the tiers ---------------------------------------------------------------

    def load(
        self, chunk: Chunk, offset: int, state: ChunkState = S.COMPUTE, *, prefetch: bool = False
    ) -> None:
        """Copy the chunk's unit into the arena block at `offset`: each member's host home
        into its place (a rank's own chunks), then, with sharded payloads, what other ranks
        own from them. The other members of a group come in as prefetched (HOLD). The current
        stream waits for the copies before it returns, or, for a `prefetch`, at the chunk's
        access (or when the block is given up) where nothing else touches the block first."""
        unit = self.unit(chunk)
        versions = []
        for i, member in enumerate(unit):
            versions.append(self.versions(member))  # first: it may refresh the host copy
            member.placed(offset + i * self.layout.chunk_bytes)
            if not member.remote:
                payload = self.view(member, 0, (member.used,))
                self.loading[member.id] = self.copy(payload, member.payload[: member.used],
                                                    to_host=False)  # fmt: skip
                if not prefetch or member.grad_slots or self.owners is not None:
                    self._copied(member)  # the block is read or written right below
                if member.grad_slots:  # their host room holds gradients: masters' values
                    member.round_into(payload, member.slots_holding_grads())
        if self.owners is not None:
            self._from_owners(unit, wait=state is not S.HOLD)
        for member, loaded in zip(unit, versions, strict=True):
            member.loaded(loaded, state if member is chunk else S.HOLD)
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

    def _copied(self, chunk: Chunk) -> None:
        """The current stream waits for the chunk's load copy, if one is in flight."""
        queued = self.loading.pop(chunk.id, None)
        if queued is not None:
            self.compute_device.current_stream().wait_event(queued.done)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, to_host: bool) -> QueuedCopy:
        """One copy between the tiers on the copy stream, after what the current stream
        queued (it produced `src` or still reads `dst`), timed and counted. To the host the
        host waits for it (it reads the result right away); to the compute tier the caller
        has the current stream wait for the copy returned before it touches `dst`."""
        start = time.perf_counter()
        nbytes = src.numel() * src.element_size()
        queued = self.compute_device.copy_after(dst, src, self.copy_stream)
        if to_host:
            queued.done.synchronize()
        self.stats.copy_seconds += time.perf_counter() - start
        self.stats.copy_bytes += nbytes
        if to_host:
            self.stats.bytes_to_host += nbytes
        else:
            self.stats.bytes_to_compute += nbytes
            self.step_bytes += nbytes
        return queued

    def copy_within(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """A copy that stays on one tier (a kept chunk's gradient into its compute-tier
        buffer): on the current stream, counted with the copies."""
        start = time.perf_counter()
        self.compute_device.copy(dst, src)
        self.stats.copy_seconds += time.perf_counter() - start
        self.stats.copy_bytes += src.numel() * src.element_size()

    def round_master(self, chunk: Chunk) -> None:
        """A kept chunk's compute copy made again from its fp32 master (if it has one); a
        slot whose room holds its gradient keeps it."""
        if chunk.master is not None and chunk.grad_slots:
            chunk.round_into(self.chunk_view(chunk), chunk.slots_holding_grads(False))
        elif chunk.master is not None:
            self.view(chunk, 0, (chunk.used,)).copy_(chunk.master[: chunk.used])
        chunk.copy_current(self.versions(chunk))

    def versions(self, chunk: Chunk) -> tuple[int, ...]:
        """What the chunk's copy was made from: host version and stable parameters' versions."""
        if chunk.masters_changed(self.stable):
            chunk.sync_host(self.stable)  # someone changed the masters: round them again
        return (chunk.host_version, *(self.stable[s.name]._version for s in chunk.slots))

    def _stale(self, chunk: Chunk) -> bool:
        return chunk.loaded_versions != self.versions(chunk)

    # -- tensors of the arena -------------------------------------------------------------------

    def position(self, t: torch.Tensor) -> int | None:
        """Where in the compute tier's blocks `t` starts (bytes, as chunk offsets are), or None
        when it is not chunk memory there (see ComputeTier.position)."""
        return self.compute.position(t)

    def leaf(self, chunk: Chunk, slot: ParamSlot) -> torch.Tensor:
        """A parameter's values in the chunk's arena copy as a leaf of its own (see
        ComputeTier.leaf)."""
        return self.compute.leaf(chunk.offset, slot)

    def view(
        self,
        chunk: Chunk,
        offset: int,
        shape: Sequence[int],
        stride: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Elements of a resident chunk's arena copy, from `offset` (elements) on."""
        return self.compute.view(chunk.offset, offset, shape, stride)

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
            - self.compute.reserved_bytes()
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

    def _audit_budget(self, t: int) -> None:
        """The chunks resident, the blocks kept beside them, the activations alive now (the
        tracer's count) and the gradient staging fit the budget: the per-moment partition
        holds at this access."""
        if self.budget is None or self.static_share is not None:
            return
        chunks = self.resident_bytes() + self.compute.reserved_bytes()
        nonmodel = self.tracer.live_bytes
        if chunks + nonmodel + self.staging > self.budget:
            staged = f", {self.staging:,} of gradient staging" if self.staging else ""
            raise AssertionError(
                f"access {t}: {chunks:,} bytes of chunks and blocks kept beside them and "
                f"{nonmodel:,} bytes besides chunks{staged} exceed the budget of {self.budget:,}"
            )

    def _budget_error(self, t: int, why: str) -> ChunkBudgetError:
        pinned = [c.id for c in self.chunks if c.pins and not c.kept]
        kept = [c.id for c in self.chunks if c.kept]
        groups = (f" (a load brings a whole group of {self.load_unit}: mem_saving_comm=True "
                  "loads one chunk)" if self.load_unit > 1 else "")  # fmt: skip
        beside = ""
        if kept:  # their payloads count as resident chunks, their blocks come off the share
            beside = (
                f"; chunks {kept} are kept on the compute tier for good with their optimizer "
                f"state (HybridAdam), {len(kept) * self.layout.chunk_bytes:,} bytes of payloads "
                f"and {self.compute.reserved_bytes():,} bytes reserved beside them"
            )
        return ChunkBudgetError(
            f"chunk budget exceeded at access {t} ({why}): chunks {pinned} are in use, "
            f"{self.layout.chunk_bytes:,} bytes each{groups}{beside}; the share there is "
            f"{self.share(t):,} of device_memory {self.budget or self.arena.capacity:,} bytes "
            "(less what is reserved). Use a smaller chunk_size, checkpointing, or a larger "
            "device_memory" + (", or hybrid_adam=False (nothing kept)" if kept else "") + "."
        )
