"""checkpoint_regions: which spans of the graph to checkpoint, decided from the graph alone.

Analysis only; the `checkpoint` pass follows the decision. Regions come from each node's
`nn_module_stack`:
- 'blocks': the repeated blocks, found without naming them: the outermost module path that
  ends in an index ('h.3', 'model.layers.3', 'bert.encoder.layer.3') whose parent holds at
  least two indexed children of one class;
- a list of module-name patterns (fnmatch): each module path matched (outermost first);
- 'auto': the fewest blocks whose checkpointing keeps the peak of activations during backward
  (saved ones, recomputation included, plus what each gradient allocates; from the
  `shape_memory` measurement, run here if it did not run) within `plan.activation_memory`.
`plan.checkpoint_every=k` keeps every k-th region. A region is the contiguous span of graph
nodes from the first to the last node of its module (export lists nodes in execution order).
A higher-order op (export's form of a `torch.no_grad()` or `torch.autocast` block inside
forward: a `wrap_with_set_grad_enabled` call on a submodule, read through `getitem`s) is
never a region of its own (a frozen teacher is no block), and a region never splits one: it
takes the op whole, with the region its results land in, or not at all.
A region that writes a tensor in place (BatchNorm's running statistics, a counter a module
bumps in forward) would write it again when backward recomputes it: each region records the
inputs it writes (`writes`) and the inputs whose values change after its forward starts, by it
or by a later node (`copied`); its recomputation runs on copies of those taken at its forward,
so the buffers keep the forward's one update, as in eager PyTorch (fxstar.runtime.recompute).
Writes are read from the op schemas (`Tensor(a!)`, through views to the tensor that owns the
memory, into the submodules of higher-order ops), plus the running statistics of torch's norm
kernels, whose schemas do not declare that write.
The decision is data (`program.decisions.checkpoint_regions`, a CheckpointDecision) and shows
in the dump as notes on each region's first node; a pass running after this one may edit it.
"""

from __future__ import annotations

import fnmatch
import operator
import warnings
from dataclasses import dataclass, field
from typing import Any

from torch import fx
from torch._ops import HigherOrderOperator

from fxstar.dump import NOTES_KEY
from fxstar.passes import Pass, register
from fxstar.passes.shape_memory import META_KEY as MEMORY_KEY
from fxstar.passes.shape_memory import backward_peak, node_steps
from fxstar.plan import PlanError
from fxstar.program import Program
from fxstar.sizes import format_size

__all__ = [
    "CheckpointDecision",
    "CheckpointRegions",
    "Region",
    "find_regions",
    "in_place_writes",
    "model_names",
]

NORM_STATISTICS = ("running_mean", "running_var")
"""Arguments torch's norm kernels (native_batch_norm, instance_norm, ...) update in place while
their mode argument (NORM_MODES) is true, though their schemas do not mark them `(a!)`."""
NORM_MODES = ("training", "use_input_stats")


@dataclass
class Region:
    """A span of graph nodes belonging to one module, in graph order."""

    module: str
    nodes: list[str]
    saved_bytes: int = 0  # saved for backward by its nodes without checkpointing
    keep_bytes: int = 0  # its activation inputs: what checkpointing still saves
    writes: list[str] = field(default_factory=list)  # inputs it updates in place
    # inputs its recomputation takes from copies made at its forward: the ones written in place
    # from its start on (by it, or by a node after it), whose values backward no longer sees
    copied: list[str] = field(default_factory=list)

    @property
    def savings(self) -> int:
        return max(self.saved_bytes - self.keep_bytes, 0)


@dataclass
class CheckpointDecision:
    """What to checkpoint and why; `chosen` are fused in this order as checkpoint_0, 1, ..."""

    mode: str  # 'blocks', 'patterns' or 'auto'
    candidates: list[Region]
    chosen: list[Region]
    every: int = 1
    budget: int | None = None
    saved_before: int | None = None  # saved activations without checkpointing (shape_memory)
    estimate: int | None = None  # the peak of activations expected in backward
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        text = f"{self.mode}: {len(self.chosen)} of {len(self.candidates)} regions"
        if self.every > 1:
            text += f" (every {self.every})"
        if self.estimate is not None and self.saved_before is not None:
            text += (
                f", activations {format_size(self.saved_before)} saved without checkpoints, "
                f"backward peak ~{format_size(self.estimate)}"
            )
        if self.budget is not None:
            text += f" for a budget of {format_size(self.budget)}"
        written = sum(len(r.writes) for r in self.chosen)
        if written:
            text += f", {written} tensors written in place (recomputed on copies)"
        return text + "".join(f"; {note}" for note in self.notes)


