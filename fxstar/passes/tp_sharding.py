"""tp_sharding: decide how tensor parallelism splits the graph (analysis; `tensor_parallel`
rewrites what it decides).

It finds the column- and row-parallel linears (plan rules first, then the usual transformer
names), carries each column linear's output sharding forward through the ops between it and
the row linear (view/reshape of heads, transpose, attention, elementwise) and computes the
per-rank shape arguments, and with sequence parallelism finds the nodes that can run on a
sequence slice and the edges where a tensor must be sliced, gathered, or have its gradient
summed. Everything it decides is data in `program.meta[META_KEY]` (a `Sharding`), and a note
per node in dumps; it needs no process group (only `plan.tensor_parallel.size`).

Why our own propagation: see DESIGN.md, "Tensor parallel on an export graph".
"""

from __future__ import annotations

import fnmatch
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from fxstar.dump import NOTES_KEY, target_name
from fxstar.errors import FxstarError
from fxstar.passes import Pass, register
from fxstar.program import Program

__all__ = [
    "DEFAULT_RULES",
    "META_KEY",
    "LinearSite",
    "Sharding",
    "TPShardingError",
    "TPSharding",
    "module_path",
]

META_KEY = "fxstar.tp_sharding"

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
        ("*o_proj", "*out_proj", "*.c_proj", "*down_proj", "*.fc2", "*.w2", "*dense_4h_to_h"),
        "row",
    ),
}
"""Module-path patterns (fnmatch) of the usual transformer blocks; plan rules come first."""


class TPShardingError(FxstarError, ValueError):
    """The graph cannot be split as asked; the message names the node and a rule to fix it."""


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


@dataclass(frozen=True)
class Edge:
    """A tensor `producer` read by `consumer` that needs a collective in between."""

    producer: str
    consumer: str


@dataclass
class Sharding:
    """What `tensor_parallel` will do; node names are the graph's before the rewrite."""

    size: int
    sequence_parallel: bool
    sites: list[LinearSite] = field(default_factory=list)
    sharded: dict[str, int] = field(default_factory=dict)  # node -> dim split across ranks
    args: dict[str, tuple] = field(default_factory=dict)  # node -> args with per-rank sizes
    seq_len: int | None = None
    seq_nodes: list[str] = field(default_factory=list)  # run on sequence slices (dim -2)
    scatters: list[Edge] = field(default_factory=list)  # replicated -> slice for the consumer
    gathers: list[Edge] = field(default_factory=list)  # slices -> whole for the consumer
    grad_reduces: list[Edge] = field(default_factory=list)  # broadcast over slices: sum grads

    def site(self, output: str) -> LinearSite:
        return next(s for s in self.sites if s.output == output)


def module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    return list(stack.values())[-1][0] if stack else ""


def _layer_pattern(path: str) -> str:
    """'h.0.attn.c_attn' -> 'h.*.attn.c_attn': a rule for every layer."""
    return re.sub(r"(^|\.)\d+(\.|$)", r"\1*\2", path) or "<module>"


def _op(node: fx.Node) -> str:
    """'view', 'add', ... for aten overloads; '' for anything else."""
    target = node.target
    if node.op == "call_function" and isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    if node.op == "call_function" and getattr(target, "__name__", "") == "getitem":
        return "getitem"
    return ""


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _shape(node: Any) -> tuple[int, ...] | None:
    val = _val(node)
    if not isinstance(val, torch.Tensor):
        return None
    shape = tuple(val.shape)
    if not all(isinstance(s, int) for s in shape):
        raise TPShardingError(
            f"tensor parallel needs static shapes; node {node.name} has shape {shape}"
        )
    return shape


ELEMENTWISE = frozenset(
    ("add", "sub", "mul", "div", "neg", "gelu", "silu", "relu", "tanh", "sigmoid", "exp", "log",
     "rsqrt", "sqrt", "pow", "erf", "dropout", "clone", "contiguous", "to", "_to_copy",
     "type_as", "alias", "detach", "where", "masked_fill")
)  # fmt: skip
VIEWS = frozenset({"view", "reshape", "_unsafe_view"})


def _passive(node: fx.Node) -> bool:
    """A check export inserts that reads a tensor's dtype/device only: any shard passes it."""
    return (
        _op(node) == "_assert_tensor_metadata"
        and len(node.args) == 1
        and node.kwargs.get("size") is None
        and node.kwargs.get("stride") is None
    )


# -- finding the linears --------------------------------------------------------------------------


