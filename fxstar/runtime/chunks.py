"""ChunkManager: parameters live in chunks, paged between the host tier and a budgeted compute tier.

Every chunk has a home on the host tier (the master copy of its parameters, and a gradient
buffer laid out the same way). The compute tier is one arena of `device_memory` bytes (a cuda
tensor where there is a GPU, a CPU buffer elsewhere); a chunk is copied into it when the graph
or autograd needs its parameters and dropped when something needed sooner wants the room.
Every copy between the tiers is ordered by the compute Device's streams and events
(runtime/device.py: the card's, the host's, or the simulated device's the tests run on).
Nothing is decided by hooks at run time that the compiler could decide: the order of accesses
(forward, then backward as autograd will need the chunks) comes from the chunk_schedule pass,
and eviction is Belady's: drop the resident chunk whose next use is farthest away.

Autograd sees parameters through `saved_tensors_hooks`: a saved tensor that lives in the arena
is packed as a handle (chunk, offset, size, stride) and unpacked by fetching the chunk again,
possibly at a new place, so backward never reads memory that was reused meanwhile. Gradients
are added into the chunk's host gradient buffer as autograd produces them, and the stable
parameters users and optimizers see (`engine.parameters()`) are views of the host homes.

This module is the façade: it makes the host homes on the host tier, runs a step (fetch,
release, the hooks) and reports; each chunk owns its state (runtime/chunk.py), the tiers their
memory (runtime/tiers.py), and the work is done by collaborators it owns, one idea each:
`residency` (which chunks the compute tier holds: runtime/residency.py), `saved` (the
saved-tensor hooks: runtime/saved_tensors.py), `grads` (gradient accumulation and its copies:
runtime/grad_copies.py), `reservations` (HybridAdam's device half: runtime/reservations.py)
and `step_chunks`, the view of the chunks HybridAdam and the data-parallel collectives are
given (runtime/step_chunks.py).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import nn

from fxstar.runtime.arena import ArenaBuffer, PooledBlocks
from fxstar.runtime.chunk import MASTER_PART, Chunk, ChunkBudgetError, ChunkState, Home
from fxstar.runtime.chunk_stats import ChunkStats
from fxstar.runtime.data_parallel import ChunkGroups
from fxstar.runtime.device import Device, device_for
from fxstar.runtime.grad_copies import GradAccumulator
from fxstar.runtime.grad_shards import GradShards
from fxstar.runtime.layout import (
    AccessPlan,
    ChunkLayout,
    ChunkPlan,
    Observed,
    ParamSlot,
    host_parts,
)
from fxstar.runtime.monitor import MemoryMonitor
from fxstar.runtime.reservations import Reservations
from fxstar.runtime.residency import Residency
from fxstar.runtime.saved_tensors import Handle, SavedTensors
from fxstar.runtime.step_chunks import StepChunks
from fxstar.runtime.tiers import ComputeTier, HostTier
from fxstar.runtime.tracer import MemoryTracer

if TYPE_CHECKING:
    from fxstar.runtime.disk_tier import DiskTier

__all__ = [
    "Chunk",
    "ChunkBudgetError",
    "ChunkManager",
    "ChunkState",
    "ChunkStats",
    "Handle",
    "StepChunks",
]

STEP_PHASES = ["forward", "backward"]  # the order of a step's phases in an access plan
T = TypeVar("T")


def _forwarded(part: str, name: str, doc: str | None = None) -> property:
    """A façade attribute that is `self.<part>.<name>`, read and written there."""
    return property(
        lambda self: getattr(getattr(self, part), name),
        lambda self, value: setattr(getattr(self, part), name, value),
        doc=doc,
    )


def _weak_call(method: Callable[[], T]) -> Callable[[], T | None]:
    """Calls `method` while its object lives, else returns None (a sampler thread stops then)."""
    ref = weakref.WeakMethod(method)

    def call() -> T | None:
        bound = ref()
        return None if bound is None else bound()

    return call


class ChunkManager:
    def __init__(
        self,
        layout: ChunkLayout,
        params: dict[str, torch.Tensor],
        *,
        masters: dict[str, torch.Tensor] | None = None,
        budget: int | None,
        arena_capacity: int,
        device: Device | torch.device | str = "cpu",
        static_share: int | None = None,
        mem_cache: int = 2,
        prefetch: bool | None = None,
        monitor: bool = False,
        overlap_grad_copies: bool | None = None,
        grads_in_host: bool = True,
        data_parallel: ChunkGroups | None = None,
        load_unit: int = 1,
        staging: int = 0,
        disk: DiskTier | None = None,
        masters_on_disk: bool = False,
    ):
        self.layout = layout
        # the disk tier (plan.disk): HybridAdam's moments, and with `masters_on_disk` the
        # fp32 masters, which the stable parameters then view through its mappings
        self.disk = disk
        self.masters_on_disk = (disk is not None and masters_on_disk
                                and layout.dtype != torch.float32)  # fmt: skip
        self.data_parallel = data_parallel  # chunk owners and their collectives, or None
        # the streams, events and host buffers of every asynchronous copy (a torch device is
        # taken to its Device: runtime.device.using_device chooses another, as tests do)
        self.compute_device = device if isinstance(device, Device) else device_for(device)
        self.device = self.compute_device.torch_device
        self._in_forward = False
        self.stats = ChunkStats()
        self.tracer = MemoryTracer()
        self.planned_capacity = arena_capacity  # what the plan asked (the arena rounds it)
        self.arena = (PooledBlocks(arena_capacity, self.compute_device)
                      if self.compute_device.pooled_chunk_blocks
                      else ArenaBuffer(arena_capacity, self.device))  # fmt: skip
        self.compute = ComputeTier(self.arena, layout.dtype, self.compute_device)
        self._plan_source: ChunkPlan | None = None  # the ChunkPlan the current step follows
        self._observed: set[int] = set()  # id() of plans a traced step was observed for
        self._overlapped = False  # this step began before the last one's backward ran
        # copies between the tiers may run beside compute: prefetch and gradient copies pay
        asynchronous = self.compute_device.asynchronous
        self.host_tier = HostTier(self.compute_device)
        self.low_precision = layout.dtype != torch.float32
        self.homes: dict[str, torch.Tensor] = {}  # what each stable parameter is a view of
        # bf16/fp16: a chunk's gradient takes the room of its host payload (PatrickStar)
        self.grads_in_host = self.low_precision and grads_in_host
        self.sharded = data_parallel is not None and data_parallel.sharded
        if load_unit != 1 and not (self.sharded and load_unit == data_parallel.size):
            raise ValueError(
                f"load_unit {load_unit}: a load brings a whole group only with sharded "
                "data-parallel payloads, and then the group's size"
            )
        self.chunks, self.stable = self._make_homes(params, masters or params)
        self.residency = Residency(
            layout, self.chunks, self.stable, compute=self.compute,
            stats=self.stats, tracer=self.tracer, budget=budget, static_share=static_share,
            mem_cache=mem_cache, prefetch=asynchronous if prefetch is None else prefetch,
            owners=data_parallel if self.sharded else None,
            load_unit=load_unit, staging=staging,
        )  # fmt: skip
        # Gradient copies run beside backward: on the copy stream of an asynchronous device;
        # on a CPU-only machine (where the copy is a memcpy into the host buffer) on a worker
        # thread, off by default there since both cores are computing. Backward's end waits
        # for them.
        self.grads = GradAccumulator(
            self.residency,
            low_precision=self.low_precision,
            overlap=asynchronous if overlap_grad_copies is None else overlap_grad_copies,
        )
        if self.sharded:  # gradients to their owners during backward
            take = functools.partial(self.grads.take, at_once=True)
            self.grads.shards = GradShards(data_parallel, self.chunks, layout, take)
        self.saved = SavedTensors(self.residency)
        self.reservations = Reservations(self.residency, self.grads, self.homes)
        # what HybridAdam and the data-parallel collectives see of the chunks
        self.step_chunks = StepChunks(
            self.residency, self.grads, self.saved, self.reservations, owns=self.owns,
            grads_in_payload=self.grads_in_host,
        )  # fmt: skip
        if self.sharded:  # the owners take rank 0's values
            data_parallel.start_sharded(self.chunks, masters or params)
            self.masters_written()
        if self.masters_on_disk:  # what setup wrote is in the files: the host lets go
            self.disk.unmap_pages()
        self.monitor = MemoryMonitor(_weak_call(self._sample)).start() if monitor else None
        self.closed = False

    def close(self) -> None:
        """Stop the threads (monitor, gradient copies), let go of the arena and close the disk
        tier. The stable parameters get storage of their own first (or keep the mappings of
        their masters' files), so whoever holds them keeps the values."""
        if self.closed:
            return
        self.grads.wait()
        if self.monitor is not None:
            self.monitor.stop()
        self.grads.shutdown()
        with torch.no_grad():
            for name, stable in self.stable.items():
                # a master on the disk tier is a mapping, which outlives its file's name: the
                # values stay readable without a copy the host may not have room for
                if not self.masters_on_disk:
                    stable.data = stable.data.clone()
                    self.homes[name] = stable.data
                if stable.grad is not None:
                    stable.grad = stable.grad.clone()
        self.residency.close()
        if self.disk is not None:  # its files go unless the plan keeps them
            self.disk.close()
        self.closed = True

    # -- what the collaborators hold, read and set here -----------------------------------------

    # the residency's state, read and set through the façade (the engine, tests, benchmarks)
    budget = _forwarded("residency", "budget")
    static_share = _forwarded("residency", "static_share")
    checking = _forwarded("residency", "checking", "Verify the residency invariants after "
                          "every access (tests set it).")  # fmt: skip
    _plan = _forwarded("residency", "plan")
    _recorded = _forwarded("residency", "recorded")

    @property
    def reserved(self) -> list[int]:
        """Arena blocks kept beside the chunks (keep()), by offset."""
        return self.compute.reserved

    # -- setup ----------------------------------------------------------------------------------

    def _make_homes(
        self, params: dict[str, torch.Tensor], masters: dict[str, torch.Tensor]
    ) -> tuple[list[Chunk], dict[str, nn.Parameter]]:
        """Host homes for every chunk, filled from `params`; the stable parameters view them,
        or, when chunks hold bf16/fp16, fp32 master chunks filled from `masters`. A master on
        the meta device (a model built without storage) leaves its home zeroed: the engine
        writes the weights in afterwards, then calls `masters_written`.
        On the host a chunk takes what its parameters reach (aligned), not its padding: only
        `used` elements ever move, and a layout's padding is often a fifth of the chunks.
        With sharded payloads a chunk another rank owns has no host home: its parameters here
        are meta tensors of their shapes (FSDP's sharded parameters), its values the owner's."""
        lay = self.layout
        remote = {spec.id for spec in lay.chunks if self.sharded and not self.owns(spec.id)}
        parts = host_parts(lay.dtype, [0 if spec.id in remote else spec.used
                                       for spec in lay.chunks])  # fmt: skip
        size = parts[-1].stop if parts else 0
        host = self.host_tier.empty(size, lay.dtype)
        master = None
        if self.low_precision and not self.masters_on_disk:
            master = self.host_tier.empty(size, torch.float32, payload=False)
        trainable = [c.id for c in lay.chunks if c.trainable and c.id not in remote]
        if self.grads_in_host:
            grad_of = {c.id: host[part] for c, part in zip(lay.chunks, parts, strict=True)
                       if c.id in trainable}  # fmt: skip
        else:
            grad_of = self._grad_buffers(trainable)
        chunks, stable = [], {}
        for spec, part in zip(lay.chunks, parts, strict=True):
            far = spec.id in remote
            home = Home(
                self.host_tier,
                host[part],
                grad_of.get(spec.id),
                None if far or not self.low_precision
                else master[part] if master is not None else self._disk_master(spec.id, part),
                grad_in_payload=self.grads_in_host and spec.trainable and not far,
            )  # fmt: skip
            chunk = Chunk(spec.id, spec.params, home, spec.used, remote=far)
            home = chunk.fp32_home
            for slot in spec.params:
                if far:
                    view = torch.empty(slot.shape, dtype=torch.float32 if self.low_precision
                                       else home.dtype, device="meta")  # fmt: skip
                else:
                    view = home[slot.offset : slot.offset + slot.numel].view(slot.shape)
                if not far and not masters[slot.name].is_meta:
                    with torch.no_grad():
                        view.copy_(masters[slot.name])
                stable[slot.name] = nn.Parameter(view, requires_grad=slot.requires_grad)
                self.homes[slot.name] = view
            chunk.homed()
            chunks.append(chunk)
            chunk.sync_host(stable)
            if self.masters_on_disk:  # its master's pages are in the file: the host lets go
                self.disk.unmap_pages(spec.id)
        return chunks, stable

    def _disk_master(self, chunk_id: int, part: slice) -> torch.Tensor:
        """A chunk's fp32 master in a file of the disk tier, mapped: zeros until written."""
        numel = part.stop - part.start
        self.disk.add(chunk_id, MASTER_PART, numel * 4)
        return self.disk.map(chunk_id, MASTER_PART).view(torch.float32)

    def _grad_buffers(self, chunk_ids: list[int]) -> dict[int, torch.Tensor]:
        """Gradient buffers of their own for these chunks, packed in one host allocation."""
        lay = self.layout
        used = [lay.chunks[i].used for i in chunk_ids]
        parts = host_parts(lay.dtype, used)
        size = parts[-1].stop if parts else 0
        grads = self.host_tier.empty(size, lay.dtype)
        return {i: grads[part] for i, part in zip(chunk_ids, parts, strict=True)}

    def masters_written(self) -> None:
        """The stable parameters (the fp32 masters under bf16/fp16) were written from outside
        the step (weights read into their homes): every chunk's host copy follows them, the
        pages of disk-mapped masters given back a chunk at a time."""
        self.step_chunks.masters_written(self.disk.unmap_pages if self.masters_on_disk else None)

    def owns(self, chunk_id: int) -> bool:
        """This rank steps the chunk (data parallel: its owner; else every chunk)."""
        return self.data_parallel is None or self.data_parallel.owns(chunk_id)

    def host_updated(self, chunk_id: int) -> None:
        """The host copy of a chunk changed in a way torch cannot see (the C++ Adam wrote it):
        a resident compute copy is stale."""
        self.chunks[chunk_id].host_changed()

    def adopt_replaced_data(self) -> list[str]:
        """Parameters whose `.data` was replaced since the chunks took them over (`p.data =
        t`): their values go into the chunk home, the parameter views the home again, and the
        chunk counts as updated. Returns their names; a new shape or dtype cannot be adopted."""
        adopted = []
        for name, stable in self.stable.items():
            home = self.homes[name]
            if stable.data_ptr() == home.data_ptr() and stable.shape == home.shape:
                continue
            if stable.shape != home.shape or stable.dtype != home.dtype:
                raise RuntimeError(
                    f"parameter {name} was given data of shape {tuple(stable.shape)} and dtype "
                    f"{stable.dtype} after compile; its chunk holds {tuple(home.shape)} "
                    f"{home.dtype}. Compile the model again to change shapes or dtypes."
                )
            with torch.no_grad():
                home.copy_(stable.data)
            stable.data = home
            slot = self.layout.slots()[name]
            self.host_updated(slot.chunk)
            adopted.append(name)
        return adopted

    def _sample(self) -> tuple[int, int]:
        allocated = self.compute_device.memory_allocated()
        if allocated is not None:
            return self.resident_bytes(), allocated - self.arena.held_bytes()
        return self.resident_bytes(), self.tracer.live_bytes

    # -- a step ---------------------------------------------------------------------------------

    @classmethod
    def from_plan(
        cls, plan: ChunkPlan, params: dict[str, torch.Tensor], **options: object
    ) -> ChunkManager:
        """The manager a ChunkPlan decides: its layout, room and device (its Device:
        runtime.device.device_for); `options` are the run-time knobs (masters, monitor,
        overlap_grad_copies, prefetch)."""
        return cls(
            plan.layout, params, budget=plan.budget, arena_capacity=plan.arena_capacity,
            device=plan.device, static_share=plan.static_share, mem_cache=plan.mem_cache,
            load_unit=plan.load_unit, staging=plan.staging_bytes, **options,
        )  # fmt: skip

    @contextlib.contextmanager
    def running(self, plan: ChunkPlan | AccessPlan) -> Iterator[None]:
        """Around one forward: the plan it follows, and the hooks autograd saves through. A
        ChunkPlan is read as it is now: a budget or share edited since compile is honoured."""
        if isinstance(plan, ChunkPlan):
            if plan.arena_capacity != self.planned_capacity:
                raise ChunkBudgetError(
                    f"the chunk plan asks for an arena of {plan.arena_capacity:,} bytes; this "
                    f"engine's was made for {self.planned_capacity:,} and cannot change size: "
                    "compile again to change device_memory (budget and static_share may be "
                    "edited)"
                )
            self.budget, self.static_share = plan.budget, plan.static_share
            self.residency.staging = plan.staging_bytes
            self._plan_source, plan = plan, plan.access
        else:
            self._plan_source = None
        self._begin(plan)
        self._in_forward = True
        try:
            # autograd keeps the hooks with every tensor it saves: bound to the manager, they
            # keep it alive while a graph that needs it does
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._in_forward = False

    def observe(self) -> tuple[ChunkPlan, Observed | None] | None:
        """Once per compiled ChunkPlan, after the first training step that followed it: what
        the step did (its real access order, the bytes besides chunks measured at each). The
        engine makes a refined plan of it; the plan itself is never changed here. None while
        no step can be observed; (plan, None) when the step was one but its measurements do
        not fit it: with sharded payloads every rank then answers the agreement, and none
        refines."""
        plan = self._plan_source
        if plan is None or plan.observed is not None or id(plan) in self._observed:
            return None
        # one forward, then its backward, as many accesses of each as planned; not begun
        # while an earlier forward's graph was still alive (its activations were measured too).
        # Both follow from the sequence of forwards and backwards, which every data-parallel
        # rank runs alike (the step headers hold them to it, runtime/step_check.py)
        recorded = self.residency.recorded
        phases = [phase for _, phase in recorded]
        if self._overlapped or phases != sorted(plan.access.phases, key=STEP_PHASES.index):
            return None
        self._observed.add(id(plan))
        measured = self.tracer.nonmodel_by_access()
        if len(measured) != len(recorded):
            return plan, None
        chunks, phases = zip(*recorded, strict=True)
        return plan, Observed(tuple(chunks), tuple(phases), tuple(measured))

    def _begin(self, plan: AccessPlan) -> None:
        self.grads.wait()  # a backward that raised left its copies behind
        phases = {phase for _, phase in self.residency.recorded}
        self._overlapped = phases == {"forward"}  # the last forward's backward has not run
        self.saved.unpin_all()
        self.residency.begin_step(plan)

    def _pack(self, t: torch.Tensor) -> object:
        return self.saved.pack(t)

    def _unpack(self, packed: object) -> torch.Tensor:
        return self.saved.unpack(packed)

    # -- accesses -------------------------------------------------------------------------------

    def fetch(self, chunk_id: int) -> dict[str, torch.Tensor]:
        """The chunk's parameters as leaves of this step's autograd graph (in forward; in
        backward when a checkpointed region recomputes)."""
        if self._in_forward:
            chunk = self.residency.access(chunk_id, "forward")
        else:
            chunk = self.saved.access_in_recomputation(chunk_id)
        chunk.pin()
        grad = torch.is_grad_enabled()
        views = {}
        for slot in chunk.slots:
            if chunk.kept and slot.name in chunk.grad_slots:  # its room holds its gradient
                view = chunk.rounded(slot.offset, slot.shape, self.layout.dtype)
            else:
                view = self.residency.leaf(chunk, slot)
            if grad and slot.requires_grad:
                view.requires_grad_(True)
                view.register_post_accumulate_grad_hook(self.grads.hook(slot))
                if self.grads.shards is not None:  # its unit waits for this gradient
                    self.grads.shards.expect(chunk_id)
            for alias in slot.aliases:
                views[alias] = view
        return views

    def release(self, chunk_id: int) -> None:
        """Forward is done with the chunk (every alias of its parameters): evictable. In a
        recomputation the chunk stays pinned (see fetch)."""
        if not self._in_forward:
            return
        self.chunks[chunk_id].unpin(ChunkState.HOLD_AFTER_FWD)

    # -- delegated to the collaborators ---------------------------------------------------------

    def share(self, t: int) -> int:
        """Bytes chunks may hold on the compute tier at access t."""
        return self.residency.share(t)

    def resident_bytes(self) -> int:
        return self.residency.resident_bytes()

    def chunk_view(self, chunk: Chunk) -> torch.Tensor:
        """A resident chunk's compute-tier copy, all its elements."""
        return self.residency.chunk_view(chunk)

    def version_token(self) -> tuple[int, int]:
        """Changes whenever any parameter's values do (a recomputation's staleness check)."""
        return self.saved.version_token()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.grads.zero_grad(set_to_none)

    def slot_grad(self, slot: ParamSlot) -> torch.Tensor | None:
        """This step's gradient of a parameter, or None when it got none."""
        return self.grads.slot_grad(slot)

    def grad_view(self, slot: ParamSlot) -> torch.Tensor:
        return self.grads.grad_view(slot)

    def grad_copy_overlap(self) -> float | None:
        """The share of gradient copy time hidden behind backward, None before any copy."""
        return self.grads.overlap_share()

    def reserved_bytes(self) -> int:
        return self.reservations.reserved_bytes()

    def keep(self, chunk_id: int, *, share_room: bool = False,
            beside: Sequence[torch.Tensor] = ()) -> None:  # fmt: skip
        """Keep a chunk on the compute tier for good (see Reservations.keep)."""
        self.reservations.keep(chunk_id, share_room=share_room, beside=beside)

    def give_back(self, chunk_id: int) -> None:
        """A kept chunk back to the host tier, its blocks freed (see Reservations.give_back).
        Between steps: what the last backward left (copies in flight, its last node's pins)
        ends first, as at the start of a step."""
        self.step_chunks.give_back(chunk_id)

    def kept_bytes(self) -> int:
        """Compute-tier bytes the chunks kept there for good hold, with their blocks."""
        return self.reservations.kept_bytes()

    def compute_updated(self, chunk_id: int) -> None:
        """The optimizer wrote a kept chunk's compute copy (and master) itself."""
        self.step_chunks.stepped(self.chunks[chunk_id])

    # -- what users see -------------------------------------------------------------------------

    def report(self) -> str:
        lay, st, arena = self.layout, self.stats, self.arena.stats()
        steps = max(st.training_steps, 1)
        current = any(phase == "backward" for _, phase in self.residency.recorded)
        step_bytes = self.residency.step_bytes
        moved = step_bytes if current or not st.per_step_bytes else st.per_step_bytes[-1]
        on_host = [c for c in self.chunks if not c.kept]
        lines = [
            f"chunks: {len(lay.chunks)} x {lay.chunk_bytes:,} bytes ({lay.chunk_size:,} "
            f"{str(lay.dtype).split('.')[-1]}), {lay.wasted_bytes:,} bytes unused",
            f"compute tier ({self.device}): budget "
            + ("none (every chunk resident)" if self.budget is None else f"{self.budget:,}")
            + f", arena {arena['capacity']:,}, "
            f"peak chunks {arena['peak_in_use']:,}, now {self.resident_bytes():,}",
            f"host tier: {sum(c.payload.nbytes for c in on_host):,} parameter and "
            f"{sum(c.grad.nbytes for c in on_host if c.grad is not None):,} "
            "gradient bytes (the chunks' padding left out"
            + ("; the gradients in the parameters' room)" if self.grads_in_host else ")"),
            f"moved host->compute: {moved:,} bytes in the last training step "
            f"({moved / max(lay.param_bytes, 1):.2f}x the parameter bytes; "
            f"{st.moved_bytes_total / steps:,.0f} per step on average)",
            f"evictions {st.evictions}, loads {st.loads}, prefetch hits {st.prefetch_hits}, "
            f"cache hits {st.cache_hits}, time in copies {st.copy_seconds:.3f}s",
        ]
        gbps = st.copy_gbps()
        if gbps is not None:
            lines.append(
                f"chunk moves and gradient copies: {st.copy_bytes:,} bytes at {gbps:.1f} GB/s"
            )
        share = st.grad_copy_share()
        if share is not None:
            per_step = st.training_grad_copy_seconds / max(st.training_steps, 1)
            lines.append(
                f"gradient copies into the chunks' buffers: {per_step * 1e3:.1f} ms a training "
                f"step, {share:.1%} of its wall time"
            )
        overlap = self.grad_copy_overlap()
        if overlap is not None:
            lines.append(
                f"gradient copies: {st.grad_copy_seconds:.3f}s, {overlap:.0%} hidden behind "
                f"backward ({st.grad_wait_seconds:.3f}s waited at its end)"
            )
        kept = [c for c in self.chunks if c.kept and not c.remote]
        if kept:
            room = "; the gradients in the payloads' room" if kept[0].grads_in_payload else ""
            lines.append(
                f"kept on the compute tier with their optimizer state: {len(kept)} chunks "
                f"({self.reserved_bytes():,} bytes beside their payloads{room}; "
                f"{self.reservations.released_bytes:,} bytes of their host homes given back)"
            )
        if self.data_parallel is not None:
            lines.append(self.data_parallel.describe(kept=sum(c.kept for c in self.chunks)))
        if self.monitor is not None:
            lines.append(
                f"memory monitor: {len(self.monitor.samples):,} samples, peak "
                f"{self.monitor.peak:,} bytes (chunks + activations)"
            )
        if self.device.type == "cpu":
            lines.append(
                "activations live in ordinary memory on this CPU-only machine; the tracer "
                f"counts them (peak {self.tracer.peak_nonmodel:,} bytes saved for backward)"
            )
        return "\n".join(lines)
