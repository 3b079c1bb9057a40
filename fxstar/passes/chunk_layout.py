"""chunk_layout (analysis): which parameter lives in which chunk, at which offset.

Parameters are packed in the order the export graph first uses them (not `named_parameters`
order; Llama's norms differ), so a forward pass walks the chunks in order. A tied parameter is
stored once. Frozen parameters (`requires_grad=False`) go to chunks of their own, which get no
gradient space. `chunk_size="auto"` searches the size that wastes least while holding the
largest parameter and letting every set of chunks one op needs at once, plus one more, fit in
the chunk share of the budget (Colossal-AI Gemini searches chunk sizes the same way).
The layout is decided once per engine and shared by every capture.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import fx

from fxstar.dump import NOTES_KEY
from fxstar.errors import FxstarError
from fxstar.passes import Pass, register
from fxstar.passes.checkpoint import region_calls, region_inputs
from fxstar.passes.checkpoint_regions import DECISION_KEY
from fxstar.passes.shape_memory import ShapeMemory, backward_peak, node_steps
from fxstar.plan import mark_implemented
from fxstar.program import ParamInfo, Program
from fxstar.runtime.layout import ChunkLayout, ChunkSpec, ParamSlot
from fxstar.sizes import format_size

mark_implemented("device_memory", "chunk_size", "static_partition", "warmup_gpu_chunk_mem_ratio",
                 "mem_cache", "async_mem_monitor", "overlap_grad_copies")  # fmt: skip

LAYOUT_KEY = "chunk_layout"  # Program.shared and Program.meta key
# options that configure the chunk engine, which runs only when the plan sets a budget
CHUNK_OPTIONS = ("chunk_size", "static_partition", "warmup_gpu_chunk_mem_ratio", "mem_cache",
                 "async_mem_monitor", "overlap_grad_copies")  # fmt: skip
SEARCH_STEPS = 256  # candidate chunk sizes tried by the auto search


class ChunkLayoutError(FxstarError, ValueError):
    """No chunk size satisfies the plan."""


def uses_chunks(plan) -> bool:
    """A budget pages parameters through chunks; bf16/fp16 keep their low-precision copies and
    fp32 masters in chunks too (all resident when there is no budget)."""
    return plan.device_memory is not None or plan.precision != "fp32"


def check_chunk_options(plan) -> None:
    """An option of the chunk engine without device_memory would do nothing: say so."""
    if uses_chunks(plan):
        return
    used = [name for name in plan.used_options() if name in CHUNK_OPTIONS]
    if used:
        raise ChunkLayoutError(
            f"{', '.join(used)}: configure{'s' if len(used) == 1 else ''} the chunk engine, "
            "which runs only with device_memory set; set device_memory or drop them"
        )


def budget_bytes(program: Program) -> int | None:
    """The compute tier's budget in bytes; None when the plan sets none (all stays resident)."""
    return program.plan.resolve_size("device_memory", program.param_bytes)


def nonmodel_peak(program: Program) -> int:
    """The peak of activations in backward (saved ones plus what each gradient allocates):
    what the budget must hold besides chunks at its fullest. A checkpointed region's
    recomputation is invisible in the rewritten graph; checkpoint_regions estimated it."""
    peak = backward_peak(list(node_steps(program.graph_module.graph.nodes).values()))
    decision = program.meta.get(DECISION_KEY)
    if decision is not None and decision.estimate is not None:
        peak = max(peak, decision.estimate)
    return peak


def params_per_node(program: Program) -> list[tuple[str, ...]]:
    """The parameters each node reads directly, for nodes that read more than one; inside a
    checkpointed region for its nodes (the region fetches its parameters itself)."""
    owner = {ph: p.name for p in program.params for ph in p.placeholders if not p.host_resident}
    regions = dict(region_calls(program.graph_module))
    out = []

    def scan(nodes, owner_of):
        for node in nodes:
            if node in regions:
                region = regions[node]
                _, inputs = region_inputs(node)
                placeholders = [n for n in region.graph.nodes if n.op == "placeholder"]
                inner = {ph.name: owner_of[a.name] for a, ph in zip(inputs, placeholders)
                         if isinstance(a, fx.Node) and a.name in owner_of}  # fmt: skip
                scan(region.graph.nodes, inner)
                continue
            names = {owner_of[a.name] for a in node.all_input_nodes if a.name in owner_of}
            if len(names) > 1:
                out.append(tuple(names))

    scan(program.graph_module.graph.nodes, owner)
    return out


def chunks_per_node(reads: list[tuple[str, ...]], chunk_of: dict[str, int]) -> int:
    """The most chunks any single node reads at once (a bias and its weight may straddle)."""
    return max((len({chunk_of[n] for n in names}) for names in reads), default=1)


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


