"""tp_rules: how one op carries a tensor-parallel split, as a table of per-op rules.

A column linear's output is split across ranks along one dim (a `Shard`). For an op that reads
such splits, its rule says which dim of the output is split and which arguments the op needs
on a rank's slice (a view's sizes, a split's sizes), or refuses (`Refusal`, with the reason)
what would need a collective or would mix ranks' data. This is DTensor's op strategies cut
down to the one placement tensor parallel carries; `tp_sharding` walks the graph applying
them and records what they decide, and `tensor_parallel` only follows the record. A new op is
a function of a `Call` returning `Carried`, registered with `_rule(name, *aten op names)`.

Two answers beyond "split" and "refused": a reduction over the split dim returns a partial
result each rank holds (`Carried.reduce`: the rewrite all-reduces it, the exact statistic of a
norm over a whole sharded projection, as vLLM's sharded RMSNorm computes its variance); and a
refusal may name unsplit operands that, split too, would let the op carry (`Refusal.needs`:
a norm weight over the projection, a fresh buffer, a broadcast) -- `tp_demand` finds where
such a split can start.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from fxstar.errors import FxstarError
from fxstar.runtime import ops

__all__ = [
    "ELEMENTWISE",
    "FRESH",
    "LIKE",
    "RULES",
    "UNARY",
    "VIEWS",
    "Call",
    "Carried",
    "Refusal",
    "Shard",
    "TPShardingError",
    "module_path",
    "norm_dim",
    "op_name",
    "passive",
    "rule_for",
    "static_shape",
    "view_dim",
]


class TPShardingError(FxstarError, ValueError):
    """The graph cannot be split as asked; the message names the node and a rule to fix it."""


@dataclass(frozen=True)
class Shard:
    """The output is split across ranks along `dim`; with `parts` > 1 that dim holds `parts`
    equal blocks (q, k, v of a fused projection), each split on its own, until an op cuts the
    blocks apart."""

    dim: int
    parts: int = 1


@dataclass(frozen=True)
class Carried:
    """What a rule decides: the output's split (None: the op only read metadata, the output
    is whole) and, when a rank's slice needs other arguments, the args to call the op with."""

    shard: Shard | None
    args: tuple | None = None
    # 'sum' | 'mean': each rank holds a partial of the whole output; 'rms_norm' | 'layer_norm':
    # a norm over the split dim, its statistics summed across ranks
    reduce: str | None = None


# cpu_embedding's moves of ids and rows between tiers: a split passes through them as it is
HOST_MOVES = (ops.to_host, ops.to_compute)


class Refusal(Exception):
    """A rule cannot carry the split; the message says why, in a phrase. `needs`: unsplit
    operands that, split along the given dim of their own, would let the rule carry it."""

    def __init__(self, why: str, needs: tuple[tuple[fx.Node, int], ...] = ()):
        super().__init__(why)
        self.needs = needs


def op_name(node: fx.Node) -> str:
    """'view', 'add', ... for aten overloads; 'getitem'; '' for anything else."""
    target = node.target
    if node.op == "call_function" and isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    if node.op == "call_function" and getattr(target, "__name__", "") == "getitem":
        return "getitem"
    if node.op == "call_function" and target in HOST_MOVES:
        return target.__name__
    return ""


def module_path(node: fx.Node) -> str:
    """The module a node was traced in ('h.0.attn.c_attn'); '' at the model's top."""
    stack = node.meta.get("nn_module_stack")
    return list(stack.values())[-1][0] if stack else ""


def passive(node: fx.Node) -> bool:
    """A check export inserts that reads a tensor's dtype/device only: any shard passes it."""
    return (
        op_name(node) == "_assert_tensor_metadata"
        and len(node.args) == 1
        and node.kwargs.get("size") is None
        and node.kwargs.get("stride") is None
    )


def static_shape(node: Any) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    shape = tuple(val.shape)
    if not all(isinstance(s, int) for s in shape):
        raise TPShardingError(
            f"tensor parallel needs static shapes; node {node.name} has shape {shape}"
        )
    return shape


