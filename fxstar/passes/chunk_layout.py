"""chunk_layout (analysis): which parameter lives in which chunk, at which offset.

Parameters are packed in the order the export graph first uses them (not `named_parameters`
order; Llama's norms differ), so a forward pass walks the chunks in order. A tied parameter is
stored once. Frozen parameters (`requires_grad=False`) go to chunks of their own, which get no
gradient space. The layout is decided once per engine and shared by every capture.

`chunk_size="auto"` tries every distinct packing, each at the least size that makes it, and
asks chunk_schedule's AccessForecast what each access of the step would pin (a checkpointed
region's recomputation pins all of its chunks at once). A size fits when at every access its
chunks fit their share of the budget (`chunk_share`). Among those that fit: room for one more
chunk at the busiest access first, then sizes of which HybridAdam can keep one on the compute
tier, then the least unused space (Colossal-AI Gemini searches chunk sizes the same way). The
least budget any size fits is the plan's smallest device_memory: errors print it, and
`device_memory="auto"` takes it on a CPU-only machine (for the first capture: a later one gets
its own, chunk_schedule.capture_budget).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from fxstar.dump import note
from fxstar.errors import FxstarError
from fxstar.passes import Pass, register
from fxstar.passes.shape_memory import backward_peak, node_steps
from fxstar.program import ParamInfo, Program
from fxstar.runtime.arena import ALIGNMENT as ARENA_ALIGNMENT
from fxstar.runtime.layout import AccessPlan, ChunkLayout, ChunkSpec, ParamSlot
from fxstar.sizes import Share, format_size
from fxstar.topology import Topology

# options that configure the chunk engine, which runs only when the plan sets a budget
CHUNK_OPTIONS = ("chunk_size", "static_partition", "warmup_gpu_chunk_mem_ratio", "mem_cache",
                 "async_mem_monitor", "overlap_grad_copies", "prefetch", "grads_in_host",
                 "host_memory", "overall_cpu_mem_ratio", "overall_gpu_mem_ratio",
                 "fake_dist")  # fmt: skip


class ChunkLayoutError(FxstarError, ValueError):
    """No chunk size satisfies the plan."""


def check_chunk_options(plan) -> None:
    """An option of the chunk engine without device_memory would do nothing: say so."""
    if Topology(plan).uses_chunks:
        return
    # release_after_init too: the engine implements it, on the chunk homes
    used = [name for name in plan.used_options()
            if name in (*CHUNK_OPTIONS, "release_after_init")]  # fmt: skip
    if used:
        raise ChunkLayoutError(
            f"{', '.join(used)}: configure{'s' if len(used) == 1 else ''} the chunk engine, "
            "which runs only with device_memory set; set device_memory or drop them"
        )


def budget_bytes(program: Program) -> int | None:
    """The compute tier's budget in bytes; None when the plan sets none (all stays resident).
    device_memory='auto' is the budget chunk_layout settled on for the engine."""
    if program.plan.device_memory == "auto":
        return program.engine_decisions.auto_budget
    budget = program.plan.resolve_size("device_memory", program.param_bytes)
    return None if budget is None else budget // fake_ranks(program)


def fake_ranks(program: Program) -> int:
    """fake_dist: the data-parallel ranks that share one device, each with its part of the
    budget (1 without it); on a 2-D mesh every rank of the world shares it."""
    if not program.plan.fake_dist:
        return 1
    topology = program.topology
    ranks = topology.data_parallel_size
    if ranks > 1:
        ranks = topology.mesh.world
    if ranks == 1:
        raise ChunkLayoutError(
            "fake_dist: gives each of N data-parallel ranks on one device 1/N of device_memory; "
            "this process is not one of several ranks: launch N of them (torchrun "
            "--nproc-per-node N) or drop fake_dist"
        )
    return ranks


def nonmodel_peak(program: Program) -> int:
    """The peak of activations in backward (saved ones plus what each gradient allocates), the
    figure estimate() reports; budgets are planned per access, on chunk_schedule's estimates.
    A checkpointed region's recomputation is invisible in the rewritten graph;
    checkpoint_regions estimated it."""
    peak = backward_peak(list(node_steps(program.graph_module.graph.nodes).values()))
    decision = program.decisions.checkpoint_regions
    if decision is not None and decision.estimate is not None:
        peak = max(peak, decision.estimate)
    return peak


def static_share(plan, budget: int) -> int | None:
    """PatrickStar's fixed share of the budget for chunks under static_partition, else None."""
    return int(plan.warmup_gpu_chunk_mem_ratio * budget) if plan.static_partition else None


