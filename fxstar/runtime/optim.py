"""HybridAdam: Adam/AdamW over the chunks, with the C++ CPU kernels, as a torch Optimizer.

The fp32 master parameters (the host homes of the chunks, or master chunks when the compute
copies are bf16/fp16) and Adam's two moments live in host buffers laid out like the parameter
chunks; the moments in the plan's `optimizer.state_dtype` (fp32, bf16 or 8-bit), which
`runtime/moments.py` alone knows how to lay out, step and load. A step first takes the
global decision in one read of every gradient (the `_C` stats pass: the sum of squares for
the clip norm, finiteness for fp16 overflow), so an overflow skips the whole step with
nothing written; then it updates chunk by chunk with the unscale and clip factor fused into
the kernel, writing the low-precision copy the compute tier fetches in the same pass.

The device half (`hybrid=True`): at the first training step, before its update (the traced
forward and backward measured the margin), the chunks whose optimizer fits the compute tier's
margin (what the traced step left free at its fullest moment, times `margin_use_ratio`) are
kept there for good (`StepChunks.keep`), with their moments and fp32 master beside them
(and, under bf16/fp16 without accumulation or data parallelism, the gradient in the room of
the compute payload, as on the host: 14 bytes per parameter kept; else a gradient buffer
beside it too), and updated there: by torch's fused Adam on an accelerator, by the same C++
kernel when the compute tier is the CPU (`device_kernel` picks). They stay there while every
plan run has room for them beside its chunks and activations; before a plan with less room (a
later, larger input) the least used go back to the host tier with their moments (`give_back`).
The rest stay on the host. Moments are made at that first step too, so a kept chunk's never
exist on the host, and the host homes it leaves go back to the system. `hybrid=False` keeps
everything on the host. The global read is skipped when neither clipping nor fp16 needs it.

It subclasses torch.optim.Optimizer, so `torch.optim.lr_scheduler` drives its param groups'
`lr`; the tensors in its groups are the engine's stable parameters (their payload moves to
the compute tier when their chunk is kept there; the objects stay).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch

from fxstar.runtime import cpu_adam
from fxstar.runtime.chunk import MASTER_PART, Chunk, ChunkBudgetError
from fxstar.runtime.deferred import DeferredTensor, read_values
from fxstar.runtime.disk_moments import DiskMoments
from fxstar.runtime.disk_pieces import MOMENTS, Piece, PieceStream, file_moments, plan_pieces
from fxstar.runtime.grad_norm import GradNorm, clip_coefficient
from fxstar.runtime.host import host_empty
from fxstar.runtime.layout import ParamSlot
from fxstar.runtime.loss_scale import LossScaler
from fxstar.runtime.moments import MOMENT_KEYS, AdamMoments
from fxstar.runtime.state_guard import StateGuard
from fxstar.runtime.step_chunks import StepChunks

if TYPE_CHECKING:
    from fxstar.runtime.data_parallel import ChunkGroups
    from fxstar.runtime.disk_tier import DiskTier

__all__ = ["HostBudget", "HybridAdam"]


class HostBudget(Protocol):
    """The host memory budget, checked again once the device half is chosen: `kept`, the
    chunks kept on the compute tier, whose host homes go back (fxstar.placement's)."""

    def check(self, kept: list[int]) -> object: ...


class HybridAdam(torch.optim.Optimizer):
    def __init__(
        self,
        chunks: StepChunks,
        param_groups: list[dict[str, Any]],
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adamw: bool = True,
        clip_grad_norm: float | None = None,
        scaler: LossScaler | None = None,
        hybrid: bool = True,
        margin_use_ratio: float = 0.8,
        device_kernel: str = "auto",
        norm: GradNorm | None = None,
        accumulation_steps: int = 1,
        host_budget: HostBudget | None = None,
        data_parallel: ChunkGroups | None = None,
        state_dtype: str = "fp32",
        disk: DiskTier | None = None,
        disk_piece: int = 1 << 21,
        state_guard: StateGuard | None = None,
    ):
        super().__init__(param_groups, dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0))
        self.chunks = chunks
        self.moments = AdamMoments(state_dtype)  # how the moments are stored and stepped
        # the disk tier: host chunks' moments in its files, streamed through each step
        self.disk = disk
        self.on_disk: list[int] = []  # chunks whose moments the disk tier holds
        # the files' layout of a chunk's moments: every region on a page (runtime/disk_pieces)
        self.file_moments = file_moments(state_dtype)
        self.disk_piece = disk_piece  # elements of a chunk a step's stream holds at a time
        self._pieces: dict[int, list[Piece]] = {}  # a disk-homed chunk's pieces
        self.data_parallel = data_parallel  # the chunk owners and their collectives
        # a step stopped halfway is recorded there (the engine's: it refuses to go on)
        self.state_guard = state_guard or StateGuard()
        self.adamw = adamw
        self.clip_grad_norm = clip_grad_norm
        self.scaler = scaler
        self.last_grad_norm: float | None = None  # computed when clipping, fp16, or tracked
        self.track_grad_norm = False  # compute the norm each step even when nothing needs it
        self.skipped_steps = 0
        self.hybrid = hybrid
        self.margin_use_ratio = margin_use_ratio
        # a kept chunk's gradient in its compute payload's room (Reservations.fix)
        self.share_room = chunks.layout.kept_grad_in_payload(
            grads_in_host=chunks.grads_in_payload, accumulation_steps=accumulation_steps
        )
        # the host budget checked again once the device half is chosen, before the moments
        # are made (compile forecast the chunks kept)
        self.host_budget = host_budget
        if device_kernel not in ("auto", "torch", "cpu"):
            raise ValueError(f"device_kernel: 'auto', 'torch' or 'cpu', not {device_kernel!r}")
        if device_kernel == "auto":  # a CPU compute tier is best served by the C++ kernel
            device_kernel = "cpu" if chunks.device.type == "cpu" else "torch"
        self.device_kernel = device_kernel
        # the model's norm from this rank's partial sums (tensor and data parallel)
        groups = data_parallel
        self.norm = norm or GradNorm(data_parallel=groups.group if groups is not None else None)
        self._placed = False  # the device half is chosen at the first training step
        self.device_chunks: list[int] = []
        self.given_back: list[int] = []  # kept chunks a later plan had no room for
        # data parallel: the rank's own chunks only (runtime/data_parallel.py)
        trainable = chunks.own_trainable()
        self._slots: dict[int, ParamSlot] = {}  # id(param) -> its place in the chunks
        group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        for chunk in trainable:
            for slot in chunk.slots:
                if id(chunks.param(slot)) in group_of:
                    self._slots[id(chunks.param(slot))] = slot
        # the moments are made at the first step, after the device half took its chunks: a
        # kept chunk's never exist on the host (see _host_moments)
        self._without_moments = trainable
        # parameters kept out of the chunks (cpu_embedding) are updated where they are
        self._in_chunks = {id(p) for p in chunks.params()}
        for group in self.param_groups:
            for param in group["params"]:
                if id(param) not in self._in_chunks:
                    self.state[param] = {
                        "step": torch.zeros((), dtype=torch.float32),
                        **self.moments.fresh(param),
                    }

    @property
    def kept(self) -> list[int] | None:
        """The chunks kept on the compute tier, None before the device half was chosen."""
        return list(self.device_chunks) if self._placed else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.chunks.zero_grad(set_to_none)

    def _host_moments(self) -> None:
        """Host moments for the chunks that have none yet and are not kept on the compute
        tier: one buffer a chunk, as long as its parameters reach (its padding needs none)."""
        for chunk in self._without_moments:
            if chunk.kept:
                continue  # _keep made them on the compute tier
            if self.disk is None:
                self._set_moments(chunk, self.moments.on_host(chunk.used, chunk.slots))
            else:  # zeros in a file of their own; a step reads them a piece at a time
                self._set_moments(chunk, [{} for _ in chunk.slots])
                self.disk.add(chunk.id, MOMENTS, self._moment_bytes(chunk))
                self._homed_on_disk(chunk)
        self._without_moments = []

    def _moment_bytes(self, chunk: Chunk) -> int:
        return self.file_moments.nbytes(chunk.used, [s.numel for s in chunk.slots])

    def _homed_on_disk(self, chunk: Chunk) -> None:
        self.on_disk.append(chunk.id)
        self._pieces[chunk.id] = plan_pieces(chunk.id, chunk.used, chunk.slots,
                                             self.file_moments, self.disk_piece)  # fmt: skip

    def _detach(self, chunk: Chunk) -> None:
        """The state lets go of the chunk's moments (written to the disk tier): no view outlives
        its buffer."""
        for slot in chunk.slots:
            state = self.state.get(self.chunks.param(slot))
            for key in MOMENT_KEYS:
                if state is not None:
                    state.pop(key, None)

    @contextlib.contextmanager
    def stream_pieces(self, spans: list[tuple[int, slice]]) -> Iterator[PieceStream | None]:
        """Around a step's updates of the runs over `spans` (chunk, elements), in their order:
        the disk-homed chunks' pieces they reach, streamed through host memory (PieceStream),
        their moments and (plan.disk.masters) fp32 masters in its slots; None when none is on
        the disk tier. benchmarks/disk.py streams what a step does through it, computing
        nothing."""
        pieces = {c: self._pieces[c] for c in self.on_disk}
        needed = list(dict.fromkeys(
            piece for chunk_id, span in spans for piece in pieces.get(chunk_id, ())
            if piece.lo < span.stop and span.start < piece.hi
        ))  # fmt: skip
        if not needed:
            yield None
            return
        chunks = {p.chunk: self.chunks.chunk(p.chunk) for p in needed}
        stream = PieceStream(
            self.disk, self.file_moments, needed,
            used={c: chunk.used for c, chunk in chunks.items()},
            numels={c: [s.numel for s in chunk.slots] for c, chunk in chunks.items()},
            masters=self.disk.has(needed[0].chunk, MASTER_PART),  # all or none (plan.disk)
        )  # fmt: skip
        try:
            yield stream
        finally:
            stream.close()

    def _set_moments(self, chunk, views: list[dict[str, torch.Tensor]]) -> None:
        """Fresh state of the chunk's parameters, their moments these views of a chunk-long
        buffer (one per slot)."""
        for slot, moments in zip(chunk.slots, views, strict=True):
            param = self.chunks.param(slot)
            if id(param) in self._slots:
                self.state[param] = {"step": torch.zeros((), dtype=torch.float32), **moments}

    def _runs(self) -> list[tuple[list[torch.nn.Parameter], dict, slice, torch.Tensor]]:
        """The parameters to update, merged into runs that one kernel call can take: adjacent
        in their chunk, in one param group, at the same step, with their gradients in the
        chunk's gradient buffer. A gradient a user put elsewhere makes a run of its own."""
        runs: list[tuple[list[torch.nn.Parameter], dict, slice | None, torch.Tensor]] = []
        # looked up each step: loading a state dict replaces the group dicts
        group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        for group in self.param_groups:  # parameters outside the chunks: a run each
            for param in group["params"]:
                if id(param) not in self._in_chunks and param.grad is not None:
                    runs.append(([param], group, None, param.grad))
        for chunk in self.chunks.own_trainable():
            base = chunk.grad.data_ptr()
            itemsize = chunk.grad.element_size()
            for slot in chunk.slots:
                param = self.chunks.param(slot)
                if id(param) not in self._slots:
                    continue
                grad = self.chunks.slot_grad(slot)
                if grad is None:
                    continue
                group = group_of[id(param)]
                in_buffer = grad.data_ptr() == base + slot.offset * itemsize
                span = slice(slot.offset, slot.offset + slot.numel)
                if runs and in_buffer and runs[-1][2] is not None:
                    params, g, last, flat = runs[-1]
                    prev = self._slots[id(params[-1])]
                    if (
                        g is group
                        and last.stop == slot.offset
                        and prev.chunk == slot.chunk
                        and flat is chunk.grad
                        and self.state[params[-1]]["step"] == self.state[param]["step"]
                        and self.moments.joins(prev.numel)
                    ):
                        params.append(param)
                        runs[-1] = (params, g, slice(last.start, span.stop), flat)
                        continue
                runs.append(([param], group, span, chunk.grad if in_buffer else grad))
        return runs

    def _loose_grads(self) -> list[torch.Tensor]:
        """Gradients of the parameters kept out of the chunks (cpu_embedding)."""
        return [p.grad for g in self.param_groups for p in g["params"]
                if id(p) not in self._in_chunks and p.grad is not None]  # fmt: skip

    @staticmethod
    def _grad_stats(grads: list[torch.Tensor]) -> tuple[float, bool]:
        """Sum of squares and finiteness over every gradient: the C++ pass for host tensors,
        torch for those on an accelerator (one synchronisation for all of them)."""
        sum_sq, finite = 0.0, True
        on_device = []
        for grad in grads:
            if grad.device.type == "cpu":
                stats = cpu_adam.grad_stats(grad)
                sum_sq += stats.sum_sq
                finite = finite and stats.finite
            else:
                on_device.append(grad)
        if on_device:
            total = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) ** 2
                                 for g in on_device]).sum()  # fmt: skip
            value = float(total)
            sum_sq += value
            finite = finite and math.isfinite(value)
        return sum_sq, finite

    def _split_stats(self, runs: list, grads: list[torch.Tensor]) -> tuple[float, float, bool]:
        """The sums of squares of the shards' gradients and of the others', and finiteness."""
        if not self.norm.sharded:  # no tensor parallelism: one pass over the runs
            sum_sq, finite = self._grad_stats(grads)
            return 0.0, sum_sq, finite
        pairs = []
        for (params, _, span, _), grad in zip(runs, grads, strict=True):
            if span is None or len(params) == 1:
                pairs.append((params[0], grad))
                continue
            flat, at = grad.reshape(-1), 0  # a run: its parameters back to back
            for param in params:
                numel = self._slots[id(param)].numel
                pairs.append((param, flat[at : at + numel]))
                at += numel
        shards, replicated = self.norm.split(pairs)
        shard_sq, shards_finite = self._grad_stats(shards)
        replicated_sq, replicated_finite = self._grad_stats(replicated)
        return shard_sq, replicated_sq, shards_finite and replicated_finite

    @torch.no_grad()
    def step(self, closure=None) -> bool:
        """One update of every parameter that has a gradient; False when an overflow skipped
        it. The clip norm and the overflow are decided over all gradients first."""
        self.state_guard.check("HybridAdam.step")
        if closure is not None:
            with torch.enable_grad():
                closure()
        # a backward that raised leaves gradient copies in flight (its end's wait never ran):
        # they land before anything reads them, also for a loop that steps this optimizer itself
        self.chunks.wait_for_grads()
        groups = self.data_parallel
        if groups is not None:  # each owner gets its chunks' averaged gradients
            if groups.sharded:  # reduced during backward
                self.chunks.gradients_reduced()
            else:
                groups.reduce_to_owners(self.chunks)
            groups.average(self._loose_grads())
        if self.disk is not None:  # a file cut short is named before its mapping is touched
            self.disk.check_mapped()
        if self.hybrid and not self._placed:  # the traced forward and backward measured it
            self._place()
            if self.host_budget is not None and self._placed:
                self.host_budget.check(self.device_chunks)
        self._host_moments()
        runs = self._runs()
        # a run's gradient: its span of the chunk's buffer, or the one tensor a user put there
        grads = [
            flat[span] if span is not None and self.chunks.is_grad_buffer(flat) else flat
            for _, _, span, flat in runs
        ]
        grad_scale = 1.0
        if self.scaler is not None or self.clip_grad_norm is not None or self.track_grad_norm:
            # the global decision; without clipping or fp16 nothing needs it (torch's fused
            # AdamW does not read the gradients twice either)
            # over every rank's own chunks and shards: all clip and skip alike
            sum_sq, finite = self.norm.decide(*self._split_stats(runs, grads))
            scale = self.scaler.scale if self.scaler is not None else 1.0
            if self.scaler is not None:
                self.scaler.update(overflow=not finite)
            if not finite:
                self.skipped_steps += 1
                return False
            grad_scale = 1.0 / scale
            self.last_grad_norm = math.sqrt(sum_sq) / scale
            if self.clip_grad_norm is not None:
                grad_scale *= clip_coefficient(self.clip_grad_norm, self.last_grad_norm)
        spans = [(self._slots[id(params[0])].chunk, span) for params, _, span, _ in runs
                 if span is not None]  # fmt: skip
        with self.state_guard.writing(f"the optimizer step {self._step_number(runs)}"):
            with self.stream_pieces(spans) as stream:
                touched = self._update(runs, grads, grad_scale, stream)
            for chunk_id in touched:
                self.chunks.stepped(self.chunks.chunk(chunk_id))
            if groups is not None and groups.sharded:  # fetched from the owners from now on
                groups.updated(self.chunks)
            elif groups is not None:  # the owners' updates to every replica
                groups.share_updates(self.chunks)
        if self.disk is not None:  # the masters' pages read or written since (the forwards
            self.disk.unmap_pages()  # of an accumulation, a replica's update) back to the host
        return True

    def _step_number(self, runs: list) -> int:
        """The number the step about to be taken gives its parameters (their count of updates
        plus one, read off the first run's: the parameters step together)."""
        return int(self.state[runs[0][0][0]].get("step", 0)) + 1 if runs else 1

    def _update(self, runs: list, grads: list[torch.Tensor], grad_scale: float,
                stream: PieceStream | None) -> set[int]:  # fmt: skip
        """Every run's update (a disk-homed chunk's from the `stream`, a piece at a time); the
        chunks touched."""
        touched = set()
        for (params, group, span, _), grad in zip(runs, grads, strict=True):
            if span is None:  # a parameter outside the chunks
                state = self.state[params[0]]
                state["step"] += 1
                moments = self.moments.run(state, params[0].numel())
                self.moments.step(
                    params[0], grad, moments, step=int(state["step"]), lr=group["lr"],
                    betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"],
                    adamw=self.adamw, grad_scale=grad_scale,
                )  # fmt: skip
                continue
            slot = self._slots[id(params[0])]
            chunk = self.chunks.chunk(slot.chunk)
            first = self.state[params[0]]
            for p in params:
                self.state[p]["step"] += 1
            step = int(first["step"])
            if chunk.kept:
                # a run starts at its first parameter, where that one's moments start
                moments = self.moments.run(first, span.stop - span.start)
                self._device_step(chunk, span, grad, moments, first["step"], group, grad_scale)
            else:
                grad = grad.reshape(-1)
                if stream is None or slot.chunk not in self._pieces:
                    pieces = [(span, None, self.moments.run(first, span.stop - span.start))]
                else:
                    pieces = stream.spans(slot.chunk, span)
                for part, master, moments in pieces:
                    self.moments.step(
                        chunk.fp32_home[part] if master is None else master,
                        grad[part.start - span.start : part.stop - span.start], moments,
                        step=step, lr=group["lr"], betas=group["betas"], eps=group["eps"],
                        weight_decay=group["weight_decay"], adamw=self.adamw,
                        grad_scale=grad_scale, out=_payload_out(chunk, part),
                    )  # fmt: skip
            if chunk.grads_in_payload:  # the copy-out overwrote the gradients in their room
                self.chunks.payload_written(chunk, [self._slots[id(p)] for p in params])
            touched.add(slot.chunk)
        return touched

    def _device_step(self, chunk, span: slice, grad, moments, step, group,
                     grad_scale: float) -> None:  # fmt: skip
        """A run of a chunk kept on the compute tier: torch's fused Adam where it lives, the
        low-precision compute copy rounded from the fp32 master after (when that tier is the
        CPU, the C++ kernel: same arithmetic, one pass, the copy written in it)."""
        param = chunk.fp32_home[span]
        grad = grad.reshape(-1)
        if self.device_kernel == "cpu":
            self.moments.step(
                param, grad, moments, step=int(step), lr=group["lr"], betas=group["betas"],
                eps=group["eps"], weight_decay=group["weight_decay"], adamw=self.adamw,
                grad_scale=grad_scale, out=_payload_out(chunk, span),
            )  # fmt: skip
            return
        if grad.dtype != torch.float32 or grad_scale != 1.0:  # the kernel wants fp32, unscaled
            grad = grad.float() * grad_scale if grad_scale != 1.0 else grad.float()
        self.moments.torch_step(
            param, grad, moments, step, lr=group["lr"], betas=group["betas"], eps=group["eps"],
            weight_decay=group["weight_decay"], adamw=self.adamw,
        )  # fmt: skip
        out = _payload_out(chunk, span)
        if out is not None:
            out.copy_(param)

    def _place(self) -> None:
        """Choose the device half once a training step was traced: the chunks used most often
        per step first (each kept one saves its loads), as many as the margin holds."""
        chunks = self.chunks
        moments = chunks.traced_step()
        if not moments:
            return
        lay = chunks.layout
        per_chunk = lay.kept_chunk_bytes(share_room=self.share_room,
                                         state_dtype=self.moments.state_dtype)  # fmt: skip
        uses: dict[int, int] = {}
        for moment in moments:
            uses[moment.chunk] = uses.get(moment.chunk, 0) + 1
        groups = self.data_parallel
        if groups is not None and groups.sharded:
            self._keep_groups(uses, per_chunk)
            return
        trainable = [c.id for c in chunks.own_trainable()]
        ranked = sorted(trainable, key=lambda c: (-uses.get(c, 0), c))
        self._keep(ranked[: chunks.margin(self.margin_use_ratio) // per_chunk])

    def _keep_groups(self, uses: dict[int, int], per_chunk: int) -> None:
        """Sharded payloads: every load is collective, so the ranks keep whole chunk groups,
        all alike: each holds the group's N payloads on the compute tier for good and, for
        its own chunk, the gradient, moments and master beside it (its step runs there); the
        owners' updates reach the others by a broadcast after each step. The margin is the
        least any rank has; groups with a frozen or padding chunk are not kept (the ranks'
        reserved bytes would differ, and with them their eviction choices)."""
        chunks = self.chunks
        groups = self.data_parallel
        lay = chunks.layout
        margin = groups.least(chunks.margin(self.margin_use_ratio))
        per_group = (groups.size - 1) * lay.chunk_bytes + per_chunk
        whole = [g for g in groups.groups(chunks.chunks)
                 if all(lay.chunks[c.id].trainable for c in g)]  # fmt: skip
        ranked = sorted(whole, key=lambda g: (-sum(uses.get(c.id, 0) for c in g), g[0].id))
        self._keep_whole_groups(ranked[: margin // per_group])

    def _keep_whole_groups(self, chosen: list[list[Chunk]]) -> None:
        """Keep these chunk groups on the compute tier on every rank (see _keep_groups)."""
        chunks = self.chunks
        self._placed = True
        if chosen:  # every rank from the same resident set: their loads below pair up
            chunks.drop_unused()
        gathered = chunks.load_unit > 1
        for group in chosen:
            # A group comes by one all-gather: each rank reserves its own chunk's room first
            # and then gathers, so every rank's arena takes the same blocks in the same order
            # (one that is fragmented raises on every rank alike). Chunk by chunk, each load
            # is a collective of its own: in chunk order on every rank.
            for chunk in sorted(group, key=lambda c: c.remote) if gathered else group:
                if chunk.remote:
                    chunks.keep(chunk.id)  # its payload, fetched from the owner, stays
                else:  # a fragmented arena raises here (chunk by chunk, the others then
                    self._keep_one(chunk.id)  # time out, named)

    def _keep(self, chunk_ids: list[int]) -> None:
        """Keep these chunks on the compute tier with their moments beside them."""
        self._placed = True
        for chunk_id in chunk_ids:
            reserved = self.chunks.reserved_count()
            try:
                self._keep_one(chunk_id)
            except MemoryError:  # the arena is fragmented: keep the rest on the host
                self.chunks.unreserve(self.chunks.reserved_count() - reserved)
                break

    def _keep_one(self, chunk_id: int) -> None:
        """Keep one chunk on the compute tier, its moments beside it (MemoryError when the
        arena has no block for them)."""
        chunks, n = self.chunks, self.chunks.layout.chunk_size
        chunk = chunks.chunk(chunk_id)
        block = chunks.reserve(self.moments.nbytes(n, [s.numel for s in chunk.slots]),
                               torch.uint8)  # fmt: skip
        chunks.keep(chunk_id, share_room=self.share_room, beside=(block,))
        self.device_chunks.append(chunk_id)
        views = self.moments.views(block, n, chunk.slots)
        if any(c is chunk for c in self._without_moments):  # no host moments: fresh here
            self._set_moments(chunk, views)
            return
        self._move_moments(chunk, views)  # the host buffer is let go

    def _move_moments(self, chunk: Chunk, views: list[dict[str, torch.Tensor]]) -> None:
        """The chunk's parameters' moments copied into these views (one per slot), which
        their state holds from now on."""
        for slot, moments in zip(chunk.slots, views, strict=True):
            state = self.state.get(self.chunks.param(slot))
            if not state or self.moments.keys[0] not in state:
                continue
            for key, moment in moments.items():
                moment.copy_(state[key])
                state[key] = moment

    def give_back(self, room: int) -> list[int]:
        """Kept chunks back to the host tier, the least used first, until what stays kept
        fits `room` compute-tier bytes: a plan with less room (a later, larger input) runs
        next. Their moments go to the host with them, and the host budget is checked first
        with the chunks that stay. Returns the chunks given back."""
        chunks = self.chunks
        if self.data_parallel is not None:  # one rank alone would leave the others' loads
            raise ChunkBudgetError(
                f"chunks {self.device_chunks} are kept on the compute tier for good with their "
                f"optimizer state (HybridAdam, {chunks.kept_bytes():,} bytes) and this input's "
                f"chunk plan leaves them {room:,} bytes; under data parallelism kept chunks do "
                "not go back to the host tier: run the largest input first (its first step "
                "decides what is kept), or set hybrid_adam=False"
            )
        stay, given = list(self.device_chunks), []
        total = chunks.kept_bytes()
        while stay and total > room:
            given.append(stay.pop())  # device_chunks: the most used first
            total -= chunks.kept_chunk_bytes(given[-1])
        if given and self.host_budget is not None:
            self.host_budget.check(stay)
        for chunk_id in given:
            self._give_back_one(chunk_id)
        self.device_chunks = stay
        self.given_back += given
        return given

    def _give_back_one(self, chunk_id: int) -> None:
        """One kept chunk back to the host tier, its moments into a host buffer of its own."""
        chunk = self.chunks.chunk(chunk_id)
        if self.disk is None:
            self._move_moments(chunk, self.moments.on_host(chunk.used, chunk.slots))
        else:  # to the disk tier, as the host chunks' moments are
            buffer = host_empty(self._moment_bytes(chunk), zero=True)
            self._move_moments(chunk, self.file_moments.views(buffer, chunk.used, chunk.slots))
            self.disk.add(chunk.id, MOMENTS, buffer.nbytes)
            self.disk.write(chunk.id, MOMENTS, buffer)
            self._detach(chunk)
            self._homed_on_disk(chunk)
        self.chunks.give_back(chunk_id)  # frees the moments' block too

    def state_dict(self) -> dict[str, Any]:
        """Torch's, plus which chunks are kept on the compute tier: a resumed run updates
        each chunk with the same kernel as the run it continues (bitwise resumption). The
        disk tier's moments are read into tensors of their own, a chunk at a time."""
        state = self.deferred_state_dict()
        entries = state["state"]
        places = [(index, key) for index, entry in entries.items()
                  for key, value in entry.items() if isinstance(value, DeferredTensor)]  # fmt: skip
        values = read_values([entries[index][key] for index, key in places])
        for (index, key), value in zip(places, values, strict=True):
            entries[index][key] = value
        return state

    def deferred_state_dict(self) -> dict[str, Any]:
        """`state_dict()` with the disk tier's moments as DeferredTensors, read a chunk at a
        time when they are written (runtime/deferred.py): what a checkpoint's save writes
        without holding them all in memory."""
        state = super().state_dict()
        # torch packs the state's own dicts: copies take the disk tier's moments
        state["state"] = {index: dict(entry) for index, entry in state["state"].items()}
        if self.on_disk:
            index_of: dict[int, int] = {}
            for param in (p for g in self.param_groups for p in g["params"]):
                index_of.setdefault(id(param), len(index_of))  # torch's numbering
            disk = self._disk_moments()
            for chunk in disk.chunks.values():
                for slot, moments in zip(chunk.slots, disk.deferred(chunk), strict=True):
                    entry = state["state"].get(index_of.get(id(self.chunks.param(slot))))
                    if entry is not None:
                        entry.update(moments)
        state["fxstar_device_chunks"] = list(self.device_chunks) if self._placed else None
        groups = self.data_parallel  # chunk ids name chunks of a layout of this size
        state["fxstar_data_parallel"] = groups.size if groups is not None else 1
        return state

    def _disk_moments(self) -> DiskMoments:
        """The disk-homed chunks' moments, a chunk at a time (checkpoints)."""
        return DiskMoments(self.disk, MOMENTS, self.file_moments,
                           [self.chunks.chunk(c) for c in self.on_disk])  # fmt: skip

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Torch's loading replaces state tensors; copy the values into the chunks instead."""
        state_dict = dict(state_dict)
        device_chunks = state_dict.pop("fxstar_device_chunks", None)
        groups = self.data_parallel
        size = groups.size if groups is not None else 1
        if state_dict.pop("fxstar_data_parallel", 1) != size:  # another layout's chunk ids
            device_chunks = None  # the device half is chosen again at the next step
        if self.hybrid and device_chunks is not None and not self._placed:
            # a data-parallel checkpoint holds every rank's kept chunks (DataParallelRanks.read)
            if groups is not None and groups.sharded:  # whole groups, every rank alike
                every = groups.groups(self.chunks.chunks)
                self._keep_whole_groups(
                    [every[i] for i in sorted({c // size for c in device_chunks})]
                )
            else:  # each rank its own
                self._keep([c for c in device_chunks if self.chunks.owns(c)])
        self._host_moments()  # the chunk-long moments the loaded values go into
        self._load_moments(state_dict)

    def _load_moments(self, state_dict: dict[str, Any]) -> None:
        """A parameter the saved state has no entry for was saved before its first update
        (torch's optimizers make state at a parameter's first step): its moments start again
        from zero, as a new optimizer's, not left as this run's."""
        own = {id(p): (p, dict(s)) for p, s in self.state.items()}
        # the moments bypass torch's loading, which would cast each to its parameter's dtype
        # first (8-bit codes to fp32: 4 bytes of host memory where the state keeps 1)
        state_dict, saved = _moments_apart(state_dict)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        moments_of = {id(p): saved[i] for i, p in zip(ids, params, strict=False) if i in saved}
        super().load_state_dict(state_dict)
        loaded = {id(p): s for p, s in self.state.items()}
        for param, entry in list(self.state.items()):
            if id(param) in own:
                continue
            if id(param) in self._in_chunks:
                del self.state[param]  # data parallel: another rank's chunk, its owner's state
            else:
                entry.update(moments_of.get(id(param), {}))
        # what each of this rank's parameters gets: its saved moments, or None (fresh)
        restored = {i: moments_of.get(i, {}) if i in loaded else None for i in own}
        on_disk = set(self.on_disk)
        for param_id, (param, chunked) in own.items():
            slot = self._slots.get(param_id)  # None: a parameter outside the chunks
            if slot is None or slot.chunk not in on_disk:  # the disk tier's: below
                self._restore(chunked, restored[param_id])
            step = loaded[param_id]["step"] if param_id in loaded else 0
            chunked["step"] = torch.as_tensor(step, dtype=torch.float32).clone()
            self.state[param] = chunked
        if on_disk:
            self._load_disk_moments(restored)

    def _restore(self, moments: dict[str, torch.Tensor], saved: dict[str, Any] | None) -> None:
        """Saved moments into a parameter's own tensors; None: none saved, zeros (fresh)."""
        if saved is not None:
            self.moments.load(moments, saved)
            return
        for key in MOMENT_KEYS:
            if key in moments:
                moments[key].zero_()

    def _load_disk_moments(self, restored: dict[int, dict[str, Any] | None]) -> None:
        """What `restored` gives the disk-homed chunks' parameters (by id(param): saved
        moments, or None for zeros) into their parts, a chunk at a time."""

        def load(chunk: Chunk, views: list[dict[str, torch.Tensor]]) -> None:
            for slot, moments in zip(chunk.slots, views, strict=True):
                param_id = id(self.chunks.param(slot))
                if param_id in restored:
                    self._restore(moments, restored[param_id])

        self._disk_moments().rewrite(self.on_disk, load)

    def state_bytes(self) -> dict[str, tuple[int, int]]:
        """Per tier ('host', 'compute'): the bytes of both moments of this rank's parameters
        there, as laid out (before the first step: as they will be), and the parameter
        elements they are of."""
        held = {"host": [0, 0], "compute": [0, 0], "disk": [0, 0]}
        for group in self.param_groups:
            for param in group["params"]:
                if id(param) not in self._in_chunks:
                    held["host"][0] += self.moments.nbytes(param.numel(), [param.numel()])
                    held["host"][1] += param.numel()
        for chunk in self.chunks.own_trainable():
            numels = [s.numel for s in chunk.slots]
            tier = "compute" if chunk.kept else "host" if self.disk is None else "disk"
            length = self.chunks.layout.chunk_size if chunk.kept else chunk.used
            held[tier][0] += self.moments.nbytes(length, numels)
            held[tier][1] += self._stepped_numel(chunk)
        return {tier: (nbytes, params) for tier, (nbytes, params) in held.items()}

    def _stepped_numel(self, chunk: Chunk) -> int:
        """The elements of the chunk's parameters this optimizer steps."""
        return sum(s.numel for s in chunk.slots if id(self.chunks.param(s)) in self._slots)

    def _masters_by_tier(self) -> dict[str, int]:
        """The parameters whose fp32 masters each tier holds: a kept chunk's on the compute
        tier, a disk-homed chunk's on the disk tier when plan.disk holds masters, else the
        host's."""
        held: dict[str, int] = {}
        for chunk in self.chunks.own_trainable():
            if chunk.kept:
                tier = "compute"
            elif self.disk is not None and self.disk.has(chunk.id, MASTER_PART):
                tier = "disk"
            else:
                tier = "host"
            held[tier] = held.get(tier, 0) + self._stepped_numel(chunk)
        return held

    def describe_state(self) -> str:
        """The report's line: the moments' format and their bytes per parameter on each
        tier."""
        tiers = [f"{nbytes:,} bytes on the {tier} tier for {params:,} parameters "
                 f"({nbytes / params:.3g} per parameter)"
                 for tier, (nbytes, params) in self.state_bytes().items() if params]  # fmt: skip
        line = f"optimizer state: {self.moments.state_dtype} Adam moments, " + (
            " and ".join(tiers) or "none"
        )
        if self.chunks.layout.dtype != torch.float32:
            line += "; the fp32 masters take 4 bytes per parameter " + " and ".join(
                f"on the {tier} tier ({params:,} parameters)"
                for tier, params in self._masters_by_tier().items()
            )
        if self.disk is not None:
            kept = (
                f"; kept on the compute tier: chunks {self.device_chunks}"
                if self.device_chunks
                else ""
            )
            line += (f"\nmoments on the disk tier: chunks {sorted(self.on_disk)}{kept}\n"
                     + self.disk.describe())  # fmt: skip
        return line


def _moments_apart(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[Any, dict]]:
    """A state dict without its per-parameter moments, and those moments by saved index."""
    saved: dict[Any, dict] = {}
    state = {}
    for index, entry in state_dict.get("state", {}).items():
        saved[index] = {k: v for k, v in entry.items() if k in MOMENT_KEYS}
        state[index] = {k: v for k, v in entry.items() if k not in MOMENT_KEYS}
    return {**state_dict, "state": state}, saved


def _payload_out(chunk: Chunk, span: slice) -> torch.Tensor | None:
    """Where an update of a bf16/fp16 chunk's fp32 master is rounded into: its payload (on
    the host, or its compute copy when kept); None for an fp32 chunk, whose payload it is."""
    return chunk.payload[span] if chunk.master is not None else None