@dataclass
class Call:
    """One node as a rule sees it: its arguments, shapes, and which inputs are split."""

    node: fx.Node
    n: int  # ranks
    shards: Mapping[fx.Node, Shard]

    def shard(self, x: Any) -> Shard | None:
        return self.shards.get(x) if isinstance(x, fx.Node) else None

    def arg(self, i: int, name: str, default: Any = None) -> Any:
        args = self.node.args
        return args[i] if len(args) > i else self.node.kwargs.get(name, default)

    @property
    def x(self) -> fx.Node:
        return self.node.args[0]

    @property
    def x_shard(self) -> Shard:
        """The split of the first argument (the tensor most rules transform)."""
        shard = self.shard(self.x)
        if shard is None:
            raise Refusal("only reads the split tensor as a second operand")
        return shard

    @property
    def in_shape(self) -> tuple[int, ...]:
        return static_shape(self.x)

    @property
    def out_shape(self) -> tuple[int, ...]:
        return static_shape(self.node)

    def with_arg(self, i: int, value: Any) -> tuple:
        args = list(self.node.args)
        args[i] = value
        return tuple(args)

    def refuse_fused(self, shard: Shard, why: str) -> None:
        if shard.parts > 1:
            raise Refusal(f"{why}, but the fused output is not cut into its {shard.parts} parts")


Rule = Callable[[Call], Carried]
RULES: dict[str, tuple[str, Rule]] = {}
"""aten op name -> (rule name, rule)."""


def _rule(name: str, *ops: str) -> Callable[[Rule], Rule]:
    def register(fn: Rule) -> Rule:
        for op in ops:
            RULES[op] = (name, fn)
        return fn

    return register


def rule_for(node: fx.Node) -> tuple[str, Rule | None]:
    """(rule name, rule) for `node`; (op name, None) when no rule knows the op."""
    op = op_name(node)
    return RULES.get(op, (op or str(node.target), None))


def norm_dim(d: int, ndim: int) -> int:
    return d % ndim if ndim else 0


def _dims(given: Any, ndim: int) -> set[int]:
    """A dim argument (int, list, or None for all) as a set of non-negative dims."""
    if given is None or given == []:
        return set(range(ndim))
    return {norm_dim(k, ndim) for k in (given if isinstance(given, list | tuple) else [given])}


# -- ops that keep every dim ----------------------------------------------------------------------

ELEMENTWISE = frozenset(
    ("add", "sub", "mul", "div", "neg", "gelu", "silu", "relu", "tanh", "sigmoid", "exp", "log",
     "rsqrt", "sqrt", "pow", "erf", "dropout", "where", "masked_fill", "sin", "cos", "abs",
     "reciprocal", "square", "clamp", "minimum", "maximum", "softplus")
)  # fmt: skip
UNARY = frozenset(
    ("clone", "contiguous", "to", "_to_copy", "type_as", "alias", "detach", "detach_",
     "lift_fresh_copy")
)  # fmt: skip
VIEWS = frozenset({"view", "reshape", "_unsafe_view"})


@_rule("elementwise", *ELEMENTWISE)
def _elementwise(c: Call) -> Carried:
    """Broadcasting aligns dims from the right: every split input must land on one output dim
    with the same parts, and an unsplit input must be broadcast (size 1 or absent) along it."""
    out_nd = len(c.out_shape)
    split = [m for m in c.node.all_input_nodes if c.shard(m) is not None]
    placed = {(c.shard(m).dim + out_nd - len(static_shape(m)), c.shard(m).parts) for m in split}
    if len(placed) != 1:
        raise Refusal("combines tensors split on different dims or in different parts")
    ((dim, parts),) = placed
    needs = []
    for m in c.node.all_input_nodes:
        shape = static_shape(m)
        if c.shard(m) is not None or shape is None:
            continue
        k = dim - (out_nd - len(shape))
        if k >= 0 and shape[k] != 1:
            needs.append((m, k))
    if needs:
        m, _ = needs[0]
        raise Refusal(
            f"combines it with unsplit {m.name} {list(static_shape(m))} along dim {dim}",
            tuple(needs) if parts == 1 else (),
        )
    return Carried(Shard(dim, parts))


