"""tp_carry: carry each column linear's split through the graph to the linears that end it, op
by op with tp_rules, in one walk that collects every node it cannot carry (not only the first)
and the splits that must start elsewhere (tp_demand's seeds).

A refusal whose operands could be split (`Refusal.needs`) is not a failure when tp_demand
finds where their split can start: the walk records those seeds and carries on as if the
operands were split, so the next walk, started from them too, sees every consequence at
once (a deep model needs as many walks as a block does, not as many as it has blocks). A node
that cannot be carried poisons what reads it: its readers fail because of it, so they are
not reported; everything else still is.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from fxstar.dump import target_name
from fxstar.passes.tp_demand import Seed, find_seeds
from fxstar.passes.tp_rules import (
    Call,
    Refusal,
    Shard,
    module_path,
    op_name,
    passive,
    rule_for,
    static_shape,
)
from fxstar.program import Program

if TYPE_CHECKING:
    from fxstar.passes.tp_sharding import LinearSite

__all__ = ["Carrier", "Edge", "Failure", "needs_grad"]


@dataclass(frozen=True)
class Edge:
    """A tensor `producer` read by `consumer` that needs a collective in between."""

    producer: str
    consumer: str


@dataclass(frozen=True)
class Failure:
    """A node the split cannot pass, and the linears whose splits reach it (`blame`: keeping
    those whole is a fix)."""

    node: str
    op: str  # the node's target, as dumps name it
    module: str
    what: str  # what stops the split there, in a sentence
    blame: tuple[str, ...]


_NO_GRAD = frozenset({"detach", "detach_", "lift_fresh_copy", "_assert_tensor_metadata"})


def _floating(val: Any) -> bool:
    if isinstance(val, list | tuple):
        return any(_floating(v) for v in val)
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def needs_grad(program: Program) -> set[fx.Node]:
    """Nodes whose value a parameter reaches through differentiable ops (export's values do
    not say: their requires_grad is False)."""
    slots = program.placeholder_kinds()
    grad: set[fx.Node] = set()
    for node in program.graph_module.graph.nodes:
        if node.op == "placeholder":
            slot = slots.get(node.name)
            if slot is not None and slot.kind == "parameter":
                grad.add(node)
        elif (
            node.op == "call_function" and op_name(node) not in _NO_GRAD
            and _floating(node.meta.get("val")) and any(m in grad for m in node.all_input_nodes)
        ):  # fmt: skip
            grad.add(node)
    return grad


class Carrier:
    """One walk of the graph in order: each column output's split carried to its row linear,
    splits started at `seeds`, and what could not be carried collected in `failures`.

    `implied_row(linear)`: the row-parallel site a linear that no rule names becomes when it
    reads features split across ranks (None: it stays a failure)."""

    def __init__(
        self,
        program: Program,
        sites: list[LinearSite],
        n: int,
        seeds: dict[str, Seed],
        splittable_param: Callable[[fx.Node], str],
        implied_row: Callable[[fx.Node, Shard], LinearSite | str],
        grad: set[fx.Node],
    ):
        self.n = n
        self.seeds = seeds
        self.splittable_param = splittable_param
        self.implied_row = implied_row
        self.needs_grad = grad
        self.shard: dict[fx.Node, Shard] = {}
        self.origin: dict[fx.Node, str] = {}  # split node -> the column module it comes from
        self.args: dict[str, tuple] = {}
        self.carried_by: dict[str, str] = {}
        self.grad_reduces: list[Edge] = []
        self.reduced: dict[str, str] = {}  # node -> 'sum' | 'mean': partial, all-reduced
        self.split_params: dict[str, int] = {}  # placeholder -> dim, split outside linears
        self.implied: list[LinearSite] = []  # row sites found on the walk
        self.failures: list[Failure] = []
        self.demands: dict[str, Seed] = {}  # seeds this walk found missing
        self.poisoned: set[fx.Node] = set()
        self.nodes = {node.name: node for node in program.graph_module.graph.nodes}
        self.columns = {s.output: s for s in sites if s.style == "column"}
        self.rows = {s.input: s for s in sites if s.style == "row"}
        # nodes a site replaces (a column's output is where its split starts)
        self.inside = {name for s in sites for name in s.nodes} - set(self.columns)

    def run(self) -> None:
        for node in self.nodes.values():
            if node.name in self.columns:
                site = self.columns[node.name]
                self.shard[node] = Shard(len(static_shape(node)) - 1, site.parts)
                self.origin[node] = site.module
            elif node.name in self.seeds:
                self._start(node, self.seeds[node.name])
            elif node.name in self.inside or passive(node):
                continue
            elif any(m in self.poisoned for m in node.all_input_nodes):
                self.poisoned.add(node)  # fails because of a failure already reported
            elif any(m in self.shard for m in node.all_input_nodes):
                self.carry(node)
        for name, site in self.rows.items():
            node = self.nodes[name]
            if node in self.poisoned:
                continue
            shard = self.shard.get(node)
            last = len(static_shape(node)) - 1
            if shard is None or shard != Shard(last):
                got = "not split" if shard is None else f"split on dim {shard.dim}"
                blame = (site.module,) + ((self.origin[node],) if shard is not None else ())
                what = (f"row-parallel linear at {site.module} needs its input {name} split "
                        f"on its last dim (features), but it is {got}")  # fmt: skip
                self.failures.append(
                    Failure(name, target_name(node.target), site.module, what, blame)
                )

    def _start(self, node: fx.Node, seed: Seed) -> None:
        self.shard[node] = Shard(seed.dim)
        self.origin[node] = seed.origin
        self.carried_by[node.name] = seed.kind
        if seed.args is not None:
            self.args[node.name] = seed.args
        if seed.kind == "parameter":
            self.split_params[node.name] = seed.dim
        self._reduce_grads(node)

    def _reduce_grads(self, node: fx.Node) -> None:
        """Replicated inputs with a gradient read by split work: their gradient is partial
        on each rank, summed across them."""
        for m in node.all_input_nodes:
            if m not in self.shard and m in self.needs_grad:
                self.grad_reduces.append(Edge(m.name, node.name))

    def _origins(self, node: fx.Node) -> tuple[str, ...]:
        return tuple(
            dict.fromkeys(self.origin[m] for m in node.all_input_nodes if m in self.origin)
        )

    def fail(self, node: fx.Node, why: str) -> None:
        origins = self._origins(node)
        text = f"reads the split output of column-parallel {', '.join(origins)}, and {why}"
        op = target_name(node.target) if node.op != "output" else "output"
        self.failures.append(Failure(node.name, op, module_path(node), text, origins))
        self.poisoned.add(node)

    def carry(self, node: fx.Node) -> None:
        """Record `node`'s split, per-rank args and replicated inputs whose grads are summed."""
        if node.op == "output":
            self.fail(node, "no rule carries a split: it is returned by the model; a KV cache "
                      "returned in training is not needed: config.use_cache=False")  # fmt: skip
            return
        if op_name(node) == "linear":
            x = node.args[0]
            if x in self.shard:
                site = self.implied_row(node, self.shard[x])
                if isinstance(site, str):
                    self.fail(node, f"no rule carries a split: {site}")
                    return
                self.implied.append(site)  # its weight is split, its output whole
                return
        rule_name, rule = rule_for(node)
        if rule is None:
            self.fail(node, f"no rule carries a split: it is {rule_name}, which tp_rules has "
                            "no rule for")  # fmt: skip
            return
        assumed: dict[fx.Node, Shard] = {}
        shards = ChainMap(assumed, self.shard)
        while True:
            try:
                carried = rule(Call(node, self.n, shards))
                break
            except Refusal as refusal:
                missing = self._seed(node, refusal, shards)
                if isinstance(missing, str):
                    self.fail(node, f"rule {rule_name!r} cannot carry the split: it {missing}")
                    return
                assumed.update(missing)
        if carried.reduce is not None:
            self.reduced[node.name] = carried.reduce
        if carried.shard is None:
            return
        self.shard[node] = carried.shard
        self.origin[node] = self._origins(node)[0]
        self.carried_by[node.name] = rule_name
        if carried.args is not None:
            self.args[node.name] = carried.args
        self._reduce_grads(node)

    def _seed(
        self, node: fx.Node, refusal: Refusal, shards: ChainMap
    ) -> dict[fx.Node, Shard] | str:
        """The operands a refusal needs split, once seeds for them are recorded (the walk
        goes on as if they were split); or the refusal's words when they cannot be."""
        needs = [(m, d) for m, d in refusal.needs if m not in shards]
        if not needs:
            return str(refusal)
        origin = self._origins(node)[0]
        for m, d in needs:
            seeds = find_seeds(m, d, self.n, shards, self.splittable_param, origin)
            if isinstance(seeds, str):
                return f"{refusal}, and no split can start there: {seeds}"
            for seed in seeds:
                known = self.demands.get(seed.node)
                if known is not None and known.dim != seed.dim:
                    return f"{refusal}, and {seed.node} would be split on two dims"
                self.demands.setdefault(seed.node, seed)
        return {m: Shard(d) for m, d in needs}