def _stack(node: fx.Node) -> list[tuple[str, Any]]:
    """(module path, module type) from the outermost module inwards."""
    return list((node.meta.get("nn_module_stack") or {}).values())


def _repeated_parents(nodes: list[fx.Node]) -> set[str]:
    """Module paths holding at least two indexed children of one class (a ModuleList of
    blocks)."""
    children: dict[str, dict[str, set[str]]] = {}
    for node in nodes:
        for path, kind in _stack(node):
            parent, _, last = path.rpartition(".")
            if last.isdigit():
                children.setdefault(parent, {}).setdefault(last, set()).add(str(kind))
    repeated = set()
    for parent, by_index in children.items():
        kinds = set().union(*by_index.values())
        if len(by_index) >= 2 and len(kinds) == 1:
            repeated.add(parent)
    return repeated


def _block_key(node: fx.Node, repeated: set[str]) -> str | None:
    for path, _ in _stack(node):
        parent, _, last = path.rpartition(".")
        if last.isdigit() and parent in repeated:
            return path
    return None


def _pattern_key(node: fx.Node, patterns: tuple[str, ...]) -> str | None:
    for path, _ in _stack(node):
        if path and any(fnmatch.fnmatchcase(path, p) for p in patterns):
            return path
    return None


def _op_units(nodes: list[fx.Node]) -> dict[int, tuple[int, int]]:
    """Position -> (first, last) position of the higher-order op it belongs to: the call, the
    get_attr of its submodule and the getitems reading its results. A no_grad block's outputs
    carry the module stack of the code around them; they must not make a region of their
    own, and a region must not take the call without its submodule or its results."""
    index = {n: i for i, n in enumerate(nodes)}
    units: dict[int, tuple[int, int]] = {}
    for node in nodes:
        if isinstance(node.target, HigherOrderOperator):
            attrs = [a for a in node.args if isinstance(a, fx.Node) and a.op == "get_attr"]
            reads = [u for u in node.users if u.target is operator.getitem]
            where = [index[m] for m in (*attrs, node, *reads) if m in index]
            for i in where:
                units[i] = (min(where), max(where))
    return units


def _widen(first: int, last: int, units: dict[int, tuple[int, int]]) -> tuple[int, int]:
    """The span grown until it holds every higher-order op it touches whole."""
    while True:
        ends = [units[i] for i in range(first, last + 1) if i in units]
        lo, hi = min([first, *(a for a, _ in ends)]), max([last, *(b for _, b in ends)])
        if (lo, hi) == (first, last):
            return first, last
        first, last = lo, hi


def find_regions(
    graph: fx.Graph, patterns: tuple[str, ...] | None = None, *, skip_conflicts: bool = False
) -> list[Region]:
    """Regions of the graph: the repeated blocks, or the modules matching `patterns`.

    A module whose span holds another module's nodes (the two interleave, or one module is
    called again after others, as a block's dropout around its MLP) cannot be a region:
    ValueError, or with `skip_conflicts` (a search over candidates) it is left out.
    """
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    units = _op_units(nodes)
    if patterns is None:
        repeated = _repeated_parents([n for i, n in enumerate(nodes) if i not in units])
        key = lambda node: _block_key(node, repeated)  # noqa: E731
    else:
        key = lambda node: _pattern_key(node, patterns)  # noqa: E731
    keys = [None if i in units else key(node) for i, node in enumerate(nodes)]
    span: dict[str, list[int]] = {}  # module -> [first, last] position
    for i, module in enumerate(keys):
        if module is not None:
            span.setdefault(module, [i, i])[1] = i
    for first, last in set(units.values()):  # an op whose results land in a region joins it
        module = key(nodes[last])  # its last getitem, in the module stack it ended in
        if module in span:
            span[module] = [min(span[module][0], first), max(span[module][1], last)]
    regions: list[Region] = []
    end = -1  # last position of the region before
    for module, (first, last) in sorted(span.items(), key=lambda item: item[1][0]):
        first, last = _widen(first, last, units)
        clash = next((k for k in keys[first : last + 1] if k not in (None, module)), None)
        if clash is None and first <= end:
            clash = regions[-1].module  # widened into the region before
        if clash is not None:
            if skip_conflicts:
                continue
            raise PlanError(
                f"checkpoint: regions {clash!r} and {module!r} interleave in the graph (a "
                "module called again after another, as a block's dropout around its MLP); "
                "choose module patterns whose nodes are contiguous, or checkpoint='auto'"
            )
        regions.append(Region(module, [n.name for n in nodes[first : last + 1]]))
        end = last
    _mark_writes(graph, regions)
    return regions