@_rule("unary", *UNARY, *(f.__name__ for f in HOST_MOVES))
def _unary(c: Call) -> Carried:
    """The first operand's split; any other tensor (`to(other)`, `type_as`) gives only its
    dtype or device, so a split there leaves the output whole."""
    return Carried(c.shard(c.x))


LIKE = frozenset(("zeros_like", "ones_like", "empty_like", "full_like"))
FRESH = frozenset(("new_empty", "new_zeros", "new_ones", "new_full"))


@_rule("like", *LIKE)
def _like(c: Call) -> Carried:
    """A fresh tensor of the input's shape: a rank's has the shape of its slice."""
    return Carried(c.shard(c.x))


@_rule("fresh", *FRESH)
def _fresh(c: Call) -> Carried:
    """A fresh tensor of the sizes given: the input gives only its dtype and device, so the
    output is whole (a split demanded of it later starts here: tp_demand)."""
    return Carried(None)


# -- ops that move, add or drop dims --------------------------------------------------------------


def view_dim(src: tuple[int, ...], dst: tuple[int, ...], dim: int) -> int | None:
    """The dim of `dst` that carries `src`'s split `dim` through a view, or None when a rank's
    slice would not stay one contiguous block (the dim is not outermost in its group)."""
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


@_rule("view", *VIEWS)
def _view(c: Call) -> Carried:
    """The split moves to the outermost dim of its view group (heads when [.., H*D] becomes
    [.., H, D]), whose per-rank size goes into the sizes; fused parts survive only a view that
    leaves their dim as it is."""
    src, dst, s = c.in_shape, c.out_shape, c.x_shard
    e = view_dim(src, dst, s.dim)
    if e is None:
        raise Refusal(f"the view {list(src)} -> {list(dst)} does not keep each rank's slice whole")
    if dst[e] % c.n:
        raise Refusal(f"the view {list(src)} -> {list(dst)} makes the split dim {dst[e]} long, "
                      f"not divisible by {c.n} ranks")  # fmt: skip
    if dst[e] != src[s.dim]:
        c.refuse_fused(s, f"the view {list(src)} -> {list(dst)} reshapes the split dim")
    sizes = list(c.node.args[1])
    if sizes[e] != -1:
        sizes[e] = dst[e] // c.n
    return Carried(Shard(e, s.parts), c.with_arg(1, sizes))


@_rule("flatten", "flatten", "unflatten")
def _flatten(c: Call) -> Carried:
    """A view given by dims (flatten) or by the sizes of one dim (unflatten): the split moves
    as through `view`; unflatten's sizes get the per-rank size."""
    src, dst, s = c.in_shape, c.out_shape, c.x_shard
    e = view_dim(src, dst, s.dim)
    if e is None or dst[e] % c.n:
        raise Refusal(f"the {op_name(c.node)} {list(src)} -> {list(dst)} does not keep each "
                      f"rank's slice whole")  # fmt: skip
    if dst[e] != src[s.dim]:
        c.refuse_fused(s, f"the {op_name(c.node)} {list(src)} -> {list(dst)} reshapes the split")
    if op_name(c.node) == "flatten":
        return Carried(Shard(e, s.parts))
    first = norm_dim(c.node.args[1], len(src))
    sizes = list(c.node.args[2])
    k = e - first
    if 0 <= k < len(sizes) and sizes[k] != -1:
        sizes[k] = dst[e] // c.n
    return Carried(Shard(e, s.parts), c.with_arg(2, sizes))