def _style(path: str, rules: dict[str, str]) -> tuple[str, str]:
    for pattern, style in (*rules.items(), *DEFAULT_RULES.items()):
        if fnmatch.fnmatchcase(path, pattern):
            return style, pattern
    return "replicate", ""


def _find_sites(program: Program, rules: dict[str, str], n: int) -> list[LinearSite]:
    slots = program.placeholder_kinds()
    sites = []
    for node in program.graph_module.graph.nodes:
        op = _op(node)
        if op not in ("linear", "addmm"):
            continue
        path = module_path(node)
        style, rule = _style(path, rules)
        if style == "replicate":
            continue
        if op == "linear":
            x, w = node.args[0], node.args[1]
            b = node.args[2] if len(node.args) > 2 else None
            out, nodes, transposed = node, (node.name,), False
        else:  # GPT-2's Conv1D: view(x, [-1, in]) -> addmm(b, ., W[in, out]) -> view
            b, flat, w = node.args[0], node.args[1], node.args[2]
            users = list(node.users)
            if not (
                _op(flat) in VIEWS and len(_shape(flat.args[0]) or ()) >= 3
                and len(users) == 1 and _op(users[0]) in VIEWS
            ):  # fmt: skip
                raise TPShardingError(
                    f"{style}-parallel addmm {node.name} at {path} is not the Conv1D pattern "
                    f"view -> addmm -> view over a [..., seq, hidden] input; add "
                    f"rules={{{_layer_pattern(path)!r}: 'replicate'}} to keep it whole"
                )
            x, out, transposed = flat.args[0], users[0], True
            nodes = ((flat.name,) if len(flat.users) == 1 else ()) + (node.name, out.name)
        for p in (w, b):
            slot = slots.get(p.name) if isinstance(p, fx.Node) else None
            if p is not None and (slot is None or slot.kind != "parameter"):
                raise TPShardingError(
                    f"{style}-parallel linear {node.name} at {path} reads {p} which is not a "
                    f"parameter; add rules={{{_layer_pattern(path)!r}: 'replicate'}}"
                )
            if p is not None and len(p.users) > 1:
                others = [u.name for u in p.users if u is not node]
                raise TPShardingError(
                    f"the weight {slots[p.name].target!r} of {style}-parallel linear "
                    f"{node.name} at {path} is also read by {others}; a shared weight cannot "
                    f"be split: add rules={{{_layer_pattern(path)!r}: 'replicate'}}"
                )
        site = LinearSite(
            style=style, rule=rule, module=path, input=x.name, output=out.name, weight=w.name,
            bias=b.name if b is not None else None, weight_name=slots[w.name].target,
            bias_name=slots[b.name].target if b is not None else None, transposed=transposed,
            nodes=nodes,
        )  # fmt: skip
        wshape = _shape(w)
        out_features = wshape[1] if transposed else wshape[0]
        in_features = wshape[0] if transposed else wshape[1]
        if style == "column":
            site.parts = _fused_parts(out, out_features)
            if (out_features // site.parts) % n:
                raise TPShardingError(
                    f"column-parallel linear {node.name} at {path} has {out_features} outputs"
                    f"{f' in {site.parts} fused parts' if site.parts > 1 else ''}, not "
                    f"divisible by tensor_parallel.size={n}; add "
                    f"rules={{{_layer_pattern(path)!r}: 'replicate'}}"
                )
        elif in_features % n:
            raise TPShardingError(
                f"row-parallel linear {node.name} at {path} has {in_features} inputs, not "
                f"divisible by tensor_parallel.size={n}; add "
                f"rules={{{_layer_pattern(path)!r}: 'replicate'}}"
            )
        sites.append(site)
    return sites


def _fused_parts(out: fx.Node, features: int) -> int:
    """How many projections a column output holds: q, k, v fused and split right after."""
    users = list(out.users)
    if len(users) != 1 or _op(users[0]) not in ("split", "split_with_sizes"):
        return 1
    split = users[0]
    ndim = len(_shape(out))
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if dim % ndim != ndim - 1:
        return 1
    size = split.args[1]
    if isinstance(size, int):
        return features // size if features % size == 0 else 1
    return len(size) if len(set(size)) == 1 else 1


# -- carrying the feature sharding ----------------------------------------------------------------


@dataclass(frozen=True)
class _Shard:
    dim: int  # sharded dim of the (full) output
    parts: int  # > 1 until a fused projection is split
    origin: LinearSite


def _view_dim(src: tuple[int, ...], dst: tuple[int, ...], dim: int) -> int | None:
    """The dim of `dst` that carries `src`'s sharded `dim` through a view, or None when the
    shard would not stay one contiguous block (the dim is not outermost in its group)."""
    i = j = 0
    while i < len(src) and j < len(dst):
        group_i, group_j = [i], [j]
        pi, pj = src[i], dst[j]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj and i < len(src):
                pi *= src[i]
                group_i.append(i)
                i += 1
            elif j < len(dst):
                pj *= dst[j]
                group_j.append(j)
                j += 1
            else:
                return None
        if dim in group_i:
            if any(src[k] != 1 for k in group_i[: group_i.index(dim)]):
                return None
            return next((k for k in group_j if dst[k] != 1), None)
    return None


class _Carrier:
    """Walks the graph in order and carries each column output's sharding to its row linear."""

    def __init__(self, program: Program, sites: list[LinearSite], n: int):
        self.n = n
        self.shard: dict[fx.Node, _Shard] = {}
        self.args: dict[str, tuple] = {}
        self.nodes = {node.name: node for node in program.graph_module.graph.nodes}
        self.columns = {s.output: s for s in sites if s.style == "column"}
        self.rows = {s.input: s for s in sites if s.style == "row"}
        # nodes a site replaces (a column's output is where its split starts)
        self.inside = {name for s in sites for name in s.nodes} - set(self.columns)

    def fail(self, node: fx.Node, why: str, shard: _Shard) -> TPShardingError:
        site = shard.origin
        return TPShardingError(
            f"tensor parallel: node {node.name} ({target_name(node.target)}) at "
            f"{module_path(node) or '<model>'} reads the output of column-parallel "
            f"{site.module} split across ranks, and {why}.\n"
            f"  fix: rules={{{_layer_pattern(site.module)!r}: 'replicate'}} keeps that linear "
            f"whole, or mark the linear that should end the split 'row'"
        )

    def run(self) -> None:
        for node in self.nodes.values():
            if node.name in self.columns:
                site = self.columns[node.name]
                self.shard[node] = _Shard(len(_shape(node)) - 1, site.parts, site)
                continue
            if node.name in self.inside:
                continue
            inputs = [m for m in node.all_input_nodes if m in self.shard]
            if not inputs or _passive(node):
                continue
            shard = self.shard[inputs[0]]
            if node.op == "output":
                raise self.fail(node, "the model returns it", shard)
            result = self.carry(node, shard)
            if result is not None:
                self.shard[node] = result
        for name, site in self.rows.items():
            shard = self.shard.get(self.nodes[name])
            last = len(_shape(self.nodes[name])) - 1
            if shard is None or shard.dim != last or shard.parts != 1:
                got = "not split" if shard is None else f"split on dim {shard.dim}"
                raise TPShardingError(
                    f"row-parallel linear at {site.module} needs its input {name} split on "
                    f"its last dim (features), but it is {got}; add "
                    f"rules={{{_layer_pattern(site.module)!r}: 'replicate'}}"
                )

    def carry(self, node: fx.Node, shard: _Shard) -> _Shard | None:
        """The sharding of `node`'s output; records rewritten args; raises if impossible."""
        op, d, n = _op(node), shard.dim, self.n
        src = node.args[0] if node.args else None
        in_shape = _shape(src) if isinstance(src, fx.Node) else None
        out_shape = _shape(node)
        if shard.parts > 1 and op not in ELEMENTWISE | {"split", "split_with_sizes"}:
            raise self.fail(node, "the fused q/k/v output must be split first", shard)
        if op in ELEMENTWISE:
            return self._elementwise(node, shard, out_shape)
        if op in VIEWS:
            e = _view_dim(in_shape, out_shape, d)
            if e is None or out_shape[e] % n:
                raise self.fail(node, f"a view {in_shape} -> {out_shape} breaks the split", shard)
            sizes = list(node.args[1])
            if sizes[e] != -1:
                sizes[e] = out_shape[e] // n
            self.args[node.name] = (src, sizes, *node.args[2:])
            return _Shard(e, 1, shard.origin)
        if op == "transpose":
            a, b = (x % len(in_shape) for x in node.args[1:3])
            return _Shard(b if d == a else a if d == b else d, 1, shard.origin)
        if op == "permute":
            dims = [x % len(in_shape) for x in node.args[1]]
            return _Shard(dims.index(d), 1, shard.origin)
        if op == "unsqueeze":
            k = node.args[1] % len(out_shape)
            return _Shard(d + (k <= d), 1, shard.origin)
        if op in ("squeeze", "select", "slice"):
            k = node.args[1] % len(in_shape) if len(node.args) > 1 else None
            if k is None or k == d:
                raise self.fail(node, f"{op} touches the split dim {d}", shard)
            return _Shard(d - (k < d and op != "slice"), 1, shard.origin)
        if op == "expand":
            sizes = list(node.args[1])
            e = d + len(sizes) - len(in_shape)
            if sizes[e] != -1:
                sizes[e] = out_shape[e] // n
            self.args[node.name] = (src, sizes, *node.args[2:])
            return _Shard(e, 1, shard.origin)
        if op in ("split", "split_with_sizes"):
            dim = (node.args[2] if len(node.args) > 2 else 0) % len(in_shape)
            if dim != d:
                return _Shard(d, shard.parts, shard.origin)
            size = node.args[1]
            if shard.parts > 1 and isinstance(size, int) and size * shard.parts == in_shape[d]:
                self.args[node.name] = (src, size // n, *node.args[2:])
                return _Shard(d, 1, shard.origin)
            if shard.parts > 1 and not isinstance(size, int) and len(size) == shard.parts:
                self.args[node.name] = (src, [s // n for s in size], *node.args[2:])
                return _Shard(d, 1, shard.origin)
            raise self.fail(node, "splits along the split dim", shard)
        if op == "getitem":
            return shard
        if op == "cat":
            tensors, dim = node.args[0], node.args[1] if len(node.args) > 1 else 0
            if dim % len(out_shape) == d or any(
                self.shard.get(t) is None or self.shard[t].dim != d for t in tensors
            ):
                why = f"concatenates it with unsplit tensors or along dim {d}"
                raise self.fail(node, why, shard)
            return _Shard(d, 1, shard.origin)
        if op == "scaled_dot_product_attention":
            q, k, v = node.args[:3]
            heads = len(out_shape) - 3
            if any(self.shard.get(t) is None or self.shard[t].dim != heads for t in (q, k, v)):
                raise self.fail(node, "query, key and value are not all split by heads", shard)
            mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
            mshape = _shape(mask) if isinstance(mask, fx.Node) else None
            if mshape is not None and len(mshape) >= 3 and mshape[-3] != 1:
                raise self.fail(node, "its attention mask has a head dim", shard)
            return _Shard(heads, 1, shard.origin)
        if op in ("softmax", "_softmax", "_log_softmax", "log_softmax"):
            if node.args[1] % len(in_shape) == d:
                raise self.fail(node, "normalises along the split dim", shard)
            return shard
        if op == "matmul":
            a, b = node.args[:2]
            batch = len(out_shape) - 2
            split = [self.shard.get(t) for t in (a, b)]
            if d >= batch or any(s is None or s.dim != d for s in split):
                raise self.fail(node, "multiplies along the split dim", shard)
            return shard
        raise self.fail(node, f"fxstar cannot carry a split through {op or node.target}", shard)

    def _elementwise(self, node: fx.Node, shard: _Shard, out_shape) -> _Shard:
        """Broadcasting aligns dims from the right: every split input must land on one output
        dim, and an unsplit input must be broadcast (size 1 or absent) along it."""
        out_nd = len(out_shape)
        dims = {
            self.shard[m].dim + out_nd - len(_shape(m))
            for m in node.all_input_nodes
            if m in self.shard
        }
        if len(dims) != 1:
            raise self.fail(node, "combines tensors split on different dims", shard)
        dim = dims.pop()
        for m in node.all_input_nodes:
            shape = _shape(m)
            if m in self.shard or shape is None:
                continue
            k = dim - (out_nd - len(shape))
            if k >= 0 and shape[k] != 1:
                raise self.fail(node, f"combines it with unsplit {m.name} {list(shape)}", shard)
        return _Shard(dim, shard.parts, shard.origin)


# -- the sequence-sharded region ------------------------------------------------------------------


def _seq_local(node: fx.Node, seq: int, excluded: set[str]) -> bool:
    """True when `node` computes each position of dim -2 from the same position only."""
    if node.op != "call_function" or node.name in excluded:
        return False
    op = _op(node)
    shape = _shape(node)
    val = _val(node)
    if shape is None or len(shape) < 2 or shape[-2] != seq or not val.is_floating_point():
        return False
    if op in ELEMENTWISE:
        return True
    if op == "layer_norm":
        return len(node.args[1]) == 1
    if op == "rms_norm":
        return len(node.args[1]) == 1
    if op in ("mean", "sum") and len(node.args) > 1:
        nd = len(_shape(node.args[0]))
        dims = node.args[1] if isinstance(node.args[1], list | tuple) else [node.args[1]]
        keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        return bool(keep) and all(x % nd == nd - 1 for x in dims)
    return False


def _sequence_region(program: Program, sharding: Sharding, feature: set[str], n: int) -> None:
    graph = program.graph_module.graph
    nodes = {node.name: node for node in graph.nodes}
    columns = [s for s in sharding.sites if s.style == "column"]
    seqs = {(_shape(nodes[s.input]) or (0, 0))[-2] for s in columns}
    if len(seqs) != 1:
        raise TPShardingError(
            f"sequence parallel needs one sequence length (dim -2) at every column-parallel "
            f"input, found {sorted(seqs)}"
        )
    seq = seqs.pop()
    if seq % n:
        raise TPShardingError(
            f"sequence parallel splits the sequence ({seq}) across {n} ranks: make it divisible"
        )
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
        if _seq_local(nodes[s.input], seq, excluded):
            region.add(s.input)
            queue.append(s.input)
    while queue:
        node = nodes[queue.popleft()]
        neighbours = list(node.users)
        if node.name not in row_outputs:
            neighbours += node.all_input_nodes
        for m in neighbours:
            if m.name not in region and _seq_local(m, seq, excluded):
                region.add(m.name)
                queue.append(m.name)

    order = {node.name: i for i, node in enumerate(graph.nodes)}
    sharding.seq_nodes = sorted(region, key=order.__getitem__)
    for name in sharding.seq_nodes:
        node = nodes[name]
        for user in node.users:
            if user.name in region or user.name in readers or _passive(user):
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
    """A replicated `m` read by sequence-local `user`: slice it, or sum its gradient."""
    shape = _shape(m)
    val = _val(m)
    if shape is None or not val.is_floating_point():
        return
    if len(shape) >= 2 and shape[-2] == seq:
        sharding.scatters.append(Edge(m.name, user.name))
    elif len(shape) < 2 or shape[-2] == 1:
        sharding.grad_reduces.append(Edge(m.name, user.name))
    else:
        raise TPShardingError(
            f"sequence parallel: node {user.name} at {module_path(user) or '<model>'} runs on "
            f"sequence slices but reads {m.name} of shape {list(shape)}, whose dim -2 is "
            f"neither the sequence ({seq}) nor 1; turn sequence_parallel off"
        )


# -- the pass -------------------------------------------------------------------------------------


@register
class TPSharding(Pass):
    """Analysis: writes a Sharding to program.meta[META_KEY] and a 'tp' note per node."""

    name = "tp_sharding"
    tolerance = None

    def __call__(self, program: Program) -> Program:
        config = program.plan.tensor_parallel
        if config is None or config.size < 2:
            raise TPShardingError("tp_sharding needs plan.tensor_parallel with size >= 2")
        n = config.size
        sharding = Sharding(size=n, sequence_parallel=config.sequence_parallel)
        sharding.sites = _find_sites(program, dict(config.rules), n)
        if not sharding.sites:
            raise TPShardingError(
                "tensor parallel found no linear to split: name them with "
                "plan.tensor_parallel.rules (module pattern -> 'column' | 'row')"
            )
        carrier = _Carrier(program, sharding.sites, n)
        carrier.run()
        sharding.sharded = {node.name: s.dim for node, s in carrier.shard.items()}
        sharding.args = carrier.args
        if config.sequence_parallel:
            _sequence_region(program, sharding, set(sharding.sharded), n)
        program.meta[META_KEY] = sharding
        self._annotate(program, sharding)
        return program

    @staticmethod
    def _annotate(program: Program, sharding: Sharding) -> None:
        nodes = {node.name: node for node in program.graph_module.graph.nodes}
        for site in sharding.sites:
            note = site.style + (f"x{site.parts}" if site.parts > 1 else "")
            nodes[site.output].meta.setdefault(NOTES_KEY, {})["tp"] = note
        for name, dim in sharding.sharded.items():
            nodes[name].meta.setdefault(NOTES_KEY, {}).setdefault("tp", f"split(dim={dim})")
        for name in sharding.seq_nodes:
            nodes[name].meta.setdefault(NOTES_KEY, {}).setdefault("tp", "seq")
