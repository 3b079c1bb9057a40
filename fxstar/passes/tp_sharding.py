"""tp_sharding: decide how tensor parallelism splits the graph (analysis; `tensor_parallel`
rewrites what it decides).

It finds the column- and row-parallel linears (plan rules first, then the usual transformer
names), carries each column linear's output split forward to the row linear with one rule per
op (`tp_rules`: view of heads, transpose, cat, split, attention, elementwise, ...), which also
give the per-rank shape arguments, marks replicated tensors with a gradient that split work
reads (their gradient is partial on each rank: summed), and with sequence parallelism finds
the nodes that can run on a token block (a rank's slice of the flattened
[batch * seq] tokens) and the edges where a tensor must be sliced,
gathered, or have its gradient summed. Everything it decides is data in
`program.decisions.tp_sharding` (a `Sharding`), and a note per node in dumps; it needs no process
group (only `plan.tensor_parallel.size`).

Why our own propagation: see DESIGN.md, "Tensor parallel on an export graph".
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from torch import fx

from fxstar.dump import NOTES_KEY, note, target_name
from fxstar.passes import Pass, register
from fxstar.passes.tp_carry import Carrier, Edge, Failure, needs_grad
from fxstar.passes.tp_demand import Seed
from fxstar.passes.tp_rules import (
    ELEMENTWISE,
    UNARY,
    VIEWS,
    Shard,
    TPShardingError,
    module_path,
    norm_dim,
    op_name,
    passive,
    static_shape,
)
from fxstar.passes.tp_vocab import VocabParallel, find_vocab
from fxstar.program import Program

__all__ = [
    "DEFAULT_RULES",
    "LinearSite",
    "Sharding",
    "TPShardingError",
    "TPSharding",
    "module_path",
]


DEFAULT_RULES: dict[str, str] = {
    # attention in-projections and MLP up/gate: split the outputs
    **dict.fromkeys(
        (
            "*q_proj",
            "*k_proj",
            "*v_proj",
            "*.c_attn",
            "*qkv_proj",
            "*query_key_value",
            "*.query",
            "*.key",
            "*.value",
            "*q_b_proj",  # MLA (DeepSeek-V2/V3): the B projections out of the low rank, by heads
            "*kv_b_proj",
            "*mixer.in_proj",  # Mamba: x and the gate over the inner dim
            "*gate_proj",
            "*up_proj",
            "*.c_fc",
            "*.fc1",
            "*.w1",
            "*.w3",
            "*dense_h_to_4h",
        ),
        "column",
    ),  # fmt: skip
    # attention out-projection and MLP down: split the inputs
    **dict.fromkeys(
        (
            "*o_proj",
            "*out_proj",
            "*.c_proj",
            "*down_proj",
            "*.fc2",
            "*.w2",
            "*dense_4h_to_h",
            "*attention.dense",
        ),
        "row",
    ),
    # MLA's low-rank A projections: small, read by every head, kept whole (as DeepSeek's own
    # tensor parallel does)
    **dict.fromkeys(("*q_a_proj", "*kv_a_proj_with_mqa"), "replicate"),
}
"""Module-path patterns (fnmatch) of the usual transformer blocks; plan rules come first. A
linear no pattern names that reads features split across ranks is row-parallel (Mamba's
x_proj, whose outputs every channel's scan reads)."""


@dataclass
class LinearSite:
    """One column- or row-parallel linear and the graph nodes it replaces."""

    style: str  # "column" | "row"
    rule: str  # the pattern that chose the style
    module: str
    input: str  # the activation node ([..., seq, in])
    output: str  # the node whose value is the linear's output
    weight: str  # placeholder nodes
    bias: str | None
    weight_name: str  # parameter names
    bias_name: str | None
    transposed: bool  # weight stored [in, out] (GPT-2 Conv1D: view -> addmm -> view)
    parts: int = 1  # a fused projection (q,k,v in one weight): each part is split on its own
    nodes: tuple[str, ...] = ()  # nodes the site replaces, output last


@dataclass
class Sharding:
    """What `tensor_parallel` will do; node names are the graph's before the rewrite."""

    size: int
    sequence_parallel: bool
    sites: list[LinearSite] = field(default_factory=list)
    sharded: dict[str, int] = field(default_factory=dict)  # node -> dim split across ranks
    args: dict[str, tuple] = field(default_factory=dict)  # node -> args with per-rank sizes
    carried_by: dict[str, str] = field(default_factory=dict)  # split node -> tp_rules rule
    seq_len: int | None = None
    seq_nodes: list[str] = field(default_factory=list)  # run on token blocks (dim -2 / N)
    scatters: list[Edge] = field(default_factory=list)  # replicated -> slice for the consumer
    gathers: list[Edge] = field(default_factory=list)  # slices -> whole for the consumer
    grad_reduces: list[Edge] = field(default_factory=list)  # read by rank-local work: sum grads
    vocab: VocabParallel | None = None  # the head, loss and embeddings split by vocabulary
    vocab_off: str = ""  # why the head stays whole, when it does
    rank_random: list[str] = field(default_factory=list)  # dropouts on splits: own stream
    seq_random: list[str] = field(default_factory=list)  # dropouts on token blocks
    # the parameters split across the ranks, by their fed names (the rewrite derives their
    # shards): fed name -> (dim, parts) as `tensor_parallel.shard_of` cuts it; a checkpoint
    # records it, so a rank's optimizer state glues back into the whole parameter's
    splits: dict[str, tuple[int, int]] = field(default_factory=dict)
    # parameters split outside linears (a norm weight over a split projection, Mamba's A_log):
    # placeholder -> dim
    split_params: dict[str, int] = field(default_factory=dict)
    # sums and means over a split dim: node -> 'sum' | 'mean', all-reduced after it
    reduced: dict[str, str] = field(default_factory=dict)
    # every linear's module -> 'column' | 'row' | 'vocab' | 'replicate' (the report's list)
    linears: dict[str, str] = field(default_factory=dict)

    @property
    def params(self) -> set[str]:
        """The split parameters' fed names: the gradient norm sums these over the ranks, the
        others once (grad_norm.py)."""
        return set(self.splits)

    def site(self, output: str) -> LinearSite:
        return next(s for s in self.sites if s.output == output)

    def describe_linears(self) -> str:
        """Each linear's sharding, one entry per layer pattern: the report's line."""
        styles: dict[str, dict[str, None]] = {}
        for module, style in self.linears.items():
            styles.setdefault(style, {})[_layer_pattern(module)] = None
        parts = [
            f"{style} {', '.join(styles[style])}"
            for style in ("column", "row", "vocab", "replicate") if style in styles
        ]  # fmt: skip
        extra = ""
        if self.split_params:
            extra += f"; {len(self.split_params)} other parameters split"
        if self.reduced:
            extra += f"; {len(self.reduced)} sums or norms across ranks"
        return f"tensor parallel (size {self.size}) linears: " + "; ".join(parts) + extra


def _layer_pattern(path: str) -> str:
    """'h.0.attn.c_attn' -> 'h.*.attn.c_attn': a rule for every layer."""
    return re.sub(r"(^|\.)\d+(\.|$)", r"\1*\2", path) or "<module>"


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


# -- finding the linears --------------------------------------------------------------------------


def _style(path: str, rules: dict[str, str]) -> tuple[str, str]:
    for pattern, style in (*rules.items(), *DEFAULT_RULES.items()):
        if fnmatch.fnmatchcase(path, pattern):
            return style, pattern
    return "replicate", ""


def _linear_site(
    program: Program, node: fx.Node, style: str, rule: str, n: int
) -> LinearSite | str:
    """`node` (a linear, or GPT-2's Conv1D addmm) as a `style` site, or why it cannot be."""
    slots = program.placeholder_kinds()
    path = module_path(node)
    if op_name(node) == "linear":
        x, w = node.args[0], node.args[1]
        b = node.args[2] if len(node.args) > 2 else None
        out, nodes, transposed = node, (node.name,), False
    else:  # GPT-2's Conv1D: view(x, [-1, in]) -> addmm(b, ., W[in, out]) -> view
        b, flat, w = node.args[0], node.args[1], node.args[2]
        users = list(node.users)
        if not (
            op_name(flat) in VIEWS and len(static_shape(flat.args[0]) or ()) >= 3
            and len(users) == 1 and op_name(users[0]) in VIEWS
        ):  # fmt: skip
            return (f"{style}-parallel addmm {node.name} at {path} is not the Conv1D pattern "
                    f"view -> addmm -> view over a [..., seq, hidden] input")  # fmt: skip
        x, out, transposed = flat.args[0], users[0], True
        nodes = ((flat.name,) if len(flat.users) == 1 else ()) + (node.name, out.name)
    for p in (w, b):
        slot = slots.get(p.name) if isinstance(p, fx.Node) else None
        if p is not None and (slot is None or slot.kind != "parameter"):
            return f"{style}-parallel linear {node.name} at {path} reads {p}, not a parameter"
        if p is not None and len(p.users) > 1:
            others = [u.name for u in p.users if u is not node]
            return (f"the weight {slots[p.name].target!r} of {style}-parallel linear "
                    f"{node.name} at {path} is also read by {others}; a shared weight cannot "
                    f"be split")  # fmt: skip
    site = LinearSite(
        style=style, rule=rule, module=path, input=x.name, output=out.name, weight=w.name,
        bias=b.name if b is not None else None, weight_name=slots[w.name].target,
        bias_name=slots[b.name].target if b is not None else None, transposed=transposed,
        nodes=nodes,
    )  # fmt: skip
    wshape = static_shape(w)
    out_features = wshape[1] if transposed else wshape[0]
    in_features = wshape[0] if transposed else wshape[1]
    if style == "column":
        site.parts = _fused_parts(out, out_features)
        if (out_features // site.parts) % n:
            return (f"column-parallel linear {node.name} at {path} has {out_features} outputs"
                    f"{f' in {site.parts} fused parts' if site.parts > 1 else ''}, not "
                    f"divisible by tensor_parallel.size={n}")  # fmt: skip
    elif in_features % n:
        return (f"row-parallel linear {node.name} at {path} has {in_features} inputs, not "
                f"divisible by tensor_parallel.size={n}")  # fmt: skip
    return site


def _find_sites(
    program: Program, rules: dict[str, str], n: int, skip: frozenset[str] = frozenset()
) -> tuple[list[LinearSite], list[Failure], dict[str, str]]:
    """The column and row sites the rules name, the linears that cannot be one (failures
    blaming themselves), and every linear's style by module."""
    sites, failures, styles = [], [], {}
    for node in program.graph_module.graph.nodes:
        if op_name(node) not in ("linear", "addmm"):
            continue
        path = module_path(node)
        if node.name in skip:
            styles[path] = "vocab"
            continue
        style, rule = _style(path, rules)
        styles.setdefault(path, style)
        if style == "replicate":
            continue
        site = _linear_site(program, node, style, rule, n)
        if isinstance(site, str):
            failures.append(Failure(node.name, target_name(node.target), path, site, (path,)))
        else:
            sites.append(site)
    return sites, failures, styles


def _fused_parts(out: fx.Node, features: int) -> int:
    """How many projections a column output holds, when it is cut into equal pieces on its
    last dim right after: one split or chunk (GPT-2's q, k, v; Phi-3's gate and up), or
    slices side by side (Phi-3's q, k, v), after transposes and casts (Mamba's x and gate).
    Anything else is one part: a contiguous split, which is whole heads per rank when the
    rows are grouped per head (GPT-NeoX)."""
    out, last = _moved(out, len(static_shape(out)) - 1)
    users = list(out.users)
    nd = len(static_shape(out))

    def dim(node: fx.Node, i: int) -> int:
        d = node.args[i] if len(node.args) > i else node.kwargs.get("dim", 0)
        return d % nd

    if len(users) == 1 and op_name(users[0]) in ("split", "split_with_sizes", "chunk"):
        cut = users[0]
        if dim(cut, 2) != last:
            return 1
        size = cut.args[1]
        if op_name(cut) == "chunk":
            return size if features % size == 0 else 1
        if isinstance(size, int):
            return features // size if features % size == 0 else 1
        return len(size) if len(set(size)) == 1 else 1
    if users and all(op_name(u) == "slice" and dim(u, 1) == last for u in users):
        spans = sorted(_span(u, features) for u in users)
        ends = [0] + [e for _, e in spans]
        if all(s == ends[i] and e - s == spans[0][1] for i, (s, e) in enumerate(spans)):
            return len(spans) if ends[-1] == features else 1
    return 1


def _moved(node: fx.Node, dim: int) -> tuple[fx.Node, int]:
    """Follow `node`'s only reader while it is a transpose, permute or cast: the last such
    node and where `dim` went."""
    while True:
        users = [u for u in node.users if not passive(u)]
        if len(users) != 1:
            return node, dim
        user = users[0]
        op, nd = op_name(user), len(static_shape(node) or ())
        if op == "transpose":
            a, b = norm_dim(user.args[1], nd), norm_dim(user.args[2], nd)
            dim = b if dim == a else a if dim == b else dim
        elif op == "permute":
            dim = [norm_dim(d, nd) for d in user.args[1]].index(dim)
        elif op not in UNARY or user.args[0] is not node:
            return node, dim
        node = user


def _span(node: fx.Node, features: int) -> tuple[int, int]:
    """[start, end) of a slice with step 1; (-1, -1) for any other."""
    defaults = (None, 0, None, None, 1)  # slice.Tensor(self, dim, start, end, step)
    _, _, start, end, step = (*node.args, *defaults[len(node.args) :])
    start, end = start or 0, features if end is None else min(end, features)
    return (start, end) if step == 1 and start >= 0 and end >= 0 else (-1, -1)


# -- the sequence-sharded region ------------------------------------------------------------------


def _seq_local(node: fx.Node, tokens: tuple[int, ...], excluded: set[str]) -> bool:
    """True when `node` computes each token from the same token only, over every token
    (`tokens`: all dims but the features; one broadcast over the batch is replicated work,
    since a rank's token block may span sequences)."""
    if node.op != "call_function" or node.name in excluded:
        return False
    op = op_name(node)
    shape = static_shape(node)
    val = _val(node)
    if shape is None or tuple(shape[:-1]) != tokens or not val.is_floating_point():
        return False
    if op in ELEMENTWISE | UNARY:
        return True
    if op == "layer_norm":
        return len(node.args[1]) == 1
    if op == "rms_norm":
        return len(node.args[1]) == 1
    if op in ("mean", "sum") and len(node.args) > 1:
        nd = len(static_shape(node.args[0]))
        dims = node.args[1] if isinstance(node.args[1], list | tuple) else [node.args[1]]
        keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        return bool(keep) and all(x % nd == nd - 1 for x in dims)
    return False


def _sequence_region(program: Program, sharding: Sharding, feature: set[str], n: int) -> None:
    graph = program.graph_module.graph
    nodes = {node.name: node for node in graph.nodes}
    columns = [s for s in sharding.sites if s.style == "column"]
    # a rank's block is cut from the flattened tokens, so inputs that hold the same tokens
    # in another shape ([batch, 1, seq] under MLA's single latent head, [batch * seq] in an
    # MoE block) take the same blocks; the most common shape is the hidden states'
    shapes = [tuple((static_shape(nodes[s.input]) or (0, 0))[:-1]) for s in columns]
    if len({math.prod(shape) for shape in shapes}) != 1:
        raise TPShardingError(
            f"sequence parallel needs the same tokens at every column-parallel input, found "
            f"token shapes {sorted(set(shapes))}"
        )
    for shape in set(shapes):
        if not shape or shape[-1] % n:
            raise TPShardingError(
                f"sequence parallel splits the sequence (dim -2 of inputs of token shape "
                f"{list(shape)}) across {n} ranks: make it divisible"
            )
    tokens = max(set(shapes), key=shapes.count)
    seq = tokens[-1]
    sharding.seq_len = seq
    excluded = feature | {name for s in sharding.sites for name in s.nodes}
    readers = {}  # column input reader node -> site (the node that reads site.input)
    for s in columns:
        reader = nodes[s.nodes[0]]
        readers[reader.name] = s
    row_outputs = {s.output for s in sharding.sites if s.style == "row"}

    region: set[str] = set(row_outputs)
    queue = deque(row_outputs)
    for s in columns:
        if _seq_local(nodes[s.input], tokens, excluded):
            region.add(s.input)
            queue.append(s.input)
    while queue:
        node = nodes[queue.popleft()]
        neighbours = list(node.users)
        if node.name not in row_outputs:
            neighbours += node.all_input_nodes
        for m in neighbours:
            if m.name not in region and _seq_local(m, tokens, excluded):
                region.add(m.name)
                queue.append(m.name)

    order = {node.name: i for i, node in enumerate(graph.nodes)}
    sharding.seq_nodes = sorted(region, key=order.__getitem__)
    for name in sharding.seq_nodes:
        node = nodes[name]
        for user in node.users:
            if user.name in region or user.name in readers or passive(user):
                continue
            sharding.gathers.append(Edge(name, user.name))
        if name in row_outputs:
            continue
        for m in node.all_input_nodes:
            if m.name not in region:
                _boundary(sharding, m, node, seq)
    for s in columns:
        if s.input not in region:
            sharding.scatters.append(Edge(s.input, s.output))


def _boundary(sharding: Sharding, m: fx.Node, user: fx.Node, seq: int) -> None:
    """A replicated `m` read by sequence-local `user`: cut this rank's token block from it
    (a rank's block spans sequences when the batch is > 1), or sum its gradient."""
    shape = static_shape(m)
    val = _val(m)
    if shape is None or not val.is_floating_point():
        return
    if len(shape) < 2 or all(d == 1 for d in shape[:-1]):  # the same for every token
        sharding.grad_reduces.append(Edge(m.name, user.name))
    elif shape[-2] in (seq, 1):  # per token, or per sequence of a batch: cut the block
        sharding.scatters.append(Edge(m.name, user.name))
    else:
        raise TPShardingError(
            f"sequence parallel: node {user.name} at {module_path(user) or '<model>'} runs on "
            f"sequence slices but reads {m.name} of shape {list(shape)}, whose dim -2 is "
            f"neither the sequence ({seq}) nor 1; turn sequence_parallel off"
        )


def _check_slices_meet_splits(sharding: Sharding, needs_grad: set[fx.Node]) -> None:
    """A tensor computed on sequence slices and read by head-split work: its gather keeps
    the own slice of the gradient, right for replicated readers only; refuse when one flows."""
    grads = {node.name for node in needs_grad}
    seq = set(sharding.seq_nodes)
    for edge in (*sharding.gathers, *sharding.grad_reduces):
        if edge.consumer in sharding.sharded and edge.producer in seq & grads:
            raise TPShardingError(
                f"sequence parallel: node {edge.consumer} is split across ranks by heads or "
                f"features but reads {edge.producer}, computed on sequence slices and "
                f"trained; turn sequence_parallel off"
            )


def _scatter_vocab_sums(program: Program, sharding: Sharding) -> None:
    """A vocab-parallel embedding whose every reader runs on token blocks, over its own
    tokens: its all-reduce and the scatter after it become one reduce-scatter."""
    if sharding.vocab is None:
        return
    nodes = {node.name: node for node in program.graph_module.graph.nodes}
    for name in sharding.vocab.embeddings:
        edges = [e for e in sharding.scatters if e.producer == name]
        tokens = (static_shape(nodes[name]) or ())[:-1]
        readers = {e.consumer for e in edges if static_shape(nodes[e.consumer])[:-1] == tokens}
        if edges and readers == {u.name for u in nodes[name].users if not passive(u)}:
            sharding.vocab.scattered.append(name)
            sharding.scatters = [e for e in sharding.scatters if e.producer != name]


def _dropout_p(node: fx.Node) -> float:
    """The drop probability of a dropout or an attention that drops (0 for any other)."""
    op = op_name(node)
    if op == "dropout":
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        return float(node.args[1]) if train else 0.0
    if op == "scaled_dot_product_attention":
        return float(node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0))
    return 0.0


def _random_streams(program: Program, sharding: Sharding) -> None:
    """Which random ops draw from this rank's own stream (on heads or features split across
    ranks) and which draw the whole sequence's mask and keep their slice (sequence
    parallel); the others draw from the stream every rank shares (runtime/rng_tracker)."""
    seq = set(sharding.seq_nodes)
    for node in program.graph_module.graph.nodes:
        if _dropout_p(node) == 0.0:
            continue
        if node.name in sharding.sharded:
            sharding.rank_random.append(node.name)
        elif node.name in seq and op_name(node) == "dropout":
            sharding.seq_random.append(node.name)


def _add_vocab(program: Program, sharding: Sharding) -> None:
    """The head as a column site (rule 'vocab'), after the others: the carrier has run
    without it, and its split reaches the loss along the chain tp_vocab carried."""
    vocab = sharding.vocab
    slots = program.placeholder_kinds()
    head = next(n for n in program.graph_module.graph.nodes if n.name == vocab.head)
    x, w = head.args[0], head.args[1]
    b = head.args[2] if len(head.args) > 2 else None
    sharding.sites.append(LinearSite(
        style="column", rule="vocab", module=module_path(head), input=x.name, output=head.name,
        weight=w.name, bias=b.name if b is not None else None,
        weight_name=slots[w.name].target, bias_name=slots[b.name].target if b else None,
        transposed=False, nodes=(head.name,),
    ))  # fmt: skip
    sharding.sharded[head.name] = len(static_shape(head)) - 1
    for name, (dim, rule) in vocab.split.items():
        sharding.sharded[name] = dim
        sharding.carried_by[name] = rule
    sharding.args.update(vocab.args)


# -- the decision: carried to a fixed point, or refused in one message ---------------------------

_MAX_WALKS = 200  # each walk adds seeds or replicated linears, of which a model has finitely many


def _splittable_param(program: Program, sites: list[LinearSite], head: frozenset[str]):
    """'' for a placeholder tp_demand may split on its own, else why not."""
    slots = program.placeholder_kinds()
    graph = {node.name: node for node in program.graph_module.graph.nodes}
    taken = {p for s in sites for p in (s.weight, s.bias) if p}
    taken |= {graph[h].args[1].name for h in head}

    def check(node: fx.Node) -> str:
        slot = slots.get(node.name)
        if slot is None or slot.kind != "parameter":
            kind = slot.kind if slot is not None else "input"
            return f"{node.name} is a {kind}, not a parameter"
        if node.name in taken:
            return f"{slot.target} is a split linear's weight"
        info = program.param(node.name)
        if len(info.aliases) > 1 or len(info.placeholders) > 1:
            return f"{slot.target} is tied to {list(info.aliases)}"
        return ""

    return check


def _implied_row(program: Program, rules: dict[str, str], n: int, head: frozenset[str]):
    """The row site a linear no rule names becomes when it reads split features, or why it
    cannot be one."""

    def row(node: fx.Node, shard: Shard) -> LinearSite | str:
        path = module_path(node)
        if node.name in head:
            return f"it is the LM head {path}, which reads whole features"
        style, rule = _style(path, rules)
        if rule:
            return f"it is linear {path}, kept whole by rules={{{rule!r}: {style!r}}}"
        last = len(static_shape(node.args[0])) - 1
        if shard != Shard(last):
            return f"it is linear {path}, reading its input split on dim {shard.dim}"
        return _linear_site(program, node, "row", "(reads split features)", n)

    return row


def _failure_key(f: Failure) -> tuple:
    return _layer_pattern(f.module), f.op, tuple(_layer_pattern(m) for m in f.blame)


def _decide(
    program: Program, rules: dict[str, str], n: int, head: frozenset[str]
) -> tuple[list[LinearSite], Carrier, dict[str, str]]:
    """Sites, the carrier's record and every linear's style. When a linear must be kept whole
    for the split to be carried, keep going with it whole until everything carries, then
    refuse once, naming every node that stopped a split and the whole set of rules that
    works."""
    grad = needs_grad(program)
    extra: dict[str, str] = {}
    met: dict[tuple, list[Failure]] = {}
    seeds: dict[str, Seed] = {}
    for _ in range(_MAX_WALKS):
        merged = {**extra, **rules}
        sites, failures, styles = _find_sites(program, merged, n, skip=head)
        carrier = Carrier(
            program, sites, n, seeds, _splittable_param(program, sites, head),
            _implied_row(program, merged, n, head), grad,
        )  # fmt: skip
        carrier.run()
        fresh = {name: seed for name, seed in carrier.demands.items() if name not in seeds}
        if fresh:  # walk again, the new splits started
            seeds.update(fresh)
            continue
        failures += carrier.failures
        if not failures:
            break
        # what stops the splits as the rules stand; later walks meet only what keeping
        # those linears whole entails (the row after a whole column), which the rules cover
        first = not met
        for f in failures:
            if first:
                met.setdefault(_failure_key(f), []).append(f)
        blamed = {_layer_pattern(m): "replicate" for f in failures for m in f.blame}
        blamed = {pattern: style for pattern, style in blamed.items() if pattern not in extra}
        if not blamed:
            for f in failures if not first else ():
                met.setdefault(_failure_key(f), []).append(f)
            raise _refusal(met, None, n)
        extra.update(blamed)
        seeds = {}
    else:
        raise TPShardingError(f"tensor parallel did not settle in {_MAX_WALKS} walks")
    if extra:
        raise _refusal(met, {**extra, **rules}, n, nothing_left=not sites and not head)
    for site in carrier.implied:
        styles[site.module] = "row"
    return sites + carrier.implied, carrier, styles


def _refusal(
    met: dict[tuple, list[Failure]], rules: dict[str, str] | None, n: int,
    nothing_left: bool = False,
) -> TPShardingError:  # fmt: skip
    lines = [f"tensor parallel (size {n}) cannot split the model as the rules name it:"]
    for same in met.values():
        f = same[0]
        more = f" (and {len(same) - 1} more like it)" if len(same) > 1 else ""
        lines.append(f"  - node {f.node} ({f.op}) at {f.module or '<model>'}{more}: {f.what}")
    if rules is None:
        lines.append("  no set of linears kept whole fixes this")
    else:
        whole = [p for p, style in rules.items() if style == "replicate"]
        lines.append(
            f"  fix: rules={rules!r} keeps {', '.join(whole)} whole and splits the rest"
            + (" (which leaves nothing to split at this size)" if nothing_left else "")
            + "; or mark the linear that should end a split 'row'"
        )
    return TPShardingError("\n".join(lines))


# -- the pass -------------------------------------------------------------------------------------


@register
class TPSharding(Pass):
    """Analysis: writes a Sharding to program.decisions.tp_sharding and a 'tp' note per node."""

    name = "tp_sharding"
    phase = "shard"
    tolerance = None

    def __call__(self, program: Program) -> Program:
        config = program.plan.tensor_parallel
        if config is None or config.size < 2:
            raise TPShardingError("tp_sharding needs plan.tensor_parallel with size >= 2")
        if config.sequence_parallel and program.plan.cpu_embedding:
            raise TPShardingError(
                "tensor_parallel.sequence_parallel with cpu_embedding is not supported yet: the "
                "host lookup's rows are not cut to each rank's token block. Turn one of them "
                "off (cpu_embedding composes with tensor parallel without sequence_parallel)"
            )
        n = config.size
        sharding = Sharding(size=n, sequence_parallel=config.sequence_parallel)
        sharding.vocab, sharding.vocab_off = find_vocab(program, dict(config.rules), n)
        head = frozenset({sharding.vocab.head} if sharding.vocab else ())
        sharding.sites, carrier, sharding.linears = _decide(program, dict(config.rules), n, head)
        if not sharding.sites and sharding.vocab is None:
            raise TPShardingError(
                "tensor parallel found no linear to split: name them with "
                "plan.tensor_parallel.rules (module pattern -> 'column' | 'row')"
            )
        sharding.split_params = carrier.split_params
        sharding.sharded = {
            node.name: s.dim for node, s in carrier.shard.items()
            if node.name not in carrier.split_params
        }  # fmt: skip
        sharding.reduced = carrier.reduced
        sharding.args = carrier.args
        sharding.carried_by = carrier.carried_by
        if sharding.vocab is not None:
            _add_vocab(program, sharding)
        elif sharding.vocab_off:
            program.decisions.report_lines.append(
                f"tensor parallel: the LM head stays whole ({sharding.vocab_off})"
            )
        sharding.grad_reduces = list(carrier.grad_reduces)
        if config.sequence_parallel:
            split = {*sharding.sharded, *sharding.reduced, *sharding.split_params}
            _sequence_region(program, sharding, split, n)
            _check_slices_meet_splits(sharding, carrier.needs_grad)
            _scatter_vocab_sums(program, sharding)
        _random_streams(program, sharding)
        program.decisions.report_lines.append(sharding.describe_linears())
        program.decisions.tp_sharding = sharding
        self._annotate(program, sharding)
        return program

    @staticmethod
    def _annotate(program: Program, sharding: Sharding) -> None:
        nodes = {node.name: node for node in program.graph_module.graph.nodes}
        for site in sharding.sites:
            parts = f"x{site.parts}" if site.parts > 1 else ""
            vocab = "(vocab)" if site.rule == "vocab" else ""
            note(nodes[site.output], "tp", site.style + parts + vocab)
        for name, dim in sharding.sharded.items():
            rule = sharding.carried_by.get(name)
            text = f"split(dim={dim}{f', {rule}' if rule else ''})"
            nodes[name].meta.setdefault(NOTES_KEY, {}).setdefault("tp", text)
        for name, dim in sharding.split_params.items():
            note(nodes[name], "tp", f"split(dim={dim}, parameter)")
        for name, how in sharding.reduced.items():
            note(nodes[name], "tp", f"all-reduce({how})")
        for name in sharding.seq_nodes:
            nodes[name].meta.setdefault(NOTES_KEY, {}).setdefault("tp", "seq")
        for name in sharding.rank_random:
            note(nodes[name], "rng", "rank stream")
        for name in sharding.seq_random:
            note(nodes[name], "rng", "sequence mask, own block")
        vocab = sharding.vocab
        for name in (vocab.loss, *vocab.embeddings) if vocab else ():
            note(nodes[name], "tp", "vocab-parallel")
