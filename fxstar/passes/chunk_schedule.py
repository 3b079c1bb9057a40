"""chunk_schedule (rewrite): fetch each chunk before its parameters are first read, release it
after the last read of any of them or of any alias of them, and plan the step's accesses.

- A parameter placeholder becomes `ops.param(fetch, name)` on the views `ops.fetch(chunk)`
  returns; the placeholders go away (the chunk manager owns the parameters now).
- A release waits for the last use of every alias of a parameter (`t`, `view`, `expand`, a
  `split` piece...), found from the ops' schemas: releasing after the last direct use while a
  `w.t()` is read later would let the chunk be evicted under it.
- A chunk idle while two or more other chunks come and go (the tied embedding, read first and
  last) is released and fetched again rather than pinned all along: released, it is just one
  more candidate for eviction, and Belady keeps it if that is best.
- A checkpointed region gets its own fetch/release nodes, inside the region: its
  recomputation in backward fetches the chunks again.
- The access plan lists the chunk accesses in the order a step will make them: the fetches
  (a region's where it is called), then backward, where each node that saved parameters needs
  their chunks back and each region fetches again for its recomputation, in reverse order;
  with the bytes besides chunks expected at each one (from shape_memory). A moment whose
  chunks cannot fit the budget stops the compile here, with the numbers.
- Every capture of an engine shares its arena, made for the first one. Under
  device_memory='auto' on a CPU-only machine a later capture (a longer batch) gets the least
  budget it needs beside the chunks HybridAdam keeps on the compute tier, when the engine's is
  less (capture_budget); kept chunks a plan has no room for go back to the host tier before it
  runs (ChunkPlan.kept_room, the engine).
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field

import torch
from torch import fx

from fxstar.dump import note
from fxstar.errors import FxstarError
from fxstar.passes import Pass, register
from fxstar.passes.activation_checkpoint import region_calls, region_inputs
from fxstar.passes.chunk_layout import (
    budget_bytes,
    budget_need,
    shown_budget,
    staging_bytes,
    static_share,
)
from fxstar.passes.shape_memory import META_KEY
from fxstar.program import Program
from fxstar.runtime import ops
from fxstar.runtime.arena import ALIGNMENT as ARENA_ALIGNMENT
from fxstar.runtime.layout import AccessPlan, ChunkLayout, ChunkPlan, ParamSlot
from fxstar.sizes import format_size
from fxstar.topology import Topology

SPLIT_AFTER = 2  # other chunks used during an idle stretch that make a chunk be re-fetched


class ChunkScheduleError(FxstarError, MemoryError):
    """Some moment of the step needs more than the budget holds."""


@dataclass
class Segment:
    """A stretch of the graph during which a chunk stays fetched."""

    chunk: int
    start: int  # position of the first node that reads one of its parameters
    end: int  # position of the last node that reads one of them, or an alias
    users: list[tuple[fx.Node, fx.Node]] = field(default_factory=list)  # (user, placeholder)


def returns_alias(node: fx.Node, of: fx.Node) -> bool:
    """Does `node`'s output share memory with its input `of` (a view, per the op schema)?"""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True  # a piece of a list of views (split, unbind...)
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns or schema.returns[0].alias_info is None:
        return False
    if schema.returns[0].alias_info.is_write:
        return False
    for arg, value in zip(schema.arguments, node.args):
        if value is of and arg.alias_info is not None and not arg.alias_info.is_write:
            return True
    return False


def alias_end(user: fx.Node, of: fx.Node, pos: dict[fx.Node, int]) -> int:
    """The last position at which `user` or anything aliasing the placeholder through it is read."""
    end, stack = pos[user], [(user, of)]
    while stack:
        node, source = stack.pop()
        if not returns_alias(node, source):
            continue
        for later in node.users:
            if later.op != "output":
                end = max(end, pos[later])
                stack.append((later, node))
    return end


@dataclass(frozen=True)
class Use:
    """A node that reads a parameter placeholder, and how long the read lasts through aliases."""

    name: str  # the parameter
    start: int  # the user's position
    end: int  # alias_end: the last position reading it or an alias of it
    user: fx.Node
    placeholder: fx.Node


