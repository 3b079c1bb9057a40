"""tiled_linear: split large linears into in_splits x out_splits tiles (DeepSpeed's
memory-centric tiling), so that no single weight, and no chunk holding one, has to be as
large as the whole.

Each weight of at least `min_size` elements becomes separate parameters cut from it, named
`<weight>.tile_<i>_<j>` (i: input slice, j: output slice), through `ParameterStore.derive`:
`state_dict()` glues them back to the original name and shape, optimizer groups match the
original name. The output is accumulated tile by tile, the bias added once at the end:

    y_j = sum_i linear(x[..., in_i], W[out_j, in_i])      y = cat_j(y_j) + b

Works on `aten.linear` (weight [out, in]) and GPT-2 Conv1D's `aten.addmm(b, x, W)` (weight
[in, out], so tiles are `mm`s). A weight with other uses (an lm head tied to the embedding)
is left whole, with a note in the dump. Summing over input tiles reassociates fp32 sums:
the pass declares its tolerance for `plan.verify`.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace

import torch
from torch import fx

from fxstar.dump import NOTES_KEY, note
from fxstar.params import ParameterStore
from fxstar.passes import Pass, register
from fxstar.program import ParamInfo, Program

__all__ = ["TOLERANCE", "TiledLinear", "split_sizes"]

TOLERANCE = (1e-4, 1e-6)
"""(rtol, atol) of fp32 reassociation over input tiles, for loss and every gradient."""


aten = torch.ops.aten


def split_sizes(n: int, k: int) -> list[int]:
    """`n` cut into `k` nearly equal parts, larger ones first (like torch.tensor_split)."""
    k = min(k, n)
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def _offsets(sizes: list[int]) -> list[int]:
    out, at = [], 0
    for s in sizes:
        out.append(at)
        at += s
    return out


class _Tiling:
    """How one weight is cut: rows/columns of its (out, in) view, in the weight's layout."""

    def __init__(self, shape: tuple[int, ...], in_dim: int, in_splits: int, out_splits: int):
        self.in_dim, self.out_dim = in_dim, 1 - in_dim
        self.in_sizes = split_sizes(shape[in_dim], in_splits)
        self.out_sizes = split_sizes(shape[1 - in_dim], out_splits)

    def suffix(self, i: int, j: int) -> str:
        return f"tile_{i}_{j}"

    def tiles(self) -> list[tuple[int, int]]:
        return [(i, j) for j in range(len(self.out_sizes)) for i in range(len(self.in_sizes))]

    def make_parts(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        parts = {}
        ins, outs = _offsets(self.in_sizes), _offsets(self.out_sizes)
        for i, j in self.tiles():
            tile = weight.narrow(self.in_dim, ins[i], self.in_sizes[i])
            tile = tile.narrow(self.out_dim, outs[j], self.out_sizes[j])
            parts[self.suffix(i, j)] = tile.contiguous()
        return parts

    def consolidate(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        by_suffix = {name.rsplit(".", 1)[-1]: t for name, t in parts.items()}
        columns = []
        for j in range(len(self.out_sizes)):
            row = [by_suffix[self.suffix(i, j)] for i in range(len(self.in_sizes))]
            columns.append(torch.cat(row, dim=self.in_dim))
        return torch.cat(columns, dim=self.out_dim)


def _linear_parts(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None, int] | None:
    """(input, weight, bias, weight's input dim) of a linear or Conv1D addmm node."""
    if node.target is aten.linear.default:
        x, w, *rest = node.args
        return x, w, (rest[0] if rest else node.kwargs.get("bias")), 1
    if node.target is aten.addmm.default and not node.kwargs:
        b, x, w = node.args
        return x, w, b, 0
    return None


@register
class TiledLinear(Pass):
    """Rewrite: large linears become tiles on derived parameters."""

    name = "tiled_linear"
    phase = "restructure"
    rewrites = True
    tolerance = TOLERANCE
    before = ("checkpoint_regions", "activation_checkpoint")
    implements = ("tiled_linear",)

    def enabled_by(self, plan) -> bool:
        return plan.tiled_linear is not None

    def __call__(self, program: Program) -> Program:
        config = program.plan.tiled_linear
        if config is None or config.in_splits * config.out_splits == 1:
            return program
        program.decisions.tiled_linear = choices = decide(program, config)
        if choices and program.store is None:
            program.store = ParameterStore(program.model)
        nodes = {n.name: n for n in program.graph_module.graph.nodes}
        for choice in choices:
            x, w, bias, _ = _linear_parts(nodes[choice.node])
            _tile(program, nodes[choice.node], x, w, bias, program.param(choice.weight),
                  choice.tiling)  # fmt: skip
        return program


@dataclass(frozen=True)
class TileChoice:
    """One linear to tile (tiled_linear's decision): its node, its weight, the cut."""

    node: str
    weight: str
    tiling: _Tiling


def decide(program: Program, config) -> list[TileChoice]:
    """The linears whose weight is large enough and read once; notes say why others are not."""
    fed = program.placeholder_kinds()
    graph = program.graph_module.graph
    choices = []
    for node in graph.nodes:
        parts = _linear_parts(node)
        if parts is None:
            continue
        _, w, _, in_dim = parts
        slot = fed.get(w.name) if isinstance(w, fx.Node) else None
        if slot is None or slot.kind != "parameter":
            continue
        info = program.param(slot.target)
        if info.numel < config.min_size or len(info.shape) != 2:
            continue
        uses = sum(len(n.users) for n in graph.nodes if n.name in info.placeholders)
        if uses > 1:
            note(node, "tiled_linear", f"not tiled: {slot.target} has {uses} uses (tied weight)")
            continue
        tiling = _Tiling(info.shape, in_dim, config.in_splits, config.out_splits)
        choices.append(TileChoice(node.name, info.name, tiling))
    return choices


def _tile(
    program: Program,
    node: fx.Node,
    x: fx.Node,
    w: fx.Node,
    bias: fx.Node | None,
    info: ParamInfo,
    tiling: _Tiling,
) -> None:
    graph = program.graph_module.graph
    parts = program.store.derive(info.name, tiling.make_parts, tiling.consolidate)
    names = {full.rsplit(".", 1)[-1]: full for full in parts}
    base = w.name
    tiles = {}
    for i, j in tiling.tiles():
        suffix = tiling.suffix(i, j)
        tiles[i, j] = program.add_input("parameter", names[suffix], f"{base}_{suffix}")
    stack = node.meta.get("nn_module_stack")
    made: list[fx.Node] = []

    def emit(target, *args) -> fx.Node:
        with graph.inserting_before(node):
            new = graph.call_function(target, args)
        if stack is not None:
            new.meta["nn_module_stack"] = stack
        made.append(new)
        return new

    xs = [x]
    if len(tiling.in_sizes) > 1:
        split = emit(aten.split_with_sizes.default, x, tiling.in_sizes, -1)
        xs = [emit(operator.getitem, split, i) for i in range(len(tiling.in_sizes))]
    matmul = aten.linear.default if tiling.in_dim == 1 else aten.mm.default
    outs = []
    for j in range(len(tiling.out_sizes)):
        acc = None
        for i in range(len(tiling.in_sizes)):
            y = emit(matmul, xs[i], tiles[i, j])
            acc = y if acc is None else emit(aten.add.Tensor, acc, y)
        outs.append(acc)
    out = outs[0] if len(outs) == 1 else emit(aten.cat.default, outs, -1)
    if bias is not None:
        out = emit(aten.add.Tensor, out, bias)
    out.meta["val"] = node.meta.get("val")
    out.meta[NOTES_KEY] = {
        "tiled_linear": f"{len(tiling.in_sizes)}x{len(tiling.out_sizes)} tiles of {info.name}"
    }
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    program.remove_input(w)
    index = program.params.index(info)
    program.params[index : index + 1] = [
        replace(
            info,
            name=full,
            aliases=(full,),
            placeholders=(tiles[i, j].name,),
            shape=tuple(parts[full].shape),
        )
        for (i, j), full in ((k, names[tiling.suffix(*k)]) for k in tiling.tiles())
    ]