def _bound(node: fx.Node, schema: Any) -> list[tuple[Any, Any]]:
    """(schema argument, the node's value for it) for every argument the node gives."""
    pairs = list(zip(schema.arguments, node.args, strict=False))
    pairs += [(a, node.kwargs[a.name]) for a in schema.arguments if a.name in node.kwargs]
    return pairs


def _nodes_in(value: Any) -> list[fx.Node]:
    if isinstance(value, fx.Node):
        return [value]
    if isinstance(value, list | tuple):
        return [n for v in value for n in _nodes_in(v)]
    return []


def _norm_statistics(bound: list[tuple[Any, Any]]) -> list[fx.Node]:
    """The running statistics a norm kernel updates: its mode argument is not False."""
    values = {arg.name: value for arg, value in bound}
    if not any(name in values and values[name] is not False for name in NORM_MODES):
        return []
    return [n for name in NORM_STATISTICS for n in _nodes_in(values.get(name))]


def _op_writes(node: fx.Node, owner: dict[fx.Node, fx.Node]) -> set[fx.Node]:
    """What an op node writes in place; records in `owner` the tensor its output is a view
    of (an argument with an alias annotation: `view(Tensor(a) self)`, `add_(Tensor(a!) self)`)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return set()
    bound = _bound(node, schema)
    written = set(_norm_statistics(bound))
    for arg, value in bound:
        if arg.alias_info is None:
            continue
        if arg.alias_info.is_write:
            written.update(_nodes_in(value))
        if node not in owner and isinstance(value, fx.Node):
            owner[node] = owner.get(value, value)
    return written


def _higher_order_writes(node: fx.Node) -> set[fx.Node]:
    """The operands a higher-order op's submodules (a `torch.no_grad()` block) write: the
    placeholders they write, mapped to the operands after the last submodule."""
    gm = node.graph.owning_module
    positions = [
        i for i, a in enumerate(node.args)
        if isinstance(a, fx.Node) and a.op == "get_attr"
        and isinstance(getattr(gm, str(a.target), None), fx.GraphModule)
    ]  # fmt: skip
    if not positions:
        return set()
    operands = _nodes_in(node.args[max(positions) + 1 :])
    written: set[fx.Node] = set()
    for i in positions:
        submodule = getattr(gm, str(node.args[i].target))
        placeholders = list(submodule.graph.find_nodes(op="placeholder"))
        roots = set().union(*in_place_writes(submodule.graph)[0].values())
        for k, placeholder in enumerate(placeholders):
            if placeholder not in roots:
                continue
            if len(placeholders) == len(operands):
                written.add(operands[k])
            else:  # operands not one per placeholder: any of them may be the one written
                written.update(operands)
    return written


def in_place_writes(
    graph: fx.Graph,
) -> tuple[dict[fx.Node, set[fx.Node]], dict[fx.Node, fx.Node]]:
    """(node -> the tensors it writes in place, view -> the tensor it is a view of).

    A tensor is named by the node that owns its memory (a placeholder, or the node that made
    it), so a write through a view (`buf[0].add_(1)`) is a write to its base."""
    owner: dict[fx.Node, fx.Node] = {}
    writes: dict[fx.Node, set[fx.Node]] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is operator.getitem:  # a result of a view op that returns several
            source = node.args[0]
            if isinstance(source, fx.Node) and source in owner:
                owner[node] = owner[source]
            continue
        if isinstance(node.target, HigherOrderOperator):
            written = _higher_order_writes(node)
        else:
            written = _op_writes(node, owner)
        if written:
            writes[node] = {owner.get(n, n) for n in written}
    return writes, owner


def _mark_writes(graph: fx.Graph, regions: list[Region]) -> None:
    """Fill each region's `writes` and `copied` (see the module docstring)."""
    writes, owner = in_place_writes(graph)
    if not writes:
        return
    order = {n: i for i, n in enumerate(graph.nodes)}
    by_name = {n.name: n for n in graph.nodes}
    for region in regions:
        members = [by_name[n] for n in region.nodes]
        inside = set(members)
        start = order[members[0]]
        written = set().union(*(writes.get(n, ()) for n in members))
        later = set().union(*(w for n, w in writes.items() if order[n] >= start))
        inputs = dict.fromkeys(a for n in members for a in n.all_input_nodes if a not in inside)
        region.writes = [a.name for a in inputs if owner.get(a, a) in written]
        region.copied = [a.name for a in inputs if owner.get(a, a) in later]