def param_uses(
    params: dict[fx.Node, str], pos: dict[fx.Node, int], skip: set[fx.Node] = frozenset()
) -> list[Use]:
    """Every read of the parameter placeholders `params` (node -> parameter name) of one graph
    whose nodes are numbered by `pos`; users in `skip` do not count (region calls, which fetch
    their own). They do not depend on the layout: the chunk-size search finds them once."""
    out = []
    for node, name in params.items():
        for user in node.users:
            if user in skip:
                continue
            if user.op == "output":
                raise ChunkScheduleError(
                    f"the model returns parameter {name} itself; chunked parameters "
                    "can only be read by the graph"
                )
            out.append(Use(name, pos[user], alias_end(user, node, pos), user, node))
    return out


def segments(
    params: dict[fx.Node, str],
    layout: ChunkLayout,
    pos: dict[fx.Node, int],
    skip: set[fx.Node] = frozenset(),
) -> list[Segment]:
    """Where each chunk must be fetched, for the parameter placeholders `params` (node ->
    parameter name) of one graph whose nodes are numbered by `pos`; users in `skip` do not
    count (region calls, which fetch their own)."""
    return segments_of(param_uses(params, pos, skip), layout.slots())


class BusyChunks:
    """Which chunks are read where: how many other chunks a stretch of the graph reads,
    counted up to a limit by walking the reads in order and skipping each run of one chunk's
    reads at once, so a query costs a bisection and a few steps, not one per chunk."""

    def __init__(self, reads: list[tuple[int, int]]):  # (position, chunk)
        reads.sort()
        self.positions = [p for p, _ in reads]
        self.chunks = [c for _, c in reads]
        count = len(reads)
        self.next_other = [count] * count  # the next read of a different chunk
        for j in range(count - 2, -1, -1):
            different = self.chunks[j + 1] != self.chunks[j]
            self.next_other[j] = j + 1 if different else self.next_other[j + 1]

    def between(self, chunk: int, a: int, b: int, limit: int) -> int:
        """How many chunks other than `chunk` are read strictly between positions a and b,
        counted up to `limit`."""
        others: set[int] = set()
        j = bisect.bisect_right(self.positions, a)
        while j < len(self.positions) and self.positions[j] < b and len(others) < limit:
            if self.chunks[j] != chunk:
                others.add(self.chunks[j])
            j = self.next_other[j]
        return len(others)


def segments_of(uses: list[Use], slots: dict[str, ParamSlot]) -> list[Segment]:
    """The segments of `uses` when each parameter lives in its slot's chunk."""
    by_chunk: dict[int, list[Use]] = {}
    for use in uses:
        by_chunk.setdefault(slots[use.name].chunk, []).append(use)
    busy = BusyChunks([(u.start, chunk) for chunk, items in by_chunk.items() for u in items])
    out = []
    for chunk, items in by_chunk.items():
        items.sort(key=lambda u: u.start)
        current: Segment | None = None
        for use in items:
            if current is None or (
                use.start > current.end
                and busy.between(chunk, current.end, use.start, SPLIT_AFTER) >= SPLIT_AFTER
            ):
                current = Segment(chunk, use.start, use.end)
                out.append(current)
            current.end = max(current.end, use.end)
            current.users.append((use.user, use.placeholder))
    return sorted(out, key=lambda s: (s.start, s.chunk))


def insert_fetches(
    gm: fx.GraphModule,
    segs: list[Segment],
    nodes: list[fx.Node],
    params: dict[fx.Node, str],
    runtime: ops.ChunkRuntime | None = None,
) -> None:
    """Fetch before each segment, the parameters' views in place of their placeholders, and a
    release after the segment's last read; the nodes call the module's ChunkRuntime."""
    if not segs:
        return
    graph = gm.graph
    manager = ops.runtime_node(gm, runtime)
    for seg in segs:
        first = nodes[seg.start]
        with graph.inserting_before(first):
            fetch = graph.create_node("call_function", ops.fetch, (manager, seg.chunk),
                                      name=f"chunk{seg.chunk}")  # fmt: skip
        views: dict[fx.Node, fx.Node] = {}
        for user, placeholder in seg.users:
            if placeholder not in views:
                with graph.inserting_before(first):
                    views[placeholder] = graph.create_node(
                        "call_function", ops.param, (fetch, params[placeholder]),
                        name=placeholder.name,
                    )  # fmt: skip
            user.replace_input_with(placeholder, views[placeholder])
        with graph.inserting_after(nodes[seg.end]):
            graph.call_function(ops.release, (manager, seg.chunk))


