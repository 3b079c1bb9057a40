"""tp_demand: where a split can start when an op needs a whole operand split with the rest.

A rule may refuse because an operand that is whole would have to be split too
(`tp_rules.Refusal.needs`): a norm weight as long as the sharded projection it scales (OLMo2's
q/k norms), a fresh buffer written with split values (Mamba's scan state, DeepSeek's key
tensor), a tensor broadcast along the heads (DeepSeek's shared rotary key), the parameters a
depthwise convolution or a state-space mixer reads by channel (Mamba's conv1d, A_log, D,
dt_proj). Walking the operand back through ops that keep every element in its place, this
finds where the split can start instead -- a parameter (each rank holds its slice), a fresh
tensor (each rank makes its slice), an expand of a size-1 dim (each rank expands to its
slice) -- or says why none can. The carrier starts the split there and carries it forward
with the usual rules, which check every other reader of what it split.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from torch import fx

from fxstar.passes.tp_rules import (
    ELEMENTWISE,
    FRESH,
    LIKE,
    UNARY,
    VIEWS,
    Shard,
    norm_dim,
    op_name,
    static_shape,
    view_dim,
)

__all__ = ["Seed", "find_seeds"]

# factories whose size is an argument: op -> index of the size list
_SIZED = {"zeros": 0, "ones": 0, "empty": 0, "full": 0, **dict.fromkeys(FRESH, 1)}


@dataclass(frozen=True)
class Seed:
    """A split that starts at `node` (not at a column linear), on `dim`."""

    node: str
    dim: int
    kind: str  # 'parameter' | 'fresh' | 'broadcast'
    origin: str  # the column linear whose split needed it (what a refusal blames)
    args: tuple | None = None  # per-rank args of a fresh tensor or a broadcast


class _NoSeed(Exception):
    """The split cannot start anywhere along this operand; the message says why."""


def find_seeds(
    node: fx.Node,
    dim: int,
    n: int,
    shards: Mapping[fx.Node, Shard],
    splittable_param: Callable[[fx.Node], str],
    origin: str,
) -> list[Seed] | str:
    """The seeds that make `node` split on `dim` across `n` ranks, or why there are none.
    `splittable_param(placeholder)` returns '' for a parameter that may be split on its own,
    else the reason it may not (a buffer, an input, a linear's weight, a tied weight)."""
    found: dict[str, Seed] = {}
    walk = _Walk(n, shards, splittable_param, origin, found)
    try:
        walk.need(node, dim)
    except _NoSeed as why:
        return str(why)
    return list(found.values())


@dataclass
class _Walk:
    n: int
    shards: Mapping[fx.Node, Shard]
    splittable_param: Callable[[fx.Node], str]
    origin: str
    found: dict[str, Seed]

    def need(self, node: fx.Node, dim: int) -> None:
        shape = static_shape(node)
        if shape is None:
            raise _NoSeed(f"{node.name} is not a tensor")
        have = self.shards.get(node)
        if have is not None:
            if have != Shard(dim):
                raise _NoSeed(f"{node.name} is split on dim {have.dim}, not {dim}")
            return
        if shape[dim] % self.n:
            raise _NoSeed(f"{node.name} {list(shape)} has {shape[dim]} on dim {dim}, not "
                          f"divisible by {self.n} ranks")  # fmt: skip
        seed = self.found.get(node.name)
        if seed is not None:
            if seed.dim != dim:
                raise _NoSeed(f"{node.name} would be split on dims {seed.dim} and {dim}")
            return
        if node.op == "placeholder":
            why = self.splittable_param(node)
            if why:
                raise _NoSeed(why)
            self._seed(node, dim, "parameter")
            return
        op = op_name(node)
        if op in _SIZED:
            self._fresh(node, dim, _SIZED[op])
        elif op == "expand":
            self._expand(node, dim, shape)
        else:
            for m, k in self._sources(node, op, dim, shape):
                self.need(m, k)

    def _seed(self, node: fx.Node, dim: int, kind: str, args: tuple | None = None) -> None:
        self.found[node.name] = Seed(node.name, dim, kind, self.origin, args)

    def _fresh(self, node: fx.Node, dim: int, index: int) -> None:
        args = list(node.args)
        sizes = list(args[index])
        if not all(isinstance(s, int) for s in sizes):
            raise _NoSeed(f"{node.name} has symbolic sizes {sizes}")
        sizes[dim] //= self.n
        args[index] = sizes
        self._seed(node, dim, "fresh", tuple(args))

    def _expand(self, node: fx.Node, dim: int, shape: tuple[int, ...]) -> None:
        x = node.args[0]
        xs = static_shape(x)
        k = dim - (len(shape) - len(xs))
        if k >= 0 and xs[k] != 1:  # expanded along other dims: the input carries the split
            self.need(x, k)
            return
        sizes = list(node.args[1])
        sizes[dim] = shape[dim] // self.n
        self._seed(node, dim, "broadcast", (x, sizes, *node.args[2:]))

    def _sources(
        self, node: fx.Node, op: str, dim: int, shape: tuple[int, ...]
    ) -> list[tuple[fx.Node, int]]:
        """The inputs (and their dims) that carry `node`'s dim `dim` element for element."""
        nd = len(shape)
        args = node.args
        if op in ELEMENTWISE or op in UNARY or op in LIKE or op in ("copy_", "copy"):
            first = [args[0]] if op in UNARY or op in LIKE or op in ("copy_", "copy") else None
            out = []
            for m in first or node.all_input_nodes:
                ms = static_shape(m)
                k = dim - (nd - len(ms or ()))
                if ms is not None and k >= 0 and ms[k] != 1:
                    out.append((m, k))
            return out
        if op == "unsqueeze":
            d = norm_dim(args[1], nd)
            return [(args[0], dim - (d < dim))] if d != dim else self._no(node, "a new dim")
        if op == "squeeze":
            xs = static_shape(args[0])
            given = args[1] if len(args) > 1 else None
            dims = set(range(len(xs))) if given is None else {
                norm_dim(d, len(xs)) for d in (given if isinstance(given, list | tuple)
                                              else [given])
            }  # fmt: skip
            kept = [k for k in range(len(xs)) if not (k in dims and xs[k] == 1)]
            return [(args[0], kept[dim])]
        if op in ("transpose", "swapaxes"):
            a, b = norm_dim(args[1], nd), norm_dim(args[2], nd)
            return [(args[0], b if dim == a else a if dim == b else dim)]
        if op == "permute":
            return [(args[0], norm_dim(args[1][dim], nd))]
        if op in VIEWS or op in ("flatten", "unflatten"):
            xs = static_shape(args[0])
            k = view_dim(shape, xs, dim)
            if k is None or view_dim(xs, shape, k) != dim:
                return self._no(node, f"the reshape {list(xs)} -> {list(shape)}")
            return [(args[0], k)]
        if op == "select":
            d = norm_dim(args[1], nd + 1)
            return [(args[0], dim + (d <= dim))]
        if op == "slice":
            d = norm_dim(args[1] if len(args) > 1 else 0, nd)
            xs = static_shape(args[0])
            if d == dim and xs[d] != shape[d]:
                return self._no(node, f"a slice of dim {dim}")
            return [(args[0], dim)]
        if op == "getitem":
            return [self._piece(node, dim, nd)]
        if op in ("cat", "concat", "concatenate"):
            d = norm_dim(args[1] if len(args) > 1 else 0, nd)
            if d == dim:
                return self._no(node, "a concatenation along it")
            return [(t, dim) for t in args[0] if math.prod(static_shape(t)) > 0]
        if op == "stack":
            d = norm_dim(args[1] if len(args) > 1 else 0, nd)
            if d == dim:
                return self._no(node, "the stacked dim")
            return [(t, dim - (d < dim)) for t in args[0]]
        if op in ("matmul", "mm", "bmm"):
            a, b = args[:2]
            na, nb = len(static_shape(a)), len(static_shape(b))
            if dim == nd - 2:
                return [(a, na - 2)]
            if dim == nd - 1:
                return [(b, nb - 1)]
            out = []
            for m, mn in ((a, na), (b, nb)):
                k = dim - (nd - mn)
                if k >= 0 and static_shape(m)[k] != 1:
                    out.append((m, k))
            return out
        return self._no(node, f"{op or node.target}")

    def _piece(self, node: fx.Node, dim: int, nd: int) -> tuple[fx.Node, int]:
        """A piece of a split, chunk, tensor_split or unbind cut along another dim holds
        every element of the input's `dim` in place (Mamba's tensor_split of the sequence):
        the split starts on the input, and every piece carries it (tp_rules' split rule)."""
        cut = node.args[0]
        op = op_name(cut)
        if op in ("split", "split_with_sizes", "chunk", "tensor_split"):
            d = norm_dim(cut.args[2] if len(cut.args) > 2 else cut.kwargs.get("dim", 0), nd)
            if d != dim:
                return cut.args[0], dim
        elif op == "unbind":
            d = norm_dim(cut.args[1] if len(cut.args) > 1 else cut.kwargs.get("dim", 0), nd + 1)
            return cut.args[0], dim + (d <= dim)
        return self._no(node, "a piece cut along it")

    @staticmethod
    def _no(node: fx.Node, what: str) -> list:
        raise _NoSeed(f"{node.name} ({what}) cannot start a split")