@_rule("transpose", "transpose", "swapaxes")
def _transpose(c: Call) -> Carried:
    s, nd = c.x_shard, len(c.in_shape)
    a, b = norm_dim(c.node.args[1], nd), norm_dim(c.node.args[2], nd)
    return Carried(Shard(b if s.dim == a else a if s.dim == b else s.dim, s.parts))


@_rule("permute", "permute")
def _permute(c: Call) -> Carried:
    s, nd = c.x_shard, len(c.in_shape)
    dims = [norm_dim(x, nd) for x in c.node.args[1]]
    return Carried(Shard(dims.index(s.dim), s.parts))


@_rule("unsqueeze", "unsqueeze")
def _unsqueeze(c: Call) -> Carried:
    s = c.x_shard
    k = norm_dim(c.node.args[1], len(c.out_shape))
    return Carried(Shard(s.dim + (k <= s.dim), s.parts))


@_rule("squeeze", "squeeze")
def _squeeze(c: Call) -> Carried:
    """Drops size-1 dims; refuses when a rank's slice of the split dim has size 1, which the
    same squeeze would drop on that rank only."""
    s, shape = c.x_shard, c.in_shape
    dims = _dims(c.arg(1, "dim", None), len(shape))
    if s.dim in dims and shape[s.dim] // c.n == 1:
        raise Refusal(f"would drop the split dim {s.dim}, of size 1 on each rank")
    dropped = sum(1 for k in dims if shape[k] == 1 and k < s.dim)
    return Carried(Shard(s.dim - dropped, s.parts))


@_rule("expand", "expand")
def _expand(c: Call) -> Carried:
    s = c.x_shard
    sizes = list(c.node.args[1])
    e = s.dim + len(sizes) - len(c.in_shape)
    if sizes[e] != -1:
        sizes[e] = c.out_shape[e] // c.n
    return Carried(Shard(e, s.parts), c.with_arg(1, sizes))


# -- ops that cut or join along a dim -------------------------------------------------------------


@_rule("select", "select")
def _select(c: Call) -> Carried:
    s = c.x_shard
    k = norm_dim(c.node.args[1], len(c.in_shape))
    if k == s.dim:
        raise Refusal(f"picks one index of the split dim {k}")
    return Carried(Shard(s.dim - (k < s.dim), s.parts))