def chunk_share(plan, budget: int, nonmodel: int) -> int:
    """Bytes the chunks may hold at a moment with `nonmodel` bytes of activations besides them.
    The one formula of the chunks' room: the schedule's check, the auto search and the
    smallest budget all go through it."""
    static = static_share(plan, budget)
    return budget - nonmodel if static is None else static


def smallest_budget(plan, chunk_bytes: int, nonmodel: int) -> int:
    """The least device_memory whose chunk_share holds `chunk_bytes` beside `nonmodel`: the
    inverse of chunk_share, settled on chunk_share itself (the static ratio is a float)."""
    static = plan.warmup_gpu_chunk_mem_ratio if plan.static_partition else None
    budget = chunk_bytes + nonmodel if static is None else math.ceil(chunk_bytes / static)
    while budget > 0 and chunk_share(plan, budget - 1, nonmodel) >= chunk_bytes:
        budget -= 1
    while chunk_share(plan, budget, nonmodel) < chunk_bytes:
        budget += 1
    return budget


@dataclass(frozen=True)
class BudgetNeed:
    """The smallest device_memory an access plan fits, and the moment that sets it."""

    device_memory: int
    chunk_size: int  # elements
    chunk_bytes: int
    access: int  # index into the access plan
    phase: str
    chunk: int
    chunks_at_once: int
    activations: int  # bytes besides chunks expected at that access
    static_ratio: float | None  # warmup_gpu_chunk_mem_ratio under static_partition
    load_unit: int = 1  # chunks a load brings (Topology.load_unit): a whole group with sharded DP
    staging: int = 0  # gradient staging held all step (sharded data parallel: staging_bytes)

    def moment(self) -> str:
        """Which access sets the need, and what it holds there."""
        count = self.chunks_at_once
        staged = (f" and {format_size(self.staging)} of data-parallel gradient staging"
                  if self.staging else "")  # fmt: skip
        where = (
            f"beside about {format_size(self.activations)} of activations and temporaries{staged}"
            if self.static_ratio is None
            else f"in the static partition (warmup_gpu_chunk_mem_ratio {self.static_ratio:g})"
        )
        groups = (f" ({count // self.load_unit} whole groups of {self.load_unit}: a load "
                  "brings its chunk's group)" if self.load_unit > 1 else "")  # fmt: skip
        return (
            f"access {self.access} ({self.phase}, chunk {self.chunk}) needs {count} "
            f"chunk{'s' if count != 1 else ''} of {format_size(self.chunk_bytes)} at once"
            f"{groups} ({format_size(count * self.chunk_bytes)}) {where}"
        )

    def describe(self) -> str:
        return (
            f"with chunk_size {self.chunk_size:,}, {self.moment()}; the smallest device_memory "
            f"for this plan is {format_size(self.device_memory)} ({self.device_memory:,} bytes)"
        )

    def remedy(self, auto: bool = False) -> str:
        """What to change; `auto`: the plan's device_memory is 'auto' already, which on a
        card is its memory times overall_gpu_mem_ratio."""
        other = ("raise warmup_gpu_chunk_mem_ratio" if self.static_ratio is not None
                 else "checkpoint activations")  # fmt: skip
        if self.load_unit > 1:
            other += ", set mem_saving_comm=True (a load brings one chunk, not its group)"
        if auto:
            return (f"device_memory='auto' is the device's memory times overall_gpu_mem_ratio: "
                    f"raise overall_gpu_mem_ratio, {other}")  # fmt: skip
        return f"Raise device_memory to at least that (device_memory='auto' does), {other}"


def shown_budget(plan, budget: int) -> str:
    """device_memory as given and in bytes: a share is of the parameter bytes alone, while the
    budget must hold the activations too."""
    text = f"{format_size(budget)} ({budget:,} bytes)"
    given = plan.device_memory
    return f"{given} of the parameter bytes = {text}" if isinstance(given, Share) else text


def staging_bytes(program: Program, layout: ChunkLayout) -> int:
    """Compute-tier bytes besides chunks and activations all step: sharded data-parallel
    payloads stage gradients there (runtime/grad_shards.py), at most this much at once."""
    ranks = program.topology.data_parallel_size  # the chunk-size search's layouts are ungrouped
    if ranks == 1 or not program.topology.sharded_payloads:
        return 0
    return layout.staging_bytes(ranks, mem_saving=program.plan.mem_saving_comm)