def _nbytes(node: fx.Node) -> int:
    value = node.meta.get("val", node.meta.get("tensor_meta"))
    if value is None or not hasattr(value, "shape"):
        return 0
    numel = 1
    for s in value.shape:
        numel *= int(s)
    return numel * value.dtype.itemsize


def _measure(program: Program, regions: list[Region]) -> None:
    """Fill saved_bytes and keep_bytes from the shape_memory node annotations."""
    by_name = {n.name: n for n in program.graph_module.graph.nodes}
    fed = program.placeholder_kinds()
    for region in regions:
        members = {by_name[n] for n in region.nodes}
        region.saved_bytes = sum(
            n.meta[MEMORY_KEY].saved_bytes for n in members if MEMORY_KEY in n.meta
        )
        inputs = {a for n in members for a in n.all_input_nodes if a not in members}
        region.keep_bytes = sum(  # parameters and buffers stay; copies of written ones do not
            _nbytes(a)
            for a in inputs
            if a.name in region.copied
            or not (a.op == "placeholder" and fed.get(a.name) and fed[a.name].kind != "input")
        )


def _peak(program: Program, chosen: list[Region]) -> int:
    """Expected peak of activations in backward when `chosen` (in graph order) are
    checkpointed: saved activations, recomputation, and what gradients allocate. A region keeps
    its inputs from the forward; its activations come back when backward reaches its end and
    go node by node. With offload_activations its inputs wait on the host instead, and come
    back with its recomputation, the next region's prefetched beside them."""
    offloaded = program.plan.offload_activations
    first = {r.nodes[0]: r for r in chosen}
    back = {r.nodes[-1]: r.savings for r in chosen}
    if offloaded:
        for i, region in enumerate(chosen):
            back[region.nodes[-1]] += chosen[i - 1].keep_bytes if i else 0  # the prefetch
        if chosen:
            back[chosen[-1].nodes[-1]] += chosen[-1].keep_bytes  # the first one back
    inside = {name for r in chosen for name in r.nodes}
    steps = []
    for node, step in node_steps(program.graph_module.graph.nodes).items():
        if node.name in inside:
            region = first.get(node.name)
            kept = region.keep_bytes if region is not None and not offloaded else 0
            step.frees, step.kept = step.kept, kept
            step.back = back.get(node.name, 0)
        steps.append(step)
    return backward_peak(steps)


def _choose_auto(
    program: Program, regions: list[Region], budget: int
) -> tuple[list[Region], int, list[str]]:
    """The fewest regions, earliest first (their activations stay resident longest in
    backward), whose peak of activations during backward fits the budget. Whole blocks are
    coarse (one block of a 12-layer model is ~8% of its activations): the last block is then
    checkpointed only in part (one of its child modules) when that fits, so the peak lands
    closer to the budget."""
    count = 0
    while count < len(regions) and _peak(program, regions[:count]) > budget:
        count += 1
    chosen = regions[:count]
    estimate = _peak(program, chosen)
    if count:
        chosen, estimate = _refine_last(program, regions, count, budget, estimate)
    notes = [] if estimate <= budget else ["budget not met even with every region checkpointed"]
    return chosen, estimate, notes


