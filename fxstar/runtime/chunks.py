"""ChunkManager: parameters live in chunks, paged between the host tier and a budgeted compute tier.

Every chunk has a home on the host tier (the master copy of its parameters, and a gradient
buffer laid out the same way). The compute tier is one arena of `device_memory` bytes (a cuda
tensor where there is a GPU, a CPU buffer elsewhere); a chunk is copied into it when the graph
or autograd needs its parameters and dropped when something needed sooner wants the room.
Nothing is decided by hooks at run time that the compiler could decide: the order of accesses
(forward, then backward as autograd will need the chunks) comes from the chunk_schedule pass,
and eviction is Belady's: drop the resident chunk whose next use is farthest away.

Autograd sees parameters through `saved_tensors_hooks`: a saved tensor that lives in the arena
is packed as a handle (chunk, offset, size, stride) and unpacked by fetching the chunk again,
possibly at a new place, so backward never reads memory that was reused meanwhile. Gradients
are added into the chunk's host gradient buffer as autograd produces them, and the stable
parameters users and optimizers see (`engine.parameters()`) are views of the host homes.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import contextlib
import enum
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from fxstar.errors import FxstarError
from fxstar.runtime.arena import ArenaBuffer, ArenaOutOfMemory
from fxstar.runtime.host import host_empty
from fxstar.runtime.layout import AccessPlan, ChunkLayout, ChunkPlan, Observed, ParamSlot
from fxstar.runtime.monitor import MemoryMonitor
from fxstar.runtime.tracer import MemoryTracer

PHASES = ["forward", "backward"]
RECENT_STEPS = 1000  # training steps whose moved bytes ChunkStats keeps one by one


def _weak_call(method):
    """Calls `method` while its object lives, else returns None (a sampler thread stops then)."""
    ref = weakref.WeakMethod(method)

    def call():
        bound = ref()
        return None if bound is None else bound()

    return call


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
    host: torch.Tensor  # chunk_size elements on the host tier: what the compute tier copies
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

    def move(self, new: ChunkState) -> None:
        if new not in LEGAL[self.state]:
            raise RuntimeError(
                f"chunk {self.id}: illegal state change {self.state.value} -> {new.value}"
            )
        self.state = new

    @property
    def resident(self) -> bool:
        return self.state in RESIDENT


@dataclass
class ChunkStats:
    loads: int = 0  # host -> compute copies
    bytes_to_compute: int = 0
    bytes_to_host: int = 0  # gradients crossing back (cuda)
    evictions: int = 0
    prefetch_hits: int = 0
    cache_hits: int = 0
    unexpected_accesses: int = 0
    copy_seconds: float = 0.0
    grad_copy_seconds: float = 0.0  # gradient copies to their buffers, however they ran
    grad_wait_seconds: float = 0.0  # of that, what backward's end still had to wait for
    steps: int = 0
    # bytes moved host->compute by the most recent training steps (bounded), and over all
    per_step_bytes: collections.deque[int] = field(
        default_factory=lambda: collections.deque(maxlen=RECENT_STEPS)
    )
    moved_bytes_total: int = 0
    training_steps: int = 0

    def end_step(self, moved: int) -> None:
        self.per_step_bytes.append(moved)
        self.moved_bytes_total += moved
        self.training_steps += 1


@dataclass(frozen=True)
class Handle:
    """A saved arena tensor, by where its values live rather than by its address."""

    chunk: int
    offset: int  # elements from the chunk's start
    size: tuple[int, ...]
    stride: tuple[int, ...]
    version: tuple[int, ...] = ()  # the chunk's content version when saved


class ChunkManager:
    def __init__(
        self,
        layout: ChunkLayout,
        params: dict[str, torch.Tensor],
        *,
        masters: dict[str, torch.Tensor] | None = None,
        budget: int | None,
        arena_capacity: int,
        device: torch.device | str = "cpu",
        static_share: int | None = None,
        mem_cache: int = 2,
        prefetch: bool | None = None,
        monitor: bool = False,
        overlap_grad_copies: bool | None = None,
    ):
        self.layout = layout
        self.device = torch.device(device)
        self.budget = budget
        self.static_share = static_share
        self.cache_capacity = mem_cache
        self.prefetch = self.device.type == "cuda" if prefetch is None else prefetch
        self.checking = False  # verify the residency invariants after every access (tests)
        self._in_forward = False
        self.stats = ChunkStats()
        self.tracer = MemoryTracer()
        self.planned_capacity = arena_capacity  # what the plan asked (the arena rounds it)
        self.arena = ArenaBuffer(arena_capacity, self.device)
        self.arena_elements = self.arena.buffer.view(layout.dtype)
        self._cache: list[int] = []  # freed chunk blocks kept for reuse (mem_cache)
        self._plan: AccessPlan | None = None
        self._positions: dict[int, list[int]] = {}
        self._cursor = 0
        self._node_pins: tuple[object | None, list[Chunk]] = (None, [])
        self._recompute_pins: tuple[object | None, list[Chunk]] = (None, [])
        self._recorded: list[tuple[int, str]] = []
        self._plan_source: ChunkPlan | None = None  # the ChunkPlan the current step follows
        self._observed: set[int] = set()  # id() of plans a traced step was observed for
        self._overlapped = False  # this step began before the last one's backward ran
        self._step_bytes = 0
        self.reserved: list[int] = []  # arena blocks beside the chunks (fix()), by offset
        pin = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if pin else None
        # Gradient copies run beside backward: on the copy stream on CUDA; on a CPU-only
        # machine (where the copy is a memcpy into the host buffer) on a worker thread, off by
        # default there since both cores are computing. Backward's end waits for them.
        self.overlap_grad_copies = pin if overlap_grad_copies is None else overlap_grad_copies
        self._pending: list[object] = []  # CUDA events or futures of copies in flight
        self._copier: concurrent.futures.ThreadPoolExecutor | None = None
        self._wait_queued = False
        self.low_precision = layout.dtype != torch.float32
        self.grad_present: set[str] = set()  # slots given a gradient since the last zero_grad
        self.homes: dict[str, torch.Tensor] = {}  # what each stable parameter is a view of
        self.chunks, self.stable = self._make_homes(params, masters or params, pin)
        self.monitor = MemoryMonitor(_weak_call(self._sample)).start() if monitor else None
        self.closed = False

    def close(self) -> None:
        """Stop the threads (monitor, gradient copies) and let go of the arena. The stable
        parameters get storage of their own first, so whoever holds them keeps the values."""
        if self.closed:
            return
        self._wait_grad_copies()
        if self.monitor is not None:
            self.monitor.stop()
        if self._copier is not None:
            self._copier.shutdown(wait=True)
            self._copier = None
        with torch.no_grad():
            for name, stable in self.stable.items():
                stable.data = stable.data.clone()
                self.homes[name] = stable.data
                if stable.grad is not None:
                    stable.grad = stable.grad.clone()
        self._cache.clear()
        self.closed = True

    # -- setup ----------------------------------------------------------------------------------

    def _make_homes(
        self, params: dict[str, torch.Tensor], masters: dict[str, torch.Tensor], pin: bool
    ) -> tuple[list[Chunk], dict[str, nn.Parameter]]:
        """Host homes for every chunk, filled from `params`; the stable parameters view them,
        or, when chunks hold bf16/fp16, fp32 master chunks filled from `masters`."""
        lay = self.layout
        n = lay.chunk_size
        count = len(lay.chunks)
        host = host_empty(count * lay.chunk_bytes, zero=True, pin=pin).view(lay.dtype)
        master = None
        if self.low_precision:
            master = host_empty(count * n * 4, zero=True).view(torch.float32)
        trainable = [c for c in lay.chunks if c.trainable]
        grads = host_empty(len(trainable) * lay.chunk_bytes, zero=True, pin=pin).view(lay.dtype)
        grad_of = {c.id: grads[i * n : (i + 1) * n] for i, c in enumerate(trainable)}
        chunks, stable = [], {}
        for spec in lay.chunks:
            part = slice(spec.id * n, (spec.id + 1) * n)
            chunk = Chunk(spec.id, spec.params, host[part], grad_of.get(spec.id), spec.used,
                          master[part] if master is not None else None)  # fmt: skip
            home = chunk.master if chunk.master is not None else chunk.host
            for slot in spec.params:
                view = home[slot.offset : slot.offset + slot.numel].view(slot.shape)
                with torch.no_grad():
                    view.copy_(masters[slot.name])
                stable[slot.name] = nn.Parameter(view, requires_grad=slot.requires_grad)
                self.homes[slot.name] = view
            chunk.move(S.RELEASED)
            chunks.append(chunk)
        for chunk in chunks:
            self._sync_host(chunk, stable)
        return chunks, stable

    def _sync_host(self, chunk: Chunk, stable: dict[str, nn.Parameter] | None = None) -> None:
        """Round the fp32 masters into the chunk's low-precision host copy."""
        if chunk.master is None or chunk.fixed:  # a fixed chunk's copy is on the compute tier
            return
        stable = self.stable if stable is None else stable
        chunk.host[: chunk.used].copy_(chunk.master[: chunk.used])
        chunk.synced_versions = tuple(stable[s.name]._version for s in chunk.slots)
        chunk.host_version += 1

    def host_updated(self, chunk_id: int) -> None:
        """The host copy of a chunk changed in a way torch cannot see (the C++ Adam wrote it):
        a resident compute copy is stale."""
        chunk = self.chunks[chunk_id]
        chunk.host_version += 1
        chunk.updates += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._wait_grad_copies()  # a copy in flight would land after the zeroing
        self.grad_present.clear()
        for p in self.stable.values():
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

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

    def slot_grad(self, slot: ParamSlot) -> torch.Tensor | None:
        """This step's gradient of a parameter, or None when it got none."""
        if self.low_precision:
            return self.grad_view(slot) if slot.name in self.grad_present else None
        return self.stable[slot.name].grad

    def _sample(self) -> tuple[int, int]:
        if self.device.type == "cuda":
            allocated = torch.cuda.memory_allocated(self.device)
            return self.resident_bytes(), allocated - self.arena.capacity
        return self.resident_bytes(), self.tracer.live_bytes

    def grad_view(self, slot: ParamSlot) -> torch.Tensor:
        host_grad = self.chunks[slot.chunk].host_grad
        return host_grad[slot.offset : slot.offset + slot.numel].view(slot.shape)

    # -- a step ---------------------------------------------------------------------------------

    @classmethod
    def from_plan(
        cls, plan: ChunkPlan, params: dict[str, torch.Tensor], **options: object
    ) -> ChunkManager:
        """The manager a ChunkPlan decides: its layout, room and device; `options` are the
        run-time knobs (masters, monitor, overlap_grad_copies, prefetch)."""
        return cls(
            plan.layout, params, budget=plan.budget, arena_capacity=plan.arena_capacity,
            device=plan.device, static_share=plan.static_share, mem_cache=plan.mem_cache,
            **options,
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
            self._plan_source, plan = plan, plan.access
        else:
            self._plan_source = None
        self._begin(plan)
        self._in_forward = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._in_forward = False

    def observe(self) -> tuple[ChunkPlan, Observed] | None:
        """Once per compiled ChunkPlan, after the first training step that followed it: what
        the step did (its real access order, the bytes besides chunks measured at each). The
        engine makes a refined plan of it; the plan itself is never changed here."""
        plan = self._plan_source
        if plan is None or plan.observed is not None or id(plan) in self._observed:
            return None
        # one forward, then its backward, as many accesses of each as planned; not begun
        # while an earlier forward's graph was still alive (its activations were measured too)
        phases = [phase for _, phase in self._recorded]
        if self._overlapped or phases != sorted(plan.access.phases, key=PHASES.index):
            return None
        self._observed.add(id(plan))
        measured = self.tracer.nonmodel_by_access()
        if len(measured) != len(self._recorded):
            return None
        chunks, phases = zip(*self._recorded, strict=True)
        return plan, Observed(tuple(chunks), tuple(phases), tuple(measured))

    def _begin(self, plan: AccessPlan) -> None:
        self._wait_grad_copies()  # a backward that raised left its copies behind
        phases = {phase for _, phase in self._recorded}
        self._overlapped = phases == {"forward"}  # the last forward's backward has not run
        self._unpin_node()
        self._unpin(self._recompute_pins[1])
        self._recompute_pins = (None, [])
        for chunk in self.chunks:  # pins left by an abandoned step
            if chunk.state is S.COMPUTE:
                chunk.pins = 0
                chunk.move(S.HOLD_AFTER_FWD)
        if any(phase == "backward" for _, phase in self._recorded):  # a training step ended
            self.stats.end_step(self._step_bytes)
        self._step_bytes = 0
        self.stats.steps += 1
        self._plan = plan
        self._positions = {}
        for i, c in enumerate(plan.chunks):
            self._positions.setdefault(c, []).append(i)
        self._cursor = 0
        self._recorded = []
        self.tracer.begin_step()

    # -- accesses -------------------------------------------------------------------------------

    def fetch(self, chunk_id: int) -> dict[str, torch.Tensor]:
        """The chunk's parameters as leaves of this step's autograd graph (in forward; in
        backward when a checkpointed region recomputes)."""
        if self._in_forward:
            chunk = self._access(chunk_id, "forward")
        else:
            # A recomputation saves what backward needs as plain tensors, not through the
            # hooks: every chunk it fetched stays pinned until backward moves on to another
            # node (the region's gradients are done), whatever its release nodes say.
            node = torch._C._current_autograd_node()
            if node is not self._node_pins[0]:
                self._unpin_node()  # the node that unpacked them is done
            if node is not self._recompute_pins[0]:
                self._unpin(self._recompute_pins[1])
                self._recompute_pins = (node, [])
            chunk = self._access(chunk_id, "backward")
            self._recompute_pins[1].append(chunk)
        chunk.pins += 1
        grad = torch.is_grad_enabled()
        views = {}
        for slot in chunk.slots:
            view = self._leaf(chunk, slot)
            if grad and slot.requires_grad:
                view.requires_grad_(True)
                view.register_post_accumulate_grad_hook(self._accumulate(slot))
            for alias in slot.aliases:
                views[alias] = view
        return views

    def release(self, chunk_id: int) -> None:
        """Forward is done with the chunk (every alias of its parameters): evictable. In a
        recomputation the chunk stays pinned (see fetch)."""
        if not self._in_forward:
            return
        chunk = self.chunks[chunk_id]
        chunk.pins -= 1
        if chunk.pins == 0:
            chunk.move(S.HOLD_AFTER_FWD)

    def _access(self, chunk_id: int, phase: str) -> Chunk:
        t = self._advance(chunk_id)
        self._recorded.append((chunk_id, phase))
        chunk = self.chunks[chunk_id]
        if chunk.fixed:  # fp32: the stable parameters are its payload, never stale
            if chunk.master is not None and self._stale(chunk):
                self._round_master(chunk)  # someone changed the masters on the compute tier
        elif chunk.resident and chunk.pins == 0 and self._stale(chunk):
            self._evict(chunk, count=False)  # the host copy changed (an optimizer step)
        if chunk.state is S.HOLD:
            self.stats.prefetch_hits += 1
        self._make_room(t, chunk)
        if chunk.state is not S.COMPUTE:
            chunk.move(S.COMPUTE)
        chunk.last_access = t
        pinned = sum(self.layout.chunk_bytes for c in self.chunks if c.pins or c is chunk)
        self.tracer.record(t, phase, chunk_id, self.resident_bytes(), self.share(t), pinned)
        if self.checking:
            self._check(t)
        if self.prefetch:
            self._prefetch_after(t)
        return chunk

    def _advance(self, chunk_id: int) -> int:
        """The position of this access in the plan; unplanned accesses do not move it."""
        positions = self._positions.get(chunk_id, [])
        i = bisect.bisect_left(positions, self._cursor)
        if i == len(positions):
            self.stats.unexpected_accesses += 1
            return min(self._cursor, max(len(self._plan) - 1, 0))
        self._cursor = positions[i] + 1
        return positions[i]

    def _leaf(self, chunk: Chunk, slot: ParamSlot) -> torch.Tensor:
        """A parameter's values in the arena as a tensor of its own: not an autograd view of
        the arena buffer (views of a view would route their gradient to the buffer, not to
        this leaf), and with a version counter of its own (`detach` would share the buffer's,
        which every chunk load bumps: a custom Function handing the parameter on as-is would
        then see its input "modified in place")."""
        leaf = torch.empty(0, dtype=self.layout.dtype, device=self.device)
        base = chunk.offset // self.layout.dtype.itemsize + slot.offset
        stride = torch.empty(slot.shape, device="meta").stride()
        return leaf.set_(self.arena_elements.untyped_storage(), base, slot.shape, stride)

    def _view(self, chunk: Chunk, offset: int, shape, stride=None) -> torch.Tensor:
        base = chunk.offset // self.layout.dtype.itemsize + offset
        if stride is None:
            numel = 1
            for d in shape:
                numel *= d
            return self.arena_elements[base : base + numel].view(shape)
        return self.arena_elements.as_strided(shape, stride, base)

    # -- autograd -------------------------------------------------------------------------------

    def _pack(self, t: torch.Tensor):
        if t.device == self.device and t.untyped_storage().data_ptr() == self._arena_ptr():
            if t.dtype != self.layout.dtype:
                raise RuntimeError(f"a saved {t.dtype} view of {self.layout.dtype} chunk memory")
            byte = t.storage_offset() * t.element_size()
            for chunk in self.chunks:
                if chunk.resident and chunk.offset <= byte < chunk.offset + self.layout.chunk_bytes:
                    offset = (byte - chunk.offset) // t.element_size()
                    return Handle(chunk.id, offset, tuple(t.shape), tuple(t.stride()),
                                  self._content_version(chunk))  # fmt: skip
            raise RuntimeError("a saved arena tensor belongs to no resident chunk")
        return self.tracer.saved(t)

    def _unpack(self, packed):
        if not isinstance(packed, Handle):
            return self.tracer.unpacked(packed)
        node = torch._C._current_autograd_node()
        if node is not self._node_pins[0]:
            self._unpin_node()
            self._node_pins = (node, [])
        if node is not self._recompute_pins[0]:
            self._unpin(self._recompute_pins[1])
            self._recompute_pins = (None, [])
        chunk = self.chunks[packed.chunk]
        if self._content_version(chunk) != packed.version:  # before anything is fetched
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: parameters of chunk {chunk.id} "
                f"({', '.join(s.name for s in chunk.slots)}) changed after the forward that "
                "saved them (an optimizer step, or an in-place edit, between this loss's "
                "forward and its backward). Call backward before engine.step(), or run the "
                "forward again."
            )
        chunk = self._access(packed.chunk, "backward")
        chunk.pins += 1
        self._node_pins[1].append(chunk)
        return self._view(chunk, packed.offset, packed.size, packed.stride)

    def _content_version(self, chunk: Chunk) -> tuple[int, ...]:
        """Changes whenever the chunk's parameter values do: optimizer updates, in-place edits."""
        return (chunk.updates, *(self.stable[s.name]._version for s in chunk.slots))

    def version_token(self) -> tuple[int, int]:
        """Changes whenever any parameter's values do (a recomputation's staleness check)."""
        return (
            sum(c.updates for c in self.chunks),
            sum(p._version for p in self.stable.values()),
        )

    def _unpin_node(self) -> None:
        """The backward node that unpacked these chunks is done: they are evictable again."""
        self._unpin(self._node_pins[1])
        self._node_pins = (None, [])

    @staticmethod
    def _unpin(chunks: list[Chunk]) -> None:
        for chunk in chunks:
            chunk.pins -= 1
            if chunk.pins == 0:
                chunk.move(S.HOLD_AFTER_BWD)

    def _accumulate(self, slot: ParamSlot):
        # a weak reference: the hook lives on a tensor that C++ keeps alive, and a strong one
        # would keep the whole manager (arena, host chunks, moments) past its engine
        manager = weakref.ref(self)

        def hook(leaf: torch.Tensor) -> None:
            grad, leaf.grad = leaf.grad, None
            self = manager()
            if self is not None:
                self._add_grad(slot, grad)

        return hook

    def _add_grad(self, slot: ParamSlot, grad: torch.Tensor) -> None:
        stable = self.stable[slot.name]
        if self.low_precision:  # in the chunk's own dtype; the masters have no .grad
            if slot.name in self.grad_present:
                self._wait_grad_copies()
                buffer = self.grad_view(slot)
                buffer.add_(grad.to(buffer.device))
            else:
                self._copy_grad(self.grad_view(slot), grad)
                self.grad_present.add(slot.name)
        elif stable.grad is None:
            buffer = self.grad_view(slot)
            self._copy_grad(buffer, grad)  # a copy: bitwise what eager stores
            stable.grad = buffer
        else:
            self._wait_grad_copies()
            stable.grad.add_(grad.to(stable.grad.device))

    def _copy_grad(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """A gradient into its buffer: at once, or beside the rest of backward (overlap)."""
        if not self.overlap_grad_copies or dst.device == src.device != torch.device("cpu"):
            start = time.perf_counter()
            self._copy(dst, src, to_host=True)
            self.stats.grad_copy_seconds += time.perf_counter() - start
            return
        if not self._wait_queued:  # backward's end waits for every copy in flight
            torch.autograd.Variable._execution_engine.queue_callback(self._wait_grad_copies)
            self._wait_queued = True
        if self.copy_stream is not None:
            self._pending.append(self._copy_on_stream(dst, src))
            if dst.device != src.device:
                self.stats.bytes_to_host += src.numel() * src.element_size()
            return
        if self._copier is None:
            self._copier = concurrent.futures.ThreadPoolExecutor(1, "fxstar-grad-copies")
        self._pending.append(self._copier.submit(self._timed_copy, dst, src))

    def _timed_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        start = time.perf_counter()
        dst.copy_(src)
        self.stats.grad_copy_seconds += time.perf_counter() - start

    def _copy_on_stream(self, dst: torch.Tensor, src: torch.Tensor):
        """Queue a copy on the copy stream after what the compute stream has queued (which
        produced `src`); `src` stays allocated until the copy ran."""
        stream = self.copy_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
        src.record_stream(stream)
        return start, end

    def _wait_grad_copies(self) -> None:
        """Block until every gradient copy in flight is done; time what was not hidden."""
        self._wait_queued = False
        if not self._pending:
            return
        start = time.perf_counter()
        for item in self._pending:
            if isinstance(item, concurrent.futures.Future):
                item.result()
            else:
                item[1].synchronize()
                self.stats.grad_copy_seconds += item[0].elapsed_time(item[1]) / 1e3
        if self.copy_stream is not None:  # later kernels may read what arrived
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
        self._pending.clear()
        self.stats.grad_wait_seconds += time.perf_counter() - start

    def grad_copy_overlap(self) -> float | None:
        """The share of gradient copy time hidden behind backward, None before any copy."""
        st = self.stats
        if not self.overlap_grad_copies or st.grad_copy_seconds == 0:
            return None
        return max(0.0, 1.0 - st.grad_wait_seconds / st.grad_copy_seconds)

    # -- residency ------------------------------------------------------------------------------

    def share(self, t: int) -> int:
        """Bytes chunks may hold on the compute tier at access t."""
        if self.static_share is not None:
            return self.static_share
        plan = self._plan
        nonmodel = plan.nonmodel_bytes[t] if plan is not None and t < len(plan) else 0
        if self.budget is None:  # no device_memory: the arena holds every chunk
            return self.arena.capacity - self.reserved_bytes()
        return min(self.arena.capacity, self.budget - nonmodel) - self.reserved_bytes()

    def resident_bytes(self) -> int:
        return sum(self.layout.chunk_bytes for c in self.chunks if c.resident)

    def _make_room(self, t: int, chunk: Chunk) -> None:
        """Evict until the chunks resident with `chunk` fit the share at access t (which may
        have shrunk since the last access: activations grow), then load `chunk` if needed."""
        need = 0 if chunk.resident else self.layout.chunk_bytes
        while self.resident_bytes() + need > self.share(t):
            self._evict_one(t, chunk, "every other resident chunk is in use")
        if chunk.resident:
            return
        while (offset := self._take_block()) is None:
            self._evict_one(t, chunk, "the arena has no block left")
        self._load(chunk, offset)

    def _take_block(self) -> int | None:
        """A block for one chunk: a cached one (mem_cache), else a new one from the arena."""
        if self._cache:
            self.stats.cache_hits += 1
            return self._cache.pop()
        try:
            return self.arena.alloc(self.layout.chunk_bytes)
        except ArenaOutOfMemory:
            return None

    def _evict_one(self, t: int, keep: Chunk, why: str) -> None:
        victim = self._victim(t, keep)
        if victim is None:
            raise self._budget_error(t, why)
        self._evict(victim)

    def _victim(self, t: int, keep: Chunk) -> Chunk | None:
        """Belady: the unpinned resident chunk used again farthest in the future."""
        best, best_key = None, None
        n = len(self._plan) if self._plan is not None else 0
        for chunk in self.chunks:
            if not chunk.resident or chunk.pins or chunk.fixed or chunk is keep:
                continue
            positions = self._positions.get(chunk.id, [])
            i = bisect.bisect_right(positions, t)
            if i < len(positions):
                nxt = positions[i]
            elif positions:
                nxt = n + positions[0]  # the next step's access
            else:
                nxt = 2 * n + 1
            key = (nxt, -chunk.last_access)
            if best_key is None or key > best_key:
                best, best_key = chunk, key
        return best

    def _evict(self, chunk: Chunk, count: bool = True) -> None:
        # the host holds the master copy: dropping a compute copy moves no bytes
        chunk.move(S.RELEASED)
        if len(self._cache) < self.cache_capacity:
            self._cache.append(chunk.offset)
        else:
            self.arena.free(chunk.offset)
        chunk.offset = None
        if count:
            self.stats.evictions += 1

    def _load(self, chunk: Chunk, offset: int, state: ChunkState = S.COMPUTE) -> None:
        versions = self._versions(chunk)  # first: it may refresh the host copy from masters
        chunk.offset = offset
        self._copy(self._view(chunk, 0, (chunk.used,)), chunk.host[: chunk.used], to_host=False)
        chunk.loaded_versions = versions
        chunk.move(state)
        self.stats.loads += 1

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, *, to_host: bool) -> None:
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
            dst.copy_(src)
        self.stats.copy_seconds += time.perf_counter() - start
        if to_host:
            if dst.device != src.device:
                self.stats.bytes_to_host += nbytes
        else:
            self.stats.bytes_to_compute += nbytes
            self._step_bytes += nbytes

    def _prefetch_after(self, t: int) -> None:
        """Start copying the next planned chunk if there is room without evicting anything."""
        plan = self._plan
        if plan is None or t + 1 >= len(plan):
            return
        chunk = self.chunks[plan.chunks[t + 1]]
        if chunk.resident or self.resident_bytes() + self.layout.chunk_bytes > self.share(t + 1):
            return
        offset = self._take_block()
        if offset is not None:
            self._load(chunk, offset, S.HOLD)

    def _versions(self, chunk: Chunk) -> tuple[int, ...]:
        stable = tuple(self.stable[s.name]._version for s in chunk.slots)
        if chunk.master is not None and stable != chunk.synced_versions:
            self._sync_host(chunk)  # someone changed the masters: round them again
        return (chunk.host_version, *stable)

    def _stale(self, chunk: Chunk) -> bool:
        return chunk.loaded_versions != self._versions(chunk)

    def _arena_ptr(self) -> int:
        return self.arena.buffer.untyped_storage().data_ptr()

    def _check(self, t: int) -> None:
        """The compute tier never holds more than its share: by the arena, and by a sum over
        the chunks resident on it."""
        resident = self.resident_bytes()
        in_arena = (
            self.arena.stats()["in_use"]
            - len(self._cache) * self.arena.allocator.round_up(self.layout.chunk_bytes)
            - sum(self.arena.allocator.block_size(offset) for offset in self.reserved)
        )
        if in_arena != sum(
            self.arena.allocator.block_size(c.offset) for c in self.chunks if c.resident
        ):
            raise AssertionError(f"access {t}: arena bookkeeping disagrees with resident chunks")
        if resident > self.share(t):
            raise AssertionError(
                f"access {t}: {resident} bytes of chunks resident, share {self.share(t)}"
            )

    def _budget_error(self, t: int, why: str) -> ChunkBudgetError:
        pinned = [c.id for c in self.chunks if c.pins]
        return ChunkBudgetError(
            f"chunk budget exceeded at access {t} ({why}): chunks {pinned} are in use, "
            f"{self.layout.chunk_bytes:,} bytes each; the share there is {self.share(t):,} "
            f"of device_memory {self.budget or self.arena.capacity:,} bytes. Use a smaller "
            "chunk_size, checkpointing, or a larger device_memory."
        )

    # -- the optimizer's room on the compute tier (HybridAdam's device half) --------------------

    def margin(self, ratio: float) -> int:
        """What the compute tier can spare for good, from the last traced training step: the
        budget less the chunks in use and the activations at its fullest moment, times `ratio`
        (PatrickStar's margin_use_ratio). 0 before a training step ran, or with a static
        partition (nothing was traced to plan from)."""
        moments = self.tracer.training_step()
        if self.static_share is not None or not any(m.phase == "backward" for m in moments):
            return 0
        if self.budget is None:
            return 0  # nothing to plan a margin from
        by_budget = self.budget - max(m.pinned_bytes + m.nonmodel_bytes for m in moments)
        by_arena = self.arena.capacity - max(m.pinned_bytes for m in moments)
        return max(int(ratio * min(by_budget, by_arena)) - self.reserved_bytes(), 0)

    def reserved_bytes(self) -> int:
        return sum(self.arena.allocator.block_size(offset) for offset in self.reserved)

    def unreserve(self, count: int) -> None:
        """Give back the last `count` reserved blocks (a keep that could not complete)."""
        for _ in range(count):
            self.arena.free(self.reserved.pop())

    def reserve(self, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """`nbytes` of the compute tier for good, out of the chunks' share (zeroed)."""
        self._drop_unused()
        offset = self.arena.alloc(nbytes)  # ArenaOutOfMemory when fragmented: the caller stops
        self.reserved.append(offset)
        block = self.arena.buffer[offset : offset + nbytes]
        block.zero_()
        return block.view(dtype)

    def _drop_unused(self) -> None:
        """Evict every chunk not in use and empty the block cache: room to reserve from."""
        for chunk in self.chunks:
            if (
                chunk.resident
                and not chunk.pins
                and not chunk.fixed
                and chunk.state is not S.COMPUTE
            ):
                self._evict(chunk, count=False)
        while self._cache:
            self.arena.free(self._cache.pop())

    def fix(self, chunk_id: int) -> None:
        """Keep a chunk on the compute tier for good, with its gradient buffer and (bf16/fp16)
        its fp32 master there too: its optimizer step runs there and nothing of it crosses
        tiers again. The stable parameters become views of the compute-tier copy."""
        chunk = self.chunks[chunk_id]
        if chunk.fixed:
            return
        n = self.layout.chunk_size
        grad = None
        if chunk.host_grad is not None:
            grad = self.reserve(self.layout.chunk_bytes, self.layout.dtype)
        master = self.reserve(n * 4, torch.float32) if chunk.master is not None else None
        if not chunk.resident:
            self._drop_unused()
            offset = self._take_block()
            if offset is None:
                raise ChunkBudgetError(f"no arena block left to keep chunk {chunk_id} in")
            self._load(chunk, offset, S.HOLD)
        used = slice(0, chunk.used)
        if grad is not None:
            grad[used].copy_(chunk.host_grad[used])
            chunk.host_grad = grad
        home = self.chunk_view(chunk)
        if master is not None:
            master[used].copy_(chunk.master[used])
            chunk.master = home = master
        else:  # the host home is the latest (a resident copy may predate an optimizer step)
            home[used].copy_(chunk.host[used])
        for slot in chunk.slots:
            stable = self.stable[slot.name]
            stable.data = home[slot.offset : slot.offset + slot.numel].view(slot.shape)
            self.homes[slot.name] = stable.data
            if stable.grad is not None:
                stable.grad = self.grad_view(slot)
        chunk.fixed = True
        self._round_master(chunk)

    def chunk_view(self, chunk: Chunk) -> torch.Tensor:
        """A resident chunk's compute-tier copy, all its elements."""
        return self._view(chunk, 0, (self.layout.chunk_size,))

    def compute_updated(self, chunk_id: int) -> None:
        """The optimizer wrote a fixed chunk's compute copy (and master) itself."""
        chunk = self.chunks[chunk_id]
        chunk.updates += 1
        chunk.loaded_versions = self._versions(chunk)

    def _round_master(self, chunk: Chunk) -> None:
        if chunk.master is not None:
            self._view(chunk, 0, (chunk.used,)).copy_(chunk.master[: chunk.used])
        chunk.loaded_versions = self._versions(chunk)

    # -- what users see -------------------------------------------------------------------------

    def report(self) -> str:
        lay, st, arena = self.layout, self.stats, self.arena.stats()
        steps = max(st.training_steps, 1)
        current = any(phase == "backward" for _, phase in self._recorded)
        moved = self._step_bytes if current or not st.per_step_bytes else st.per_step_bytes[-1]
        lines = [
            f"chunks: {len(lay.chunks)} x {lay.chunk_bytes:,} bytes ({lay.chunk_size:,} "
            f"{str(lay.dtype).split('.')[-1]}), {lay.wasted_bytes:,} bytes unused",
            f"compute tier ({self.device}): budget "
            + ("none (every chunk resident)" if self.budget is None else f"{self.budget:,}")
            + f", arena {arena['capacity']:,}, "
            f"peak chunks {arena['peak_in_use']:,}, now {self.resident_bytes():,}",
            f"host tier: {len(lay.chunks) * lay.chunk_bytes:,} parameter and "
            f"{sum(c.host_grad is not None for c in self.chunks) * lay.chunk_bytes:,} "
            "gradient bytes",
            f"moved host->compute: {moved:,} bytes in the last training step "
            f"({moved / max(lay.param_bytes, 1):.2f}x the parameter bytes; "
            f"{st.moved_bytes_total / steps:,.0f} per step on average)",
            f"evictions {st.evictions}, loads {st.loads}, prefetch hits {st.prefetch_hits}, "
            f"cache hits {st.cache_hits}, time in copies {st.copy_seconds:.3f}s",
        ]
        overlap = self.grad_copy_overlap()
        if overlap is not None:
            lines.append(
                f"gradient copies: {st.grad_copy_seconds:.3f}s, {overlap:.0%} hidden behind "
                f"backward ({st.grad_wait_seconds:.3f}s waited at its end)"
            )
        fixed = [c.id for c in self.chunks if c.fixed]
        if fixed:
            lines.append(
                f"kept on the compute tier with their optimizer state: {len(fixed)} chunks "
                f"({self.reserved_bytes():,} bytes beside their payloads)"
            )
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