def parameter_placeholders(program: Program) -> dict[fx.Node, str]:
    """Placeholder -> parameter name, for the parameters that live in chunks."""
    kinds = program.placeholder_kinds()
    host = {alias for p in program.params if p.host_resident for alias in p.aliases}
    return {
        n: kinds[n.name].target
        for n in program.graph_module.graph.nodes
        if n.op == "placeholder"
        and n.name in kinds
        and kinds[n.name].kind == "parameter"
        and kinds[n.name].target not in host
    }


@dataclass
class Fetches:
    """chunk_schedule's decision: where each graph fetches and releases which chunk. A
    checkpointed region fetches its own (by submodule name): its recomputation in backward
    then fetches them again instead of reading views whose chunks were evicted since."""

    top: list[Segment]
    regions: dict[str, list[Segment]] = field(default_factory=dict)  # by region call's name
    region_params: dict[str, dict[fx.Node, str]] = field(default_factory=dict)  # placeholders


def decide(program: Program, layout: ChunkLayout) -> Fetches:
    """The segments of every graph, on the graphs as they are (nothing rewritten yet)."""
    top = parameter_placeholders(program)
    decision = Fetches(top=[])
    calls = set()
    for call, region in region_calls(program.graph_module):
        calls.add(call)
        _, args = region_inputs(call)
        placeholders = [n for n in region.graph.nodes if n.op == "placeholder"]
        inner = {placeholder: top[arg]
                 for arg, placeholder in zip(args, placeholders, strict=True)
                 if isinstance(arg, fx.Node) and arg in top}  # fmt: skip
        if inner:
            decision.region_params[call.name] = inner
            decision.regions[call.name] = segments(inner, layout, _positions(region.graph))
    # a region call stops reading the parameters it fetches itself
    decision.top = segments(top, layout, _positions(program.graph_module.graph), skip=calls)
    return decision


def rewrite(program: Program, layout: ChunkLayout, decision: Fetches) -> list[fx.Node]:
    """Regions first, then the top-level graph; returns the top-level nodes as they were
    before fetches were added (the positions the plan is estimated on)."""
    runtime = ops.runtime_of(program.graph_module)
    top = parameter_placeholders(program)
    for call, region in region_calls(program.graph_module):
        inner = decision.region_params.get(call.name)
        if not inner:
            continue
        insert_fetches(region, decision.regions[call.name], list(region.graph.nodes), inner,
                       runtime)  # fmt: skip
        for placeholder in inner:
            region.graph.erase_node(placeholder)
        first, args = region_inputs(call)  # the parameters stop being inputs of the region
        kept = [a for a in args if not (isinstance(a, fx.Node) and a in top)]
        call.args = (*call.args[:first], *kept)
    graph = program.graph_module.graph
    nodes = list(graph.nodes)
    params = parameter_placeholders(program)
    insert_fetches(program.graph_module, decision.top, nodes, params)
    program.remove_inputs(list(params))
    return nodes