def budget_need(program: Program, access: AccessPlan, layout: ChunkLayout) -> BudgetNeed:
    """The least budget under which every access of `access` fits its chunk_share beside
    the gradient staging (under `program`'s plan and topology)."""
    plan, size = program.plan, layout.chunk_bytes
    block = -(-size // ARENA_ALIGNMENT) * ARENA_ALIGNMENT  # the arena rounds each block up
    staging = staging_bytes(program, layout)
    # moments with the same chunks and activations need the same: each pair once
    first = {}
    for t, pair in enumerate(zip(access.pinned_at_once, access.nonmodel_bytes, strict=True)):
        first.setdefault(pair, t)
    budgets = {t: smallest_budget(plan, pinned * block, nonmodel + staging)
               for (pinned, nonmodel), t in first.items()}  # fmt: skip
    t = max(budgets, key=lambda t: (budgets[t], -t), default=None)
    if t is None:  # nothing is ever fetched
        return BudgetNeed(0, layout.chunk_size, size, 0, "forward", 0, 0, 0, None)
    return BudgetNeed(
        budgets[t], layout.chunk_size, size, t, access.phases[t], access.chunks[t],
        access.pinned_at_once[t], access.nonmodel_bytes[t],
        plan.warmup_gpu_chunk_mem_ratio if plan.static_partition else None,
        program.topology.load_unit, staging,
    )  # fmt: skip


def pack(params: Sequence[ParamInfo], chunk_size: int) -> list[list[tuple[ParamInfo, int]]]:
    """First fit in order: a parameter that does not fit the open chunk starts the next one.
    Trainable and frozen parameters fill separate chunks."""
    chunks: list[list[tuple[ParamInfo, int]]] = []
    open_chunk: dict[bool, int] = {}  # requires_grad -> index of its open chunk
    used: list[int] = []
    for p in params:
        i = open_chunk.get(p.requires_grad)
        if i is None or used[i] + p.numel > chunk_size:
            chunks.append([])
            used.append(0)
            i = open_chunk[p.requires_grad] = len(chunks) - 1
        chunks[i].append((p, used[i]))
        used[i] += p.numel
    return chunks


def make_layout(params: Sequence[ParamInfo], chunk_size: int) -> ChunkLayout:
    specs = []
    for i, members in enumerate(pack(params, chunk_size)):
        spec = ChunkSpec(i)
        for p, offset in members:
            spec.params.append(ParamSlot(p.name, p.aliases, i, offset, p.shape, p.requires_grad))
            spec.used += p.numel
        specs.append(spec)
    return ChunkLayout(chunk_size, params[0].dtype, specs)


@dataclass(frozen=True)
class Candidate:
    """One distinct first-fit packing at the least chunk size that makes it, described by the
    figures the search ranks it by; the layout itself is built only for the few it judges."""

    chunk_size: int  # elements
    chunks: int
    wasted_bytes: int


class Packings:
    """First-fit packings of `params` at any chunk size, computed from running sums: a chunk
    ends where the sum passes the size (a bisection), so a packing costs its chunk count, not
    the parameter count, and all of a deep model's candidates stay cheap to list."""

    def __init__(self, params: Sequence[ParamInfo]):
        self.params = params
        self.itemsize = params[0].dtype.itemsize
        # trainable and frozen parameters fill separate chunks: one stream of each kind
        self.streams: list[tuple[list[int], list[int]]] = []  # (param indices, running sums)
        for kind in (True, False):
            indices = [i for i, p in enumerate(params) if p.requires_grad is kind]
            if indices:
                sums = [0]
                for i in indices:
                    sums.append(sums[-1] + params[i].numel)
                self.streams.append((indices, sums))

    def chunks(self, size: int) -> list[tuple[int, int, int]]:
        """pack(params, size) as (index of its first parameter, used elements, the first
        parameter's numel of the stream's next chunk or None), in chunk order."""
        out = []
        for indices, sums in self.streams:
            start, count = 0, len(indices)
            while start < count:
                end = bisect.bisect_right(sums, sums[start] + size, start + 1) - 1
                following = self.params[indices[end]].numel if end < count else None
                out.append((indices[start], sums[end] - sums[start], following))
                start = end
        out.sort()
        return out

    def candidates(self) -> Iterator[Candidate]:
        """Every distinct first-fit packing, each at the least chunk size that makes it, in
        increasing size: any size in between packs the same way with more room unused, so no
        other size can do better. A packing changes only where a parameter that started a
        chunk would fit the one before."""
        size: int | None = max(p.numel for p in self.params)
        while size is not None:
            tight = max(used for _, used, _ in self.chunks(size))
            chunks = self.chunks(tight)
            used = sum(u for _, u, _ in chunks)
            yield Candidate(tight, len(chunks), (len(chunks) * tight - used) * self.itemsize)
            size = min((u + following for _, u, following in chunks if following is not None),
                       default=None)  # fmt: skip


def candidate_layouts(params: Sequence[ParamInfo]) -> list[ChunkLayout]:
    """The layout of every candidate packing (Packings.candidates), in increasing size."""
    return [make_layout(params, c.chunk_size) for c in Packings(params).candidates()]


def keep_bytes_per_element(program: Program, itemsize: int) -> int | None:
    """What HybridAdam's device half holds per element of a chunk it keeps on the compute
    tier (payload, gradient, two fp32 moments, an fp32 master under bf16/fp16), or None when
    it will keep none (off, another optimizer, a static partition, no budget)."""
    plan = program.plan
    if not (plan.hybrid_adam and plan.device_memory is not None and not plan.static_partition
            and plan.optimizer.type in ("adam", "adamw")):  # fmt: skip
        return None
    return 2 * itemsize + 8 + (4 if itemsize < 4 else 0)


def chunked_params(program: Program) -> list[ParamInfo]:
    params = [p for p in program.params if not p.host_resident]  # cpu_embedding keeps some out
    if not params:
        raise ChunkLayoutError(
            "the chunk engine pages parameters, and this model has none the graph reads"
            + (" outside cpu_embedding" if program.params else "")
            + ": drop device_memory (and bf16/fp16, which keep their masters in chunks) from "
            "the plan"
        )
    dtypes = sorted({str(p.dtype) for p in params})
    if len(dtypes) != 1:
        raise ChunkLayoutError(f"chunks hold one dtype; the parameters have {dtypes}")
    largest = max(params, key=lambda p: p.numel)
    chunk_size = program.plan.chunk_size
    if chunk_size != "auto" and chunk_size < largest.numel:
        raise ChunkLayoutError(
            f"chunk_size: {chunk_size:,} elements cannot hold {largest.name} "
            f"({largest.numel:,} elements); use at least that, or 'auto'"
        )
    return params


class LayoutSearch:
    """The chunk-size search over the candidate packings (the given chunk_size, or every
    candidate of 'auto'), judged by the access plans chunk_schedule would make. A layout's
    least budget is never below its lower bound: `load_unit` chunks (one load) beside the most
    bytes besides chunks that every layout's plan has at an access (AccessForecast.floor). The
    bound grows with the chunk size, and candidates come in increasing size, so the search
    stops at the first candidate whose bound cannot beat what it has: a deep model's hundreds
    of candidates cost a handful of forecasts. Needs the graph before chunk_schedule rewrites
    it."""

    def __init__(self, program: Program):
        from fxstar.passes.chunk_schedule import AccessForecast  # it imports this module

        self.program, self.plan = program, program.plan
        self.params = chunked_params(program)
        size = self.plan.chunk_size
        if size == "auto":
            self.candidates = list(Packings(self.params).candidates())
        else:
            layout = make_layout(self.params, size)
            self.candidates = [Candidate(size, len(layout.chunks), layout.wasted_bytes)]
        self.forecast = AccessForecast(self.program)
        self.floor = self.forecast.floor()
        self._judged: dict[int, tuple[ChunkLayout, BudgetNeed]] = {}  # by chunk size

    def judge(self, candidate: Candidate) -> tuple[ChunkLayout, BudgetNeed]:
        """The candidate's layout and the least budget its access plan fits."""
        if candidate.chunk_size not in self._judged:
            layout = make_layout(self.params, candidate.chunk_size)
            need = budget_need(self.program, self.forecast.plan(layout), layout)
            self._judged[candidate.chunk_size] = layout, need
        return self._judged[candidate.chunk_size]

    def lower_bound(self, candidate: Candidate) -> int:
        if self.floor is None:  # no access is certain: a layout may need nothing
            return 0
        chunk_bytes = candidate.chunk_size * self.params[0].dtype.itemsize
        unit = self.program.topology.load_unit
        return smallest_budget(self.plan, unit * chunk_bytes, self.floor)

    def smallest(self) -> BudgetNeed:
        """The least budget of any candidate (the smaller chunk size among equals)."""
        best: BudgetNeed | None = None
        for candidate in self.candidates:
            if best is not None and self.lower_bound(candidate) >= best.device_memory:
                break  # it and every larger candidate need at least as much, at a larger size
            _, need = self.judge(candidate)
            if best is None or (need.device_memory, need.chunk_size) < (
                best.device_memory, best.chunk_size
            ):  # fmt: skip
                best = need
        assert best is not None  # chunked_params refuses a model without parameters
        return best

    def least_waste(self) -> ChunkLayout:
        """Without a budget every chunk stays resident: the least unused space wins."""
        best = min(self.candidates, key=lambda c: (c.wasted_bytes, c.chunks, c.chunk_size))
        return make_layout(self.params, best.chunk_size)

    def choose(self, budget: int) -> ChunkLayout:
        """Among the layouts that fit `budget`: first those with room for one more chunk at
        their busiest moment (prefetch), then, with HybridAdam's device half, those of which
        the margin left (times margin_use_ratio) keeps at least one chunk, then the least
        unused space. Judged in the order of the unused space, so the first that has both
        kinds of room ends the search."""
        plan = self.plan
        keep_bytes = keep_bytes_per_element(self.program, self.params[0].dtype.itemsize)
        best_possible = (False, keep_bytes is None)
        bounded = itertools.takewhile(lambda c: self.lower_bound(c) <= budget, self.candidates)
        best, best_key = None, None
        for candidate in sorted(bounded, key=lambda c: (c.wasted_bytes, c.chunks, c.chunk_size)):
            layout, need = self.judge(candidate)
            if need.device_memory > budget:
                continue
            more = (need.chunks_at_once + 1) * layout.chunk_bytes
            roomy = smallest_budget(plan, more, need.activations) <= budget
            margin = plan.margin_use_ratio * (budget - need.device_memory)
            keepable = keep_bytes is not None and margin >= layout.chunk_size * keep_bytes
            key = (not roomy, not keepable, layout.wasted_bytes, len(layout.chunks),
                   layout.chunk_size)  # fmt: skip
            if best_key is None or key < best_key:
                best, best_key = layout, key
            if key[:2] == best_possible:
                break  # every later candidate wastes more (or as much in more chunks)
        if best is None:
            smallest = self.smallest()
            raise ChunkLayoutError(
                f"no chunk size fits device_memory {shown_budget(plan, budget)}: "
                f"{smallest.describe()}. {smallest.remedy(plan.device_memory == 'auto')}, or "
                "tile the largest linears."
            )
        return best


def auto_budget(program: Program, smallest: BudgetNeed) -> int:
    """device_memory='auto': a CUDA device's capacity times overall_gpu_mem_ratio; on a
    CPU-only machine the smallest budget the plan works with."""
    device = program.compute_device()  # the plan's, not the (host or meta) model's
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return int(total * program.plan.overall_gpu_mem_ratio) // fake_ranks(program)
    return smallest.device_memory


def plan_layout(program: Program) -> ChunkLayout:
    """The layout, and for device_memory='auto' the engine's budget (Program.engine_decisions);
    the smallest budget this plan works with goes to program.decisions.budget_need."""
    plan = program.plan
    search = LayoutSearch(program)
    smallest = program.decisions.budget_need = search.smallest()
    if plan.device_memory is None:  # no budget: every chunk stays resident, least waste wins
        return search.least_waste()
    if plan.device_memory == "auto":
        program.engine_decisions.auto_budget = auto_budget(program, smallest)
    if plan.chunk_size != "auto":
        return search.judge(search.candidates[0])[0]  # chunk_schedule checks it, with numbers
    return search.choose(budget_bytes(program))


@register
class ChunkLayoutPass(Pass):
    """Analysis: the ChunkLayout to program.decisions (and Program.engine_decisions, for later
    captures), chunk and offset to the parameter table and each placeholder's notes."""

    name = "chunk_layout"
    phase = "place"
    requires_fresh = ("shape_memory",)  # budgets are planned on the graph that will run
    after = ("cpu_embedding",)
    implements = ("device_memory", *CHUNK_OPTIONS)

    def enabled_by(self, plan) -> bool:
        return Topology(plan).uses_chunks

    def __call__(self, program: Program) -> Program:
        decided = program.engine_decisions
        layout = decided.chunk_layout
        if layout is None:  # data parallel: in groups of the ranks (runtime/data_parallel.py)
            layout = plan_layout(program).grouped(program.topology.data_parallel_size)
            decided.chunk_layout = layout
        program.decisions.chunk_layout = layout
        slots = layout.slots()
        nodes = {n.name: n for n in program.graph_module.graph.nodes}
        for info in program.params:
            if info.host_resident:
                continue
            slot = slots[info.name]
            info.chunk, info.chunk_offset = slot.chunk, slot.offset
            for ph in info.placeholders:
                note(nodes[ph], "chunk", f"{slot.chunk}+{slot.offset}")
        return program


__all__ = [
    "ChunkLayoutError",
    "ChunkLayoutPass",
    "plan_layout",
]
