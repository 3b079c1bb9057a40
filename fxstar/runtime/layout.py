"""The decisions the chunk passes hand to the runtime, as plain data.

`ChunkLayout` says which parameter lives in which chunk at which offset (chunk_layout pass);
`AccessPlan` says in which order a step will need the chunks, forward then backward, and how
many bytes besides the chunks each moment is expected to need; `ChunkPlan` (chunk_schedule
pass, one per capture) holds both with the room the chunks have: budget, static share, arena
capacity and device. The ChunkManager is built from a ChunkPlan and follows the one it is run
with, reading it at every access and never writing it: a user can read, print or change it
between compile and run. What a traced step measured is an `Observed` record; a plan refined
from it is a new ChunkPlan (the engine records it as a stage of the program).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

import torch

from fxstar.runtime.moments import moment_bytes

HOST_ALIGNMENT = 64  # bytes: every chunk's host part starts on a cache line


MAX_STAGED = 2  # gradient units a rank stages at once with sharded payloads (grad_shards.py)


def blocks_at_once(chunks: Collection[int], load_unit: int) -> int:
    """Chunk blocks the compute tier holds while `chunks` are resident: with group loads
    (`load_unit` N: a chunk comes with its whole group, gathered at once) every group they
    touch, whole."""
    if load_unit == 1:
        return len(chunks)
    return len({c // load_unit for c in chunks}) * load_unit


def host_parts(dtype: torch.dtype, lengths: list[int]) -> list[slice]:
    """Consecutive element ranges of these lengths in one host buffer, each start aligned: on
    the host a chunk takes what its parameters reach, not its padding (only `used` elements
    ever move, and a layout's padding is often a fifth of the chunks)."""
    align = max(HOST_ALIGNMENT // dtype.itemsize, 1)
    parts, at = [], 0
    for length in lengths:
        parts.append(slice(at, at + length))
        at += -(-length // align) * align
    return parts


def host_elements(dtype: torch.dtype, lengths: list[int]) -> int:
    """Elements of the one host buffer `host_parts` packs these lengths in."""
    parts = host_parts(dtype, lengths)
    return parts[-1].stop if parts else 0


@dataclass(frozen=True)
class ParamSlot:
    name: str  # the store's name of the parameter (the first of its aliases)
    aliases: tuple[str, ...]
    chunk: int
    offset: int  # in elements, within the chunk
    shape: tuple[int, ...]
    requires_grad: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class ChunkSpec:
    id: int
    params: list[ParamSlot] = field(default_factory=list)
    used: int = 0  # elements taken by parameters

    @property
    def trainable(self) -> bool:
        return any(p.requires_grad for p in self.params)


@dataclass
class ChunkLayout:
    chunk_size: int  # elements per chunk
    dtype: torch.dtype
    chunks: list[ChunkSpec]
    # data parallel: the chunks come in groups of `ranks`, chunk i owned by rank i mod ranks
    ranks: int = 1

    def grouped(self, ranks: int) -> ChunkLayout:
        """This layout padded with empty chunks into whole groups of `ranks` (PatrickStar's
        chunk groups): a group's collective takes one chunk from every rank."""
        if ranks == self.ranks:
            return self
        if self.ranks != 1:
            raise ValueError(f"the layout is grouped for {self.ranks} ranks already")
        padding = -len(self.chunks) % ranks
        specs = list(self.chunks) + [ChunkSpec(len(self.chunks) + i) for i in range(padding)]
        return dataclasses.replace(self, chunks=specs, ranks=ranks)

    def owner(self, chunk_id: int) -> int:
        return chunk_id % self.ranks

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_size * self.dtype.itemsize

    @property
    def param_bytes(self) -> int:
        return sum(c.used for c in self.chunks) * self.dtype.itemsize

    @property
    def wasted_bytes(self) -> int:
        return len(self.chunks) * self.chunk_bytes - self.param_bytes

    def host_bytes(self, *, masters: bool, own_grads: bool, moments: bool, rank: int = 0,
                   sharded: bool = False, kept: Collection[int] = (),
                   state_dtype: str = "fp32") -> int:  # fmt: skip
        """What the chunk engine allocates on the host for this layout: every chunk's payload
        (packed, see host_parts), fp32 masters (bf16/fp16), gradient buffers of their own
        (fp32; bf16/fp16 with grads_in_host=False) and two Adam moments (in `state_dtype`,
        runtime/moments.py) per trainable element of the chunks rank `rank` owns (all of
        them without data parallelism).
        `sharded` (data parallel, sharded payloads): the homes of its own chunks only. `kept`:
        chunks kept on the compute tier for good, whose host homes go back to the system."""
        homes = [c for c in self.chunks
                 if (not sharded or self.owner(c.id) == rank) and c.id not in kept]  # fmt: skip
        every = host_elements(self.dtype, [c.used for c in homes])
        trainable = [c.used for c in homes if c.trainable]
        total = every * self.dtype.itemsize + (every * 4 if masters else 0)
        if own_grads:
            total += host_elements(self.dtype, trainable) * self.dtype.itemsize
        if moments:
            own = [c for c in self.chunks if self.owner(c.id) == rank and c.id not in kept]
            total += sum(moment_bytes(state_dtype, c.used, [p.numel for p in c.params])
                         for c in own if c.trainable)  # fmt: skip
        return total

    def kept_grad_in_payload(self, *, grads_in_host: bool, accumulation_steps: int) -> bool:
        """Whether a chunk kept on the compute tier for good has its gradient in its payload's
        room (Reservations.fix's share_room), as bf16/fp16 host chunks do with grads_in_host:
        not when forwards run between backward and step (accumulation: each would read the
        rounded masters as copies of their own), nor under data parallelism."""
        return (self.dtype != torch.float32 and grads_in_host and self.ranks == 1
                and accumulation_steps == 1)  # fmt: skip

    def kept_chunk_bytes(self, *, share_room: bool, state_dtype: str = "fp32") -> int:
        """Compute-tier bytes a chunk kept there for good takes with its optimizer state: its
        payload, its gradient (in the payload's room when `share_room`), two moments in
        `state_dtype` (8-bit: as many absmax values as the chunk that needs most) and
        (bf16/fp16) an fp32 master."""
        low_precision = self.dtype != torch.float32
        payloads = 1 if share_room else 2
        moments = max((moment_bytes(state_dtype, self.chunk_size, [p.numel for p in c.params])
                       for c in self.chunks),
                      default=moment_bytes(state_dtype, self.chunk_size, []))  # fmt: skip
        return payloads * self.chunk_bytes + self.chunk_size * 4 * low_precision + moments

    def staging_bytes(self, ranks: int, *, mem_saving: bool) -> int:
        """The most gradient staging a rank holds at once with payloads sharded over `ranks`:
        MAX_STAGED units of a group's chunks and the reduce-scatter's one-chunk output (of one
        chunk, reduced in place, with mem_saving_comm)."""
        if mem_saving:
            return MAX_STAGED * self.chunk_bytes
        return (MAX_STAGED * ranks + 1) * self.chunk_bytes

    def slots(self) -> dict[str, ParamSlot]:
        """Every alias -> its slot."""
        return {alias: p for c in self.chunks for p in c.params for alias in p.aliases}

    def describe(self) -> str:
        lines = [
            f"{len(self.chunks)} chunks of {self.chunk_size:,} {str(self.dtype).split('.')[-1]} "
            f"elements ({self.chunk_bytes:,} bytes); {self.wasted_bytes:,} bytes unused"
            + (
                f"; groups of {self.ranks}, chunk i owned by rank i mod {self.ranks}"
                if self.ranks > 1
                else ""
            )
        ]
        for c in self.chunks:
            names = ", ".join(p.name for p in c.params)
            lines.append(f"  chunk {c.id}: {c.used:,}/{self.chunk_size:,} elements: {names}")
        return "\n".join(lines)


def spare_bytes(budget: int, capacity: int, moments: Iterable[tuple[int, int]],
                ratio: float) -> int:  # fmt: skip
    """What the compute tier can spare for good (HybridAdam's margin): the budget less the
    chunks in use and the activations at the step's fullest moment, and the arena less the
    chunks alone, times `ratio` (PatrickStar's margin_use_ratio). `moments`: (chunk bytes in
    use, bytes besides chunks) at each access of a step."""
    moments = list(moments)
    if not moments:
        return 0
    by_budget = budget - max(chunks + other for chunks, other in moments)
    by_arena = capacity - max(chunks for chunks, _ in moments)
    return max(int(ratio * min(by_budget, by_arena)), 0)


def kept_room(budget: int | None, capacity: int, static_share: int | None,
              access: AccessPlan, chunk_bytes: int) -> int | None:  # fmt: skip
    """What chunks kept on the compute tier for good (payloads, gradients, masters, moments:
    HybridAdam's device half) may hold beside every access of `access`: what each moment's
    chunks in use and bytes besides chunks leave of the budget, and of the arena (the static
    share under static_partition). None without a budget (nothing is kept then)."""
    if budget is None:
        return None
    pinned = [count * chunk_bytes for count in access.pinned_at_once]
    if static_share is not None:
        return max(static_share - max(pinned, default=0), 0)
    return spare_bytes(budget, capacity, zip(pinned, access.nonmodel_bytes), 1.0)


@dataclass
class AccessPlan:
    """The chunk accesses of one step in the order they will happen."""

    chunks: list[int]  # chunk id per access
    phases: list[str]  # "forward" or "backward" per access
    nonmodel_bytes: list[int]  # expected bytes besides chunks at each access
    pinned_at_once: list[int]  # chunk blocks that must be resident together at each access
    # the chunks in use at each access (fetched and not yet released, the accessed one among
    # them): what no eviction may take then; empty where unknown (a plan made by hand)
    in_use: list[tuple[int, ...]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.chunks)

    def add(self, chunk: int, phase: str, nonmodel: int, in_use: Collection[int],
            load_unit: int = 1) -> None:  # fmt: skip
        """One more access: its chunk, phase and bytes besides chunks, and the chunks in use
        then (`load_unit`: chunks a load brings, see blocks_at_once)."""
        self.chunks.append(chunk)
        self.phases.append(phase)
        self.nonmodel_bytes.append(nonmodel)
        self.pinned_at_once.append(blocks_at_once(in_use, load_unit))
        self.in_use.append(tuple(sorted(in_use)))

    @property
    def forward_len(self) -> int:
        return self.phases.count("forward")


@dataclass(frozen=True)
class Observed:
    """What a traced training step did: its chunk accesses in order, and the bytes besides
    chunks measured at each."""

    chunks: tuple[int, ...]
    phases: tuple[str, ...]
    nonmodel_bytes: tuple[int, ...]

    def describe(self) -> str:
        peak = max(self.nonmodel_bytes, default=0)
        return f"{len(self.chunks)} accesses, at most {peak:,} bytes besides chunks"


@dataclass
class ChunkPlan:
    """Everything the ChunkManager follows for one capture."""

    layout: ChunkLayout
    access: AccessPlan
    budget: int | None  # device_memory in bytes; None: every chunk resident, activations free
    arena_capacity: int  # bytes of the compute-tier arena, fixed once a manager made it
    static_share: int | None = None  # static_partition: the chunks' fixed share of the budget
    device: str = "cpu"
    mem_cache: int = 2  # freed chunk blocks kept for reuse
    # chunks one load brings: 1, or with sharded data-parallel payloads (not mem_saving_comm)
    # the chunk's whole group of N, gathered into one block of N chunks by one all-gather
    load_unit: int = 1
    observed: Observed | None = None  # what the step this plan was refined from measured
    # sharded data-parallel payloads: the most gradient staging a rank holds at once
    # (ChunkLayout.staging_bytes), on the compute tier beside chunks and activations all step
    staging_bytes: int = 0

    @property
    def chunk_budget(self) -> int | None:
        """What chunks and activations share at every moment: the budget less the staging."""
        return None if self.budget is None else self.budget - self.staging_bytes

    def kept_room(self) -> int | None:
        """Compute-tier bytes the chunks kept there for good may hold under this plan (see
        kept_room): those beyond it go back to the host tier before the plan runs."""
        return kept_room(self.chunk_budget, self.arena_capacity, self.static_share, self.access,
                         self.layout.chunk_bytes)  # fmt: skip

    def refined(self, observed: Observed) -> ChunkPlan:
        """A plan whose access order and bytes besides chunks are what `observed` measured;
        the room (budget, share, capacity) stays this plan's."""
        n = len(observed.chunks)
        same = len(self.access) == n
        pinned = self.access.pinned_at_once if same else [self.load_unit] * n
        access = AccessPlan(list(observed.chunks), list(observed.phases),
                            list(observed.nonmodel_bytes), list(pinned),
                            list(self.access.in_use) if same else [])  # fmt: skip
        return dataclasses.replace(self, access=access, observed=observed)

    def describe(self) -> str:
        budget = "none (every chunk resident)" if self.budget is None else f"{self.budget:,}"
        share = "" if self.static_share is None else f", static share {self.static_share:,}"
        if self.staging_bytes:
            share += f", {self.staging_bytes:,} of it gradient staging"
        source = "compiled" if self.observed is None else "refined from a traced step"
        return (
            f"chunk plan ({source}): budget {budget}{share}, arena {self.arena_capacity:,} on "
            f"{self.device}; {len(self.access)} accesses ({self.access.forward_len} forward), "
            f"at most {max(self.access.nonmodel_bytes, default=0):,} bytes besides chunks\n"
            + self.layout.describe()
        )