def _positions(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def nonmodel_estimate(nodes: list[fx.Node]) -> dict[fx.Node, int]:
    """Bytes besides chunks while a node runs (and while its gradient runs): what earlier
    nodes saved for backward, plus its output or what its gradient allocates, the larger."""
    out, saved = {}, 0
    for node in nodes:
        mem = node.meta.get(META_KEY)
        if mem is not None:
            saved += mem.saved_bytes
        out[node] = saved + (max(mem.out_bytes, mem.backward_bytes) if mem is not None else 0)
    return out


def access_plan(gm: fx.GraphModule, layout: ChunkLayout, original: list[fx.Node],
                unit: int = 1) -> AccessPlan:  # fmt: skip
    """The step's accesses; `unit`: chunks one load brings (Topology.load_unit)."""
    plan = AccessPlan([], [], [], [])
    estimate = nonmodel_estimate(original)
    slots = layout.slots()
    regions = dict(region_calls(gm))

    def fetches(graph: fx.Graph, phase: str, nonmodel: int | None, outer: set[int]) -> None:
        """The fetches of a graph in order, a region's inline where it is called. In a
        recomputation nothing is released until the region's backward is done."""
        open_chunks = set(outer)
        for node in graph.nodes:
            if node.target is ops.fetch:
                open_chunks.add(node.args[1])
                plan.add(node.args[1], phase,
                         _next_original(node, estimate) if nonmodel is None else nonmodel,
                         open_chunks, unit)  # fmt: skip
            elif node.target is ops.release and phase == "forward":
                open_chunks.discard(node.args[1])
            elif node in regions:
                fetches(regions[node].graph, phase, estimate.get(node, 0), open_chunks)

    fetches(gm.graph, "forward", None, set())
    for node in reversed(original):  # backward, last node first
        if node in regions:  # recomputation: the region runs its forward, fetches included
            fetches(regions[node].graph, "backward", estimate.get(node, 0), set())
            continue
        mem = node.meta.get(META_KEY)
        needed = [slots[n].chunk for n in mem.saved_params] if mem is not None else []
        for chunk in needed:  # one access per saved tensor: each is unpacked
            plan.add(chunk, "backward", estimate[node], set(needed), unit)
    return plan


def _next_original(node: fx.Node, estimate: dict[fx.Node, int]) -> int:
    while node is not None and node not in estimate:
        node = node.next
    return estimate.get(node, 0)


def capture_budget(program: Program, plan: AccessPlan, layout: ChunkLayout) -> int | None:
    """The budget this capture runs under: the plan's. device_memory='auto' on a CPU-only
    machine is the least budget each capture needs: the engine's (what its first capture
    needed), or for a later capture that needs more (a longer batch) its own, beside the
    bytes HybridAdam keeps on the compute tier for good (EngineDecisions.kept_bytes). On a card
    'auto' is its capacity already."""
    budget = budget_bytes(program)
    if (budget is None or program.plan.device_memory != "auto"
            or program.compute_device().type != "cpu"):  # fmt: skip
        return budget
    need = budget_need(program, plan, layout).device_memory
    return max(budget, need + program.engine_decisions.kept_bytes)


def check_budget(plan: AccessPlan, layout: ChunkLayout, program: Program,
                 budget: int | None) -> None:  # fmt: skip
    """Every moment's chunks must fit their share of `budget`; the error names the moment
    that needs the most and the smallest device_memory this plan works with."""
    if budget is None:
        return  # no budget: every chunk stays resident
    need = budget_need(program, plan, layout)
    if need.device_memory > budget:
        auto = program.plan.device_memory == "auto"
        raise ChunkScheduleError(
            f"device_memory {shown_budget(program.plan, budget)} is too small: "
            f"{need.describe()}. {need.remedy(auto)}, or use a smaller chunk_size (or 'auto')."
        )


def check_arena(program: Program, plan: AccessPlan, layout: ChunkLayout, budget: int,
                arena: int) -> None:  # fmt: skip
    """A later capture runs in the engine's arena, made for the first: the chunks it uses at
    once must fit it (its activations are held to each moment's share by check_budget, on a
    card too: chunk blocks and activations share its allocator, arena.PooledBlocks)."""
    first = "made for the engine's first input; compile the engine with its largest input first"
    pinned = max(plan.pinned_at_once, default=0) * layout.chunk_bytes
    if pinned > arena:
        t = plan.pinned_at_once.index(max(plan.pinned_at_once))
        raise ChunkScheduleError(
            f"access {t} ({plan.phases[t]}, chunk {plan.chunks[t]}) of this input needs "
            f"{format_size(pinned)} of chunks at once, more than the engine's arena of "
            f"{format_size(arena)} ({arena:,} bytes) holds: the arena was {first} "
            "(example_inputs), or use a smaller chunk_size or checkpointing"
        )


class AccessForecast:
    """The access plan this pass would make for a layout, without rewriting anything: the
    chunk-size search asks it about candidate layouts. It follows rewrite() and access_plan()
    step for step (tests hold the two equal). Everything that does not depend on the layout
    (the parameters' reads and how long their aliases last, the nodes that saved parameters,
    the bytes besides chunks) is found once per program; plan(layout) then costs the
    parameter reads and the accesses, not the graph's nodes."""

    def __init__(self, program: Program):
        gm = program.graph_module
        self.load_unit = program.topology.load_unit
        top = parameter_placeholders(program)
        self.nodes = list(gm.graph.nodes)  # only read
        pos = {n: i for i, n in enumerate(self.nodes)}
        self.estimate = nonmodel_estimate(self.nodes)
        self.region_uses: dict[int, list[Use]] = {}  # by the call's position
        for call, region in region_calls(gm):
            _, args = region_inputs(call)
            placeholders = [n for n in region.graph.nodes if n.op == "placeholder"]
            inner = {ph: top[a] for a, ph in zip(args, placeholders, strict=True)
                     if isinstance(a, fx.Node) and a in top}  # fmt: skip
            self.region_uses[pos[call]] = param_uses(inner, _positions(region.graph))
        # a region call fetches its own (rewrite() moves them in): not a read of the top graph
        calls = {self.nodes[i] for i in self.region_uses}
        self.uses = param_uses(top, pos, skip=calls)
        # backward, last node first: a region's recomputation, or a node's saved parameters
        self.backward: list[tuple[int, tuple[str, ...]]] = []
        for i in reversed(range(len(self.nodes))):
            mem = self.nodes[i].meta.get(META_KEY)
            if i in self.region_uses or (mem is not None and mem.saved_params):
                self.backward.append((i, () if i in self.region_uses else mem.saved_params))

    def floor(self) -> int | None:
        """The most bytes besides chunks at an access the plan of every layout makes, with at
        least one chunk pinned: a node's unpack of the parameters it saved, a region's fetch
        (forward and recomputation), the fetch before the first read of a parameter. None
        when no access is certain. The search's lower bound on a layout's least budget."""
        certain = [self.estimate[self.nodes[i]] for i, names in self.backward if names]
        certain += [self.estimate[self.nodes[i]] for i, uses in self.region_uses.items() if uses]
        if self.uses:
            certain.append(self.estimate[self.nodes[min(u.start for u in self.uses)]])
        return max(certain, default=None)

    def plan(self, layout: ChunkLayout) -> AccessPlan:
        plan = AccessPlan([], [], [], [])
        slots = layout.slots()
        regions = {i: _events(segments_of(uses, slots))
                   for i, uses in self.region_uses.items()}  # fmt: skip

        def fetches(events, phase: str, nonmodel: int | None, outer: set[int]) -> None:
            """As access_plan's: a region's fetches inline where it is called; in a
            recomputation nothing is released until the region's backward is done."""
            open_chunks = set(outer)
            for i, kind, chunk in events:
                if kind == FETCH:
                    open_chunks.add(chunk)
                    plan.add(chunk, phase,
                             self.estimate[self.nodes[i]] if nonmodel is None else nonmodel,
                             open_chunks, self.load_unit)  # fmt: skip
                elif kind == RELEASE:
                    if phase == "forward":
                        open_chunks.discard(chunk)
                elif nonmodel is None and i in regions:  # a region call of the top graph
                    node = self.nodes[i]
                    fetches(regions[i], phase, self.estimate[node], open_chunks)

        top = _events(segments_of(self.uses, slots), self.region_uses)
        fetches(top, "forward", None, set())
        for i, names in self.backward:  # backward, last node first
            if i in regions:
                fetches(regions[i], "backward", self.estimate[self.nodes[i]], set())
                continue
            needed = [slots[n].chunk for n in names]
            for chunk in needed:
                plan.add(chunk, "backward", self.estimate[self.nodes[i]], set(needed),
                         self.load_unit)  # fmt: skip
        return plan


FETCH, CALL, RELEASE = 0, 1, 2  # the order of a node's events: fetches, the node, releases


def _events(segs: list[Segment], calls: Collection[int] = ()) -> list[tuple[int, int, int]]:
    """(node position, kind, chunk) in the order insert_fetches leaves them in a graph: a
    segment's fetch just before its first node (segments in order), its release just after its
    last node (later segments' releases first); the region calls at `calls` in between."""
    keyed = [(seg.start, FETCH, n, seg.chunk) for n, seg in enumerate(segs)]
    keyed += [(seg.end, RELEASE, -n, seg.chunk) for n, seg in enumerate(segs)]
    keyed += [(i, CALL, 0, -1) for i in calls]
    keyed.sort()
    return [(i, kind, chunk) for i, kind, _, chunk in keyed]


@register
class ChunkSchedule(Pass):
    name = "chunk_schedule"
    phase = "schedule"
    rewrites = True
    requires = ("chunk_layout",)
    requires_fresh = ("shape_memory",)  # the bytes besides chunks at each access

    def enabled_by(self, plan) -> bool:
        return Topology(plan).uses_chunks

    def __call__(self, program: Program) -> Program:
        layout: ChunkLayout = program.decisions.chunk_layout
        program.decisions.chunk_fetches = fetches = decide(program, layout)
        original = rewrite(program, layout, fetches)
        if layout.ranks > 1:
            note_owners(program, layout)
        if program.plan.disk is not None:
            note_tiers(program, layout)
        access = access_plan(program.graph_module, layout, original, program.topology.load_unit)
        budget = capture_budget(program, access, layout)
        check_budget(access, layout, program, budget)
        program.decisions.chunk_plan = chunk_plan(program, layout, access, budget)
        return program


def note_tiers(program: Program, layout: ChunkLayout) -> None:
    """With a disk tier, each fetch node says where its chunk's parts live: the payload on
    the host (loaded to the compute tier here), the fp32 master (bf16/fp16) on the disk tier
    or, with disk.masters off, on the host, and a trainable chunk's Adam moments on the disk
    tier (HybridAdam's device half may keep some chunks on the compute tier for good at the
    first step: the report says which)."""
    master = ""
    if layout.dtype != torch.float32:
        master = f", fp32 master {'disk' if program.plan.disk.masters else 'host'}"
    for node in fetch_nodes(program):
        moments = "disk" if layout.chunks[node.args[1]].trainable else "none (frozen)"
        note(node, "tiers", f"payload host{master}, moments {moments}")


def fetch_nodes(program: Program) -> Iterator[fx.Node]:
    """Every fetch node, in the graph and in its regions."""
    for module in program.graph_module.modules():
        if isinstance(module, fx.GraphModule):
            for node in module.graph.nodes:
                if node.op == "call_function" and node.target is ops.fetch:
                    yield node


def note_owners(program: Program, layout: ChunkLayout) -> None:
    """Data parallel: each fetch node names its chunk's owner in the dump, and what a load
    of it does with sharded payloads: its group all-gathered (or, with mem_saving_comm, a
    broadcast from the owner); its gradients are reduced to the owner during backward,
    runtime/grad_shards.py."""
    load = ""
    if program.topology.sharded_payloads:
        unit = program.topology.load_unit
        load = (": group {group} all-gathered when loaded" if unit > 1
                else ": broadcast from it when loaded")  # fmt: skip
    for node in fetch_nodes(program):
        chunk = node.args[1]
        group = chunk // layout.ranks
        note(node, "dp", f"owner rank {layout.owner(chunk)}" + load.format(group=group))


def chunk_plan(program: Program, layout: ChunkLayout, access: AccessPlan,
               budget: int | None) -> ChunkPlan:  # fmt: skip
    """The room the chunks have under `budget`, decided here once for the runtime to follow.
    The arena spans the budget and the chunks' share is enforced per moment, beside that
    moment's bytes besides chunks and the gradient staging of sharded data-parallel payloads
    (held on the compute tier all step): on a CPU-only machine the arena's freed pages go
    back to the system, on a card chunk blocks come from the allocator activations use
    (arena.PooledBlocks), so the room activations leave early in forward and late in backward
    holds chunks (dynamic partition). Without a budget (bf16/fp16 alone) every chunk stays
    resident and activations are not budgeted. The first capture's arena is the engine's:
    later captures run in it (check_arena)."""
    device = program.compute_device()
    if budget is None:
        block = -(-layout.chunk_bytes // ARENA_ALIGNMENT) * ARENA_ALIGNMENT  # blocks round up
        capacity = (len(layout.chunks) + 1) * block
    else:
        capacity = budget
    decided = program.engine_decisions
    if decided.arena_capacity is None:
        decided.arena_capacity = capacity
    arena = decided.arena_capacity
    if arena != capacity and budget is not None:
        check_arena(program, access, layout, budget, arena)
    capacity = arena
    return ChunkPlan(
        layout, access, budget, capacity,
        static_share=None if budget is None else static_share(program.plan, budget),
        device=str(device), mem_cache=program.plan.mem_cache,
        load_unit=program.topology.load_unit,
        staging_bytes=0 if budget is None else staging_bytes(program, layout),
    )  # fmt: skip


__all__ = ["AccessForecast", "ChunkSchedule", "ChunkScheduleError", "returns_alias"]
