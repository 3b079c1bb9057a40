"""Data parallelism over chunk groups: gradients to their owners, updates from them.

The chunk list is padded into groups of N (the data-parallel size); chunk i is owned by rank
i mod N (PatrickStar's chunk groups). Every rank holds every chunk's parameters (the payloads
are replicated: ZeRO-Offload's layout), but the optimizer state (fp32 moments) only of its own
chunks: HybridAdam steps those alone. At the stepping micro-batch, before the update:

- `reduce_to_owners`: the gradient of each group is reduce-scattered (one collective over a
  group buffer of N chunks) so that each owner gets the average of its chunk's gradient; the
  other ranks drop theirs (under bf16/fp16 their payload's room gets its parameters back).
  With `mem_saving` it is N reduces, each in place in the chunk's own gradient buffer: no
  communication buffer at all.
- which parameters got a gradient is agreed first (a max all-reduce of one flag a slot), so a
  parameter one rank did not use still gets the others' share;
- the global decisions of the step (the clip norm's sum of squares, fp16 overflow) are summed
  across ranks (runtime/grad_norm.py), so every rank clips alike and skips the same steps.

After the update, `share_updates` sends each owner's updated fp32 parameters to the others (an
all-gather of each group, or with `mem_saving` N broadcasts straight into the homes); the
receivers round their low-precision payloads from them. Optimizers other than HybridAdam
step every parameter on every rank: `average` all-reduces every gradient instead.

With sharded payloads (`sharded`, ZeRO-3) a rank holds the homes of its own chunks only. A
load of a chunk gathers its whole group into one arena block of N chunks (`gather`: one
all-gather, in place, each rank's own chunk copied into its place first; the residency loads
and evicts whole groups, runtime/residency.py); with `mem_saving` it is one broadcast of the
chunk alone from its owner into its own block (`fetch`), so the compute tier needs room for
one chunk rather than a group. Gradients go to their owners during backward
(runtime/grad_shards.py). Since every load is a collective, every rank follows one chunk
plan: each plan a rank derives (compiled from a capture, refined from a traced step) is
compared across the ranks before it is first followed, rank 0's taken where they differ
(`agree_plan`), and a refinement takes the most bytes any rank measured (`agree_measured`).

The process group is the engine's own (runtime/rank_group.new_group, with plan.dist_timeout), so a
rank that stopped makes the others raise a CollectiveError naming the collective.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fxstar.runtime.device import device_for
from fxstar.runtime.rank_group import RankGroup, guard, host_process_group, process_group

if TYPE_CHECKING:
    from fxstar.runtime.chunk import Chunk
    from fxstar.runtime.layout import ChunkPlan
    from fxstar.runtime.step_chunks import StepChunks

__all__ = ["ChunkGroups"]


class ChunkGroups:
    """Which chunks this rank owns, and the collectives that keep the replicas one model."""

    def __init__(
        self, size: int, group: RankGroup, *, mem_saving: bool = False, sharded: bool = False
    ):
        self.group = group
        # ZeRO-3: a rank holds its own chunks' homes only; the others come from their owner
        self.sharded = sharded
        self.pg = process_group(group)
        self.host_pg = host_process_group(group)  # host tensors and objects (NCCL: its gloo side)
        self.size = size
        self.rank = dist.get_rank(self.pg)
        if dist.get_world_size(self.pg) != size:
            raise ValueError(
                f"the chunk layout has groups of {size}; process group {group!r} has "
                f"{dist.get_world_size(self.pg)} ranks"
            )
        self.mem_saving = mem_saving
        self.peak_buffer_bytes = 0  # the largest communication buffer a collective used
        self.bytes_sent = 0  # bytes of the input tensors this rank handed to collectives
        self.bytes_fetched = 0  # sharded: payload bytes that came from their owner
        self.peak_staging_bytes = 0  # sharded: the most gradient staging held at once
        self.plans_from_rank_0 = 0  # sharded: chunk plans the ranks derived unlike (agree_plan)

    def _pg(self, tensor: torch.Tensor) -> object:
        """The group a collective on `tensor` runs on: a host tensor (a host-tier home, a
        flag, a CRC) goes on the host group, which a backend without host tensors needs."""
        return self.pg if tensor.device.type != "cpu" else self.host_pg

    def owner(self, chunk_id: int) -> int:
        return chunk_id % self.size

    def owns(self, chunk_id: int) -> bool:
        return self.owner(chunk_id) == self.rank

    def groups(self, chunks: Sequence[Chunk]) -> list[list[Chunk]]:
        """The chunks in groups of `size`, in order (the layout padded them to whole groups)."""
        return [list(chunks[i : i + self.size]) for i in range(0, len(chunks), self.size)]

    def describe(self, kept: int = 0) -> str:
        """The report's line; `kept`: chunks every rank keeps on the compute tier (sharded)."""
        if self.sharded:
            way = ("payloads sharded: " + ("a chunk fetched from its owner by a broadcast into "
                   "its arena block, gradients reduced to it during backward chunk by chunk"
                   if self.mem_saving else "a chunk's group all-gathered into one arena "
                   "block of N chunks, gradients reduce-scattered during backward group by "
                   "group")
                   + (f"; {kept} chunks kept on the compute tier by every rank"
                      if kept else ""))  # fmt: skip
        else:
            way = ("N reduces and N broadcasts in place" if self.mem_saving
                   else "reduce-scatter and all-gather over a group buffer")  # fmt: skip
        fetched = (f", {self.bytes_fetched:,} fetched from owners, gradient staging peak "
                   f"{self.peak_staging_bytes:,} bytes" if self.sharded else "")  # fmt: skip
        if self.plans_from_rank_0:
            fetched += (f"; {self.plans_from_rank_0} chunk plans the ranks derived unlike, "
                        "rank 0's followed")  # fmt: skip
        return (
            f"data parallel: rank {self.rank} of {self.size}, owns every chunk i with "
            f"i mod {self.size} == {self.rank} ({way}); largest communication buffer "
            f"{self.peak_buffer_bytes:,} bytes, {self.bytes_sent:,} bytes through "
            f"collectives{fetched}"
        )

    # -- collectives, each named in errors --------------------------------------------------------

    def _guard(self, what: str, *, wait: bool = False):
        return guard(f"{what} (data parallel)", self.group, wait=wait)

    def _buffer(self, numel: int, like: torch.Tensor, purpose: str = "data_parallel"
                ) -> torch.Tensor:  # fmt: skip
        """The group's communication buffer for `purpose` (its pool's, reused every step).
        Not zeroed: a chunk's padding there is summed or gathered but never read back."""
        buffer = self.group.buffers.get(purpose, (numel,), like)
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, buffer.nbytes)
        return buffer

    def fetch(self, chunk_id: int, payload: torch.Tensor, *, wait: bool = True
              ) -> dist.Work | None:  # fmt: skip
        """Sharded: the owner's payload of a chunk (already copied there on the owner) into
        every rank's arena block, in place. Every rank fetches the same chunk at the same
        access: they follow one plan with one budget (Residency decides alike). `wait=False`
        (a prefetch): the broadcast runs beside compute; wait on what it returns
        (`arrived`) before the payload is read or its block reused."""
        owner = self.owner(chunk_id)
        with self._guard(f"fetching chunk {chunk_id} from rank {owner}"):
            work = self._start(payload, wait, lambda dst: dist.broadcast(
                dst, group=self._pg(dst), group_src=owner, async_op=not wait
            ))  # fmt: skip
        if owner == self.rank:
            self.bytes_sent += payload.nbytes
        else:
            self.bytes_fetched += payload.nbytes
        return work

    def gather(self, first: int, block: torch.Tensor, *, wait: bool = True
               ) -> dist.Work | None:  # fmt: skip
        """Sharded, group loads: the payloads of the group whose first chunk is `first` into
        one arena block of N chunks, by one all-gather in place (ZeRO-3's gather): every
        rank's own chunk is in its place in the block already. `wait` as for fetch."""
        size = block.numel() // self.size
        own = block[self.rank * size : (self.rank + 1) * size]
        with self._guard(f"all-gathering chunks {first} to {first + self.size - 1}"):
            work = self._start(block, wait, lambda dst: dist.all_gather_single(
                dst, dst[self.rank * size : (self.rank + 1) * size], group=self._pg(dst),
                async_op=not wait,
            ))  # fmt: skip
        self.bytes_sent += own.nbytes
        self.bytes_fetched += block.nbytes - own.nbytes
        return work

    @staticmethod
    def _start(dst: torch.Tensor, wait: bool, issue: Callable[[torch.Tensor], Any]) -> Any:
        """A collective into `dst`, at once, or (a prefetch) through the device's
        `collective`: what reads `dst` before `arrived` reads garbage, as on a card."""
        if wait:
            return issue(dst)
        (work,) = device_for(dst.device).collective(dst, lambda target: [issue(target)])
        return work

    def arrived(self, chunk_id: int, work: dist.Work) -> None:
        """A prefetch's broadcast or gather is done (an error names the chunk)."""
        with self._guard(f"fetching chunk {chunk_id} (owner rank {self.owner(chunk_id)})",
                         wait=True):  # fmt: skip
            work.wait()

    def reduce_unit(self, staged: torch.Tensor, owners: list[int], chunk_size: int
                    ) -> torch.Tensor | None:  # fmt: skip
        """Sharded: a unit's gradients staged back to back (`chunk_size` each, the chunks
        owned by `owners`: a whole group in rank order, or one chunk with mem_saving) summed
        on their owners; this rank's sum, or None when it owns none of them."""
        if len(owners) == 1:
            with self._guard("reducing a chunk's gradient to its owner"):
                dist.reduce(staged, group=self._pg(staged), group_dst=owners[0])
            self.bytes_sent += staged.nbytes
            return staged if owners[0] == self.rank else None
        out = self._buffer(chunk_size, staged, "data_parallel_out")
        with self._guard("reduce-scattering gradients to their owners"):
            dist.reduce_scatter_single(out, staged, group=self._pg(out))
        self.bytes_sent += staged.nbytes
        return out

    def agree_flags(self, flags: torch.Tensor) -> torch.Tensor:
        """Element-wise max over the ranks (a flag set on any rank is set on all)."""
        flags = flags.to(torch.int32)
        with self._guard("agreeing which parameters got gradients"):
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._pg(flags))
        return flags.bool()

    def _one_per_owner(self, tensors: list[torch.Tensor], collective, what: str) -> None:
        """`collective(tensor, owner)` (the owner's rank in the group) for each tensor of a
        group, in place: one chunk's room at a time, no buffer (PatrickStar's memory-saving
        communication)."""
        with self._guard(what):
            for owner, tensor in enumerate(tensors):
                if tensor.numel():
                    collective(tensor, owner)
                    self.bytes_sent += tensor.nbytes

    def reduce_group(self, grads: list[torch.Tensor], chunk_size: int) -> torch.Tensor | None:
        """Sum the group's gradients (one a rank's chunk, each `used` long, `grads[i]` owned by
        rank i) and hand back this rank's own sum (None when it owns a padding chunk)."""
        mine = grads[self.rank]
        if self.mem_saving:  # gloo's reduce overwrites the input of the other ranks: they
            # drop their gradients anyway (reduce_to_owners gives their rooms back)
            self._one_per_owner(grads, lambda t, owner: dist.reduce(t, group=self._pg(t),
                                                                    group_dst=owner),
                                "reducing gradients to their owner")  # fmt: skip
            return mine if mine.numel() else None
        like = next(g for g in grads if g.numel())
        flat = self._buffer((self.size + 1) * chunk_size, like)
        stacked, out = flat[: self.size * chunk_size], flat[self.size * chunk_size :]
        for i, grad in enumerate(grads):
            stacked[i * chunk_size : i * chunk_size + grad.numel()].copy_(grad)
        with self._guard("reduce-scattering gradients to their owners"):
            dist.reduce_scatter_single(out, stacked, group=self._pg(out))
        self.bytes_sent += stacked.nbytes
        if not mine.numel():
            return None
        mine.copy_(out[: mine.numel()])
        return mine

    def gather_group(self, homes: list[torch.Tensor], chunk_size: int) -> None:
        """Every rank's `homes[i]` becomes owner i's (each `used` long, fp32)."""
        if self.mem_saving:
            self._one_per_owner(homes, lambda t, owner: dist.broadcast(t, group=self._pg(t),
                                                                       group_src=owner),
                                "broadcasting updates from their owner")  # fmt: skip
            return
        like = next(h for h in homes if h.numel())
        flat = self._buffer((self.size + 1) * chunk_size, like)
        gathered, mine = flat[: self.size * chunk_size], flat[self.size * chunk_size :]
        own = homes[self.rank]
        mine[: own.numel()].copy_(own)
        with self._guard("all-gathering updated parameters"):
            dist.all_gather_single(gathered, mine, group=self._pg(gathered))
        self.bytes_sent += mine.nbytes
        for i, home in enumerate(homes):
            if i != self.rank and home.numel():
                home.copy_(gathered[i * chunk_size : i * chunk_size + home.numel()])

    def average(self, tensors: Iterable[torch.Tensor]) -> None:
        """Every rank's tensors become the mean over the ranks (in place)."""
        with self._guard("averaging gradients"):
            for t in tensors:
                dist.all_reduce(t, group=self._pg(t))
                t.div_(self.size)
                self.bytes_sent += t.nbytes

    def broadcast(self, tensors: Iterable[torch.Tensor], what: str) -> None:
        """Rank 0's values everywhere (a replica starts as rank 0's model, as DDP's does)."""
        with self._guard(f"broadcasting {what} from rank 0"):
            for t in tensors:
                dist.broadcast(t, group=self._pg(t), group_src=0)

    # -- the chunks' side ---------------------------------------------------------------------

    def reduce_to_owners(self, chunks: StepChunks) -> None:
        """Before the update: every owner holds the average of its chunks' gradients over the
        ranks, under the slots any rank gave one; the other ranks hold none (a payload room
        that held a gradient has its parameters back). The gradient copies have landed
        (HybridAdam.step waits for them first)."""
        slots = [s for c in chunks.chunks if c.grad is not None
                 for s in c.slots if s.requires_grad]  # fmt: skip
        local = torch.tensor([chunks.has_grad(s) for s in slots], dtype=torch.bool)
        agreed = self.agree_flags(local)
        with_grad = set()
        for slot, here, anywhere in zip(slots, local.tolist(), agreed.tolist(), strict=True):
            if not anywhere:
                continue
            with_grad.add(slot.name)
            chunks.chunk(slot.chunk).take_room(slot)  # the gradient's from here on, everywhere
            if not here:  # this rank's share of a gradient others have
                chunks.grad_view(slot).zero_()
        for group in self.groups(chunks.chunks):
            parts = [c.grad[: c.used] if c.grad is not None else c.payload[:0]
                     for c in group]  # fmt: skip
            if not any(p.numel() for p in parts):
                continue
            mine = self.reduce_group(parts, chunks.layout.chunk_size)
            if mine is not None:
                mine.div_(self.size)
        for chunk in chunks.chunks:
            if chunk.grad is None:
                continue
            owned = [s for s in chunk.slots if s.name in with_grad] if self.owns(chunk.id) else []
            chunk.keep_grads_only(owned)  # the collective wrote the whole room: parameters back
            for slot in chunk.slots:
                chunks.set_has_grad(slot, slot in owned)

    def share_updates(self, chunks: StepChunks) -> None:
        """After the update: every rank's fp32 parameters of every trainable chunk become its
        owner's, and the low-precision payloads follow."""
        for group in self.groups(chunks.chunks):
            homes = [c.fp32_home if c.grad is not None else c.payload[:0] for c in group]
            if not any(h.numel() for h in homes):
                continue
            self.gather_group(homes, chunks.layout.chunk_size)
            for chunk in group:
                if chunk.grad is None or self.owns(chunk.id):
                    continue
                chunks.masters_from_owner(chunk)

    def start_sharded(self, chunks: Sequence[Chunk], masters: dict[str, torch.Tensor]) -> None:
        """Sharded payloads, as the homes are made: each owner takes rank 0's values of its
        chunks (rank 0 sends them from its model, chunk by chunk), so the replicas start as
        rank 0's model, as DDP's do. A meta model's chunks are filled by their owners (from
        the same weights on every rank)."""
        with self._guard("sending rank 0's initial parameters to their owners"):
            for chunk in chunks:
                owner = self.owner(chunk.id)
                if owner == 0 or not chunk.used or any(masters[s.name].is_meta
                                                       for s in chunk.slots):  # fmt: skip
                    continue
                if self.rank == 0:
                    values = torch.zeros(chunk.used, dtype=masters[chunk.slots[0].name].dtype)
                    for slot in chunk.slots:
                        span = slice(slot.offset, slot.offset + slot.numel)
                        values[span].copy_(masters[slot.name].reshape(-1))
                    dist.send(values, group=self._pg(values), group_dst=owner)
                    self.bytes_sent += values.nbytes
                elif self.rank == owner:
                    dist.recv(chunk.fp32_home, group=self._pg(chunk.fp32_home), group_src=0)

    def full_parameters(self, chunks: StepChunks) -> dict[str, torch.Tensor]:
        """Sharded: every chunk's fp32 parameters under each of their names, on every rank
        (each owner broadcasts its chunks one by one; collective, as a tensor-parallel
        state_dict is). A rank's own are views of its homes; the others' are fresh."""
        full: dict[str, torch.Tensor] = {}
        with self._guard("gathering the parameters from their owners"):
            for chunk in chunks.chunks:
                if chunk.used:
                    full.update(self.chunk_parameters(chunk))
        return full

    def chunk_parameters(self, chunk: Chunk) -> dict[str, torch.Tensor]:
        """Sharded: one chunk's fp32 parameters under each of their names, on every rank (its
        owner broadcasts it; collective, inside a `guard`). The owner's are views of its home,
        the others' fresh: an export takes the model a chunk at a time."""
        # a remote chunk's values come into a tensor like its owner's fp32 home
        values = torch.empty(chunk.used, dtype=torch.float32) if chunk.remote else chunk.fp32_home
        dist.broadcast(values, group=self._pg(values), group_src=self.owner(chunk.id))
        return {name: values[slot.offset : slot.offset + slot.numel].view(slot.shape)
                for slot in chunk.slots for name in (slot.name, *slot.aliases)}  # fmt: skip

    def agree_measured(self, measured: Sequence[int] | None) -> tuple[int, ...] | None:
        """Sharded: the bytes besides chunks a traced step measured at each access, the most
        of any rank, so every rank refines its plan alike (a load is collective: the ranks
        must evict and fetch at the same accesses). None on every rank when any rank's step
        could not be used (`measured` None there): no rank refines."""
        length = -1 if measured is None else len(measured)
        count = torch.tensor([length, -length], dtype=torch.int64)
        with self._guard("agreeing the measured step"):
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self._pg(count))
            if int(count[1]) == 1:  # some rank has none
                return None
            if int(count[0]) != -int(count[1]):
                raise RuntimeError(
                    "data parallel: the ranks traced steps of different lengths "
                    f"({-int(count[1])} to {int(count[0])} accesses); they must run one graph"
                )
            values = torch.tensor(list(measured), dtype=torch.int64)
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self._pg(values))
        return tuple(int(v) for v in values)

    def agree_plan(self, plan: ChunkPlan) -> ChunkPlan:
        """Sharded, before a rank first follows a chunk plan: every rank's loads and
        evictions are collectives, so every rank must follow one plan. Each plan is derived
        on each rank (compiled from its capture, refined from its traced step); a CRC-32 of
        what the residency decides by (the access plan, budget and share; the arena and the
        load unit are the manager's, made once) is all-gathered, and where any differs every
        rank takes rank 0's."""
        what = repr((plan.access, plan.budget, plan.static_share))
        mine = torch.tensor([zlib.crc32(what.encode())], dtype=torch.int64)
        every = torch.zeros(self.size, dtype=torch.int64)
        with self._guard("agreeing the chunk plan"):
            dist.all_gather_single(every, mine, group=self._pg(every))
            if bool((every == every[0]).all()):
                return plan
            theirs = [(plan.access, plan.budget, plan.static_share)]
            dist.broadcast_object_list(theirs, group=self.host_pg, group_src=0)
        access, budget, static_share = theirs[0]
        self.plans_from_rank_0 += 1
        return dataclasses.replace(plan, access=access, budget=budget, static_share=static_share)

    def updated(self, chunks: StepChunks) -> None:
        """Sharded, after the update: every trainable chunk counts as changed on every rank
        (the owners stepped theirs), so every rank drops its copy at the same access and
        fetches the new values from the owner; a kept one (the device half, group-wide) gets
        them now, broadcast from its owner into every rank's copy."""
        for spec in chunks.layout.chunks:
            chunk = chunks.chunk(spec.id)
            if chunk.kept and chunk.used:
                self.fetch(chunk.id, chunk.payload[: chunk.used])
                if chunk.remote:
                    chunks.stepped(chunk)  # saved views of it are stale now
            elif spec.trainable:
                chunk.host_changed()

    def least(self, value: int) -> int:
        """The smallest `value` of any rank (a margin every rank has)."""
        least = torch.tensor([value], dtype=torch.int64)
        with self._guard("agreeing the device half's margin"):
            dist.all_reduce(least, op=dist.ReduceOp.MIN, group=self._pg(least))
        return int(least)

    def start_alike(self, chunks: StepChunks) -> None:
        """After the homes were filled: every replica starts as rank 0's."""
        if self.sharded:  # start_sharded did it as the homes were made
            return
        homes = [c.fp32_home for c in chunks.chunks if c.used]
        self.broadcast(homes, "the initial parameters")
        chunks.masters_written()