@_rule("slice", "slice")
def _slice(c: Call) -> Carried:
    """Another dim: the split passes. The split dim: a slice of all of it passes (end clamps
    to a rank's size), and a slice of exactly one fused part becomes that part."""
    s, shape = c.x_shard, c.in_shape
    k = norm_dim(c.arg(1, "dim", 0), len(shape))
    if k != s.dim:
        return Carried(s)
    start, end, step = c.arg(2, "start", None), c.arg(3, "end", None), c.arg(4, "step", 1)
    start, end = (
        max(0, min(shape[k], x + shape[k] if x < 0 else x)) if x is not None else default
        for x, default in ((start, 0), (end, shape[k]))
    )
    if step == 1 and start == 0 and end == shape[k]:
        return Carried(s)
    part = shape[k] // s.parts
    if s.parts > 1 and step == 1 and start % part == 0 and end - start == part:
        args = list(c.node.args) + [None] * (4 - len(c.node.args))
        args[1:4] = [k, start // c.n, end // c.n]
        return Carried(Shard(k, 1), tuple(args))
    raise Refusal(f"takes [{start}:{end}:{step}] of the split dim {k}")


@_rule("split", "split", "split_with_sizes", "chunk", "unbind", "tensor_split")
def _split(c: Call) -> Carried:
    """Another dim: every piece keeps the split (Mamba's tensor_split of the sequence). The
    split dim: only cutting a fused output into its parts, which each rank does on its
    slices with sizes divided by the ranks."""
    op, s, shape = op_name(c.node), c.x_shard, c.in_shape
    k = norm_dim(c.arg(2 if op != "unbind" else 1, "dim", 0), len(shape))
    if k != s.dim:
        return Carried(Shard(s.dim - (op == "unbind" and k < s.dim), s.parts))
    if op in ("unbind", "tensor_split"):
        raise Refusal(f"{op}s the split dim {k}")
    size = c.node.args[1]
    if op == "split_with_sizes":
        pieces, equal = len(size), len(set(size)) == 1
    else:
        pieces = size if op == "chunk" else -(-shape[k] // size)
        equal = shape[k] % pieces == 0
    if s.parts == 1 or pieces != s.parts or not equal:
        why = f"cuts the split dim {k} into {pieces} pieces"
        raise Refusal(why + (f", not the fused output's {s.parts} parts" if s.parts > 1 else ""))
    if op == "split":
        return Carried(Shard(k, 1), c.with_arg(1, size // c.n))
    if op == "split_with_sizes":
        return Carried(Shard(k, 1), c.with_arg(1, [x // c.n for x in size]))
    return Carried(Shard(k, 1))  # chunk: the same count of pieces on a rank's slice


@_rule("getitem", "getitem")
def _getitem(c: Call) -> Carried:
    """An element of a split/chunk: the rule of that op gave every element the same split."""
    return Carried(c.shard(c.x))


def _empty(x: Any) -> bool:
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    return isinstance(val, torch.Tensor) and val.numel() == 0


@_rule("cat", "cat", "concat", "concatenate")
def _cat(c: Call) -> Carried:
    """All non-empty operands split alike, joined along another dim (or only one of them).
    Empty operands add nothing: transformers' DynamicCache starts as `torch.tensor([])` and
    cats each step's keys/values to it, which in training is the keys/values themselves;
    an empty operand with the full split dim is left out of a rank's cat."""
    tensors, out_nd = c.node.args[0], len(c.out_shape)
    k = norm_dim(c.arg(1, "dim", 0), out_nd)
    full = [t for t in tensors if not _empty(t)]
    unsplit = [t for t in full if c.shard(t) is None]
    if unsplit:
        t = unsplit[0]
        raise Refusal(f"concatenates it with unsplit {t.name} {list(static_shape(t))}")
    shards = {c.shard(t) for t in full}
    if len(shards) != 1:
        raise Refusal("concatenates tensors split on different dims or in different parts")
    (s,) = shards
    if k == s.dim and len(full) > 1:
        raise Refusal(f"concatenates along the split dim {k}")
    drop = any(len(static_shape(t)) == out_nd for t in tensors if _empty(t))
    return Carried(s, c.with_arg(0, list(full)) if drop else None)


def _alike(c: Call, tensors: list[fx.Node], what: str) -> Shard:
    """The one split every operand of a cat/stack has, or a refusal naming the unsplit ones
    (which, split alike, would do)."""
    shards = {c.shard(t) for t in tensors if c.shard(t) is not None}
    if len(shards) != 1:
        raise Refusal(f"{what} tensors split on different dims or in different parts")
    (s,) = shards
    unsplit = [t for t in tensors if c.shard(t) is None]
    if unsplit:
        t = unsplit[0]
        needs = tuple((u, s.dim) for u in unsplit) if s.parts == 1 else ()
        raise Refusal(f"{what} it with unsplit {t.name} {list(static_shape(t))}", needs)
    return s


@_rule("stack", "stack")
def _stack(c: Call) -> Carried:
    """Like cat along a new dim: every operand split alike; the split dim moves past the new
    one when it is inserted before it (Cohere's interleaved rotary stacks the two halves)."""
    tensors = list(c.node.args[0])
    s = _alike(c, tensors, "stacks")
    k = norm_dim(c.arg(1, "dim", 0), len(c.out_shape))
    return Carried(Shard(s.dim + (k <= s.dim), s.parts))


@_rule("copy_", "copy_", "copy")
def _copy(c: Call) -> Carried:
    """dst <- src (broadcast): both split alike along dst's split dim, or a src broadcast
    along it (size 1, or fewer dims). DeepSeek's MLA writes k_nope and the shared k_rot into
    slices of one fresh key tensor."""
    dst, src = c.node.args[:2]
    nd, snd = len(static_shape(dst)), len(static_shape(src))
    sd, ss = c.shard(dst), c.shard(src)
    if sd is None:
        k = ss.dim + nd - snd
        raise Refusal(f"writes it into unsplit {dst.name}", ((dst, k),) if ss.parts == 1 else ())
    k = sd.dim - (nd - snd)
    if ss is not None and ss != Shard(k, sd.parts):
        raise Refusal(f"writes a tensor split on dim {ss.dim} into one split on dim {sd.dim}")
    if ss is None and k >= 0 and static_shape(src)[k] != 1:
        needs = ((src, k),) if sd.parts == 1 else ()
        raise Refusal(f"writes unsplit {src.name} {list(static_shape(src))} into it", needs)
    return Carried(sd)


# -- ops that compute across dims -----------------------------------------------------------------


@_rule("attention", "scaled_dot_product_attention")
def _attention(c: Call) -> Carried:
    """Heads are independent: query, key and value split by heads, a mask without a head dim."""
    q, k, v = c.node.args[:3]
    heads = len(c.out_shape) - 3
    if any(c.shard(t) != Shard(heads) for t in (q, k, v)):
        raise Refusal("query, key and value are not all split by heads")
    mask = c.arg(3, "attn_mask", None)
    mshape = static_shape(mask)
    if mshape is not None and len(mshape) >= 3 and mshape[-3] != 1:
        raise Refusal(f"its attention mask {list(mshape)} has a head dim")
    return Carried(Shard(heads))


@_rule("conv", "conv1d", "conv2d", "conv3d")
def _conv(c: Call) -> Carried:
    """A grouped convolution over channels split across ranks: with the groups divisible by
    the ranks each rank's channels are whole groups, so its weight and bias rows are the
    matching slice and the groups are divided (Mamba's depthwise conv1d, as vLLM shards it)."""
    x, weight = c.node.args[:2]
    bias = c.arg(2, "bias", None)
    groups = c.arg(6, "groups", 1)
    s = c.shard(x)
    if s is None or s.dim != 1:
        raise Refusal("convolves with a split weight or over a split spatial dim")
    if s.parts > 1:
        c.refuse_fused(s, "convolves it")
    if groups % c.n:
        raise Refusal(f"mixes its split channels ({groups} groups, not divisible by {c.n} "
                      f"ranks)")  # fmt: skip
    needs = tuple((t, 0) for t in (weight, bias) if isinstance(t, fx.Node) and c.shard(t) is None)
    if needs:
        raise Refusal("convolves it with unsplit weights", needs)
    if any(c.shard(t) != Shard(0) for t in (weight, bias) if isinstance(t, fx.Node)):
        raise Refusal("convolves it with weights split on another dim")
    if c.node.kwargs:
        raise Refusal("is given keyword arguments (the per-rank groups go by position)")
    args = [*c.node.args, *(None, 1, 0, 1, 1)[len(c.node.args) - 2 :]]
    args[6] = groups // c.n
    return Carried(Shard(1), tuple(args))


@_rule("softmax", "softmax", "_softmax", "log_softmax", "_log_softmax")
def _softmax(c: Call) -> Carried:
    s = c.x_shard
    if norm_dim(c.node.args[1], len(c.in_shape)) == s.dim:
        raise Refusal(f"normalises along the split dim {s.dim}")
    return Carried(s)


@_rule("reduction", "sum", "mean", "amax", "amin")
def _reduction(c: Call) -> Carried:
    """Over other dims the split passes (shifted when dims are dropped). A sum or mean over
    the split dim gives each rank a partial of the whole result (the rewrite all-reduces it:
    the statistic of a norm over a whole sharded projection, OLMo2's q/k norm); a max or min
    there is refused."""
    s, nd = c.x_shard, len(c.in_shape)
    dims = _dims(c.arg(1, "dim", None), nd)
    op = op_name(c.node)
    if s.dim in dims and op in ("sum", "mean") and s.parts == 1:
        return Carried(None, reduce=op)  # a rank's part of the whole: all-reduced
    if s.dim in dims:
        raise Refusal(f"reduces over the split dim {s.dim}")
    keep = c.arg(2, "keepdim", False)
    return Carried(Shard(s.dim - (0 if keep else sum(k < s.dim for k in dims)), s.parts))


@_rule("norm", "layer_norm", "rms_norm")
def _norm(c: Call) -> Carried:
    """Normalises over the trailing normalized_shape dims (a per-head q/k norm passes). Over
    the split last dim alone (a norm over a whole sharded projection) its weight and bias are
    split with it and its statistics summed across ranks (`reduce` names the norm: the
    rewrite computes it so)."""
    s, nd = c.x_shard, len(c.in_shape)
    if s.dim < nd - len(c.node.args[1]):
        return Carried(s)
    if len(c.node.args[1]) != 1 or s.parts > 1 or c.node.kwargs:
        raise Refusal(f"normalises over the split dim {s.dim} and others, or given keywords")
    params = c.node.args[2:4] if op_name(c.node) == "layer_norm" else c.node.args[2:3]
    params = [p for p in params if isinstance(p, fx.Node)]
    needs = tuple((p, 0) for p in params if c.shard(p) is None)
    if needs:
        raise Refusal(f"normalises over the split dim {s.dim} with an unsplit weight", needs)
    return Carried(s, reduce=op_name(c.node))


def _mm_dim(split: Shard | None, nd: int, out_nd: int, rows: bool) -> int | None:
    """Where an operand's split lands in a matmul's output: None when whole, -1 on the
    contracted dim (a's last, b's second to last)."""
    if split is None:
        return None
    contracted, kept = (nd - 1, nd - 2) if rows else (nd - 2, nd - 1)
    if split.dim == contracted:
        return -1
    if split.dim == kept:
        return out_nd - 2 if rows else out_nd - 1
    return split.dim + out_nd - nd


@_rule("matmul", "matmul", "bmm", "mm")
def _matmul(c: Call) -> Carried:
    """a @ b: batched over the split dim (both operands split there, or one broadcast); a's
    rows split (b whole) split the output's rows, b's columns (a whole) its columns (Mamba's
    scan reads its state by channels); both split along the contracted dim give each rank a
    partial sum (all-reduced)."""
    a, b = c.node.args[:2]
    out_nd = len(c.out_shape)
    sa, sb = c.shard(a), c.shard(b)
    na, nb = len(static_shape(a)), len(static_shape(b))
    if na < 2 or nb < 2:
        raise Refusal("multiplies a vector with a split operand")
    if any(s is not None and s.parts > 1 for s in (sa, sb)):
        c.refuse_fused(sa or sb, "multiplies it")
    ea, eb = _mm_dim(sa, na, out_nd, True), _mm_dim(sb, nb, out_nd, False)
    if ea == eb == -1:
        return Carried(None, reduce="sum")
    if -1 in (ea, eb):
        other, k = (b, nb - 2) if ea == -1 else (a, na - 1)
        if c.shard(other) is not None:
            raise Refusal("contracts the split dim with an operand split on another dim")
        raise Refusal(f"contracts the split dim with unsplit {other.name}", ((other, k),))
    if ea is not None and eb is not None and ea != eb:
        raise Refusal("multiplies operands split on different dims")
    e = ea if ea is not None else eb
    if e < out_nd - 2:  # a batch dim: the other operand split there too, or broadcast
        other = b if ea is not None else a
        k = e - (out_nd - len(static_shape(other)))
        if c.shard(other) is None and k >= 0 and static_shape(other)[k] != 1:
            raise Refusal(f"multiplies it batched with unsplit {other.name}", ((other, k),))
    return Carried(Shard(e))