def keep_bytes_per_element(program: Program, itemsize: int) -> int | None:
    """What HybridAdam's device half holds per element of a chunk it keeps on the compute
    tier (payload, gradient, two fp32 moments, an fp32 master under bf16/fp16), or None when
    it will keep none (off, another optimizer, a static partition, no budget)."""
    plan = program.plan
    if not (plan.hybrid_adam and plan.device_memory is not None and not plan.static_partition
            and plan.optimizer.type in ("adam", "adamw")):  # fmt: skip
        return None
    return 2 * itemsize + 8 + (4 if itemsize < 4 else 0)


def search_chunk_size(program: Program, params: Sequence[ParamInfo], share: int) -> int:
    """The candidate size with the least unused space among those whose busiest op's chunks,
    plus one, fit in `share`; with HybridAdam's device half, first among those small enough
    that the room left (times margin_use_ratio) can keep at least one chunk there."""
    itemsize = params[0].dtype.itemsize
    largest = max(p.numel for p in params)
    total = sum(p.numel for p in params)
    step = max(1, (total - largest) // SEARCH_STEPS)
    reads = params_per_node(program)
    keep_bytes = keep_bytes_per_element(program, itemsize)
    best: tuple[bool, int, int, int] | None = None  # (not keepable, wasted, count, size)
    size = largest
    while size <= max(total, largest):
        chunks = pack(params, size)
        chunk_of = {p.name: i for i, c in enumerate(chunks) for p, _ in c}
        need = (chunks_per_node(reads, chunk_of) + 1) * size * itemsize
        if need <= share:
            wasted = len(chunks) * size - total
            margin = program.plan.margin_use_ratio * (share - need)
            keepable = keep_bytes is not None and margin >= size * keep_bytes
            key = (not keepable, wasted, len(chunks), size)
            best = key if best is None or key < best else best
        size += step
    if best is None:
        raise ChunkLayoutError(
            f"no chunk size fits: the largest parameter has {largest:,} elements, and two "
            f"chunks of that size need {2 * largest * itemsize:,} bytes, but the chunk share "
            f"is {share:,} bytes (device_memory minus {format_size(nonmodel_peak(program))} "
            "of activations and temporaries). Raise device_memory, checkpoint activations, "
            "or tile the largest linears."
        )
    return best[3]


def plan_layout(program: Program) -> ChunkLayout:
    params = [p for p in program.params if not p.host_resident]  # cpu_embedding keeps some out
    dtypes = sorted({str(p.dtype) for p in params})
    if len(dtypes) != 1:
        raise ChunkLayoutError(f"chunks hold one dtype; the parameters have {dtypes}")
    dtype = params[0].dtype
    chunk_size = program.plan.chunk_size
    if chunk_size == "auto":
        budget, plan = budget_bytes(program), program.plan
        if budget is None:
            share = float("inf")
        elif plan.static_partition:  # PatrickStar's fixed share of the budget
            share = plan.warmup_gpu_chunk_mem_ratio * budget
        else:
            share = budget - nonmodel_peak(program)
        chunk_size = search_chunk_size(program, params, share)
    largest = max(params, key=lambda p: p.numel)
    if chunk_size < largest.numel:
        raise ChunkLayoutError(
            f"chunk_size: {chunk_size:,} elements cannot hold {largest.name} "
            f"({largest.numel:,} elements); use at least that, or 'auto'"
        )
    specs = []
    for i, members in enumerate(pack(params, chunk_size)):
        spec = ChunkSpec(i)
        for p, offset in members:
            spec.params.append(ParamSlot(p.name, p.aliases, i, offset, p.shape, p.requires_grad))
            spec.used += p.numel
        specs.append(spec)
    return ChunkLayout(chunk_size, dtype, specs)


@register
class ChunkLayoutPass(Pass):
    """Analysis: writes the ChunkLayout to Program.meta/shared, chunk and offset to the
    parameter table and to each parameter placeholder's notes."""

    name = "chunk_layout"
    requires = ("shape_memory",)

    def enabled_by(self, plan) -> bool:
        return uses_chunks(plan)

    def __call__(self, program: Program) -> Program:
        if program.stages[-1].name != "shape_memory":
            # a rewrite ran since the activations were measured (checkpointing shrinks them):
            # the budget is planned on the graph as it is now
            ShapeMemory()(program)
        layout = program.shared.get(LAYOUT_KEY)
        if layout is None:
            layout = program.shared[LAYOUT_KEY] = plan_layout(program)
        program.meta[LAYOUT_KEY] = layout
        slots = layout.slots()
        nodes = {n.name: n for n in program.graph_module.graph.nodes}
        for info in program.params:
            if info.host_resident:
                continue
            slot = slots[info.name]
            info.chunk, info.chunk_offset = slot.chunk, slot.offset
            for ph in info.placeholders:
                nodes[ph].meta.setdefault(NOTES_KEY, {})["chunk"] = f"{slot.chunk}+{slot.offset}"
        return program


__all__ = ["LAYOUT_KEY", "ChunkLayoutError", "ChunkLayoutPass", "plan_layout"]