def _refine_last(
    program: Program, regions: list[Region], count: int, budget: int, estimate: int
) -> tuple[list[Region], int]:
    """Try the last chosen block's child modules instead of the whole block: the single child
    that still fits the budget with the highest peak (the least recomputation) wins."""
    last = regions[count - 1]
    graph = program.graph_module.graph
    children = [r for r in find_regions(graph, (f"{last.module}.*",), skip_conflicts=True)
                if set(r.nodes) <= set(last.nodes)]  # fmt: skip
    if len(children) < 2:
        return regions[:count], estimate
    _measure(program, children)
    best = (regions[:count], estimate)
    for child in children:
        split = regions[: count - 1] + [child]
        peak = _peak(program, split)
        if peak <= budget and peak > best[1]:
            best = (split, peak)
    return best


@register
class CheckpointRegions(Pass):
    """Analysis: finds the regions to checkpoint and records the decision."""

    name = "checkpoint_regions"
    phase = "restructure"
    requires_fresh = ("shape_memory",)  # regions are chosen on the graph they will cut
    after = ("tiled_linear",)
    implements = ("checkpoint", "checkpoint_every", "activation_memory")

    def __call__(self, program: Program) -> Program:
        plan = program.plan
        mode = plan.checkpoint
        if mode is None:
            return program
        graph = program.graph_module.graph
        patterns = tuple(mode) if isinstance(mode, tuple) else None
        regions = find_regions(graph, patterns)
        _measure(program, regions)  # on shape_memory's measurement of this graph (fresh)
        decision = CheckpointDecision(
            mode="patterns" if patterns else mode,
            candidates=regions,
            chosen=regions[:: plan.checkpoint_every],
            every=plan.checkpoint_every,
        )
        decision.saved_before = program.decisions.shape_memory.saved_bytes
        if mode == "auto":
            budget = plan.resolve_size("activation_memory", program.param_bytes)
            if budget is None:
                raise PlanError(
                    "checkpoint='auto' needs plan.activation_memory (a byte budget for saved "
                    "activations), or name the regions: checkpoint='blocks' or module patterns"
                )
            chosen, estimate, notes = _choose_auto(program, decision.chosen, budget)
            decision.chosen, decision.estimate, decision.budget = chosen, estimate, budget
            decision.notes += notes
            if estimate > budget:  # said in a summary only, a user would never see it
                warnings.warn(
                    f"checkpoint='auto': activation_memory {format_size(budget)} cannot be met; "
                    f"with every one of the {len(chosen)} regions checkpointed the activations "
                    f"still peak at {format_size(estimate)}. Raise activation_memory, add "
                    "offload_activations, or checkpoint smaller regions (module patterns).",
                    stacklevel=2,
                )
        elif decision.saved_before is not None:
            decision.estimate = _peak(program, decision.chosen)
        if not regions:
            decision.notes.append(
                "no regions found: no repeated blocks" if patterns is None
                else f"no module matches {list(patterns)}"
            )  # fmt: skip
        program.decisions.checkpoint_regions = decision
        _annotate(program, decision)
        return program


def _annotate(program: Program, decision: CheckpointDecision) -> None:
    by_name = {n.name: n for n in program.graph_module.graph.nodes}
    for i, region in enumerate(decision.chosen):
        notes = by_name[region.nodes[0]].meta.setdefault(NOTES_KEY, {})
        text = f"checkpoint_{i}({region.module}, {len(region.nodes)} nodes)"
        if i == 0:
            text += f" [{decision.summary()}]"
        notes["region"] = text
        if region.writes:
            notes["writes"] = model_names(program, region.writes)


def model_names(program: Program, nodes: list[str]) -> str:
    """The nodes by the model's names where a parameter or buffer feeds them."""
    fed = program.placeholder_kinds()
    return ", ".join(fed[n].target if n in fed else n for n in nodes)
