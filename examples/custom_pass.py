"""A pass written outside fxstar: annotate every linear with its forward FLOPs, per block.

Registered with `@fxstar.passes.register`, listed in `plan.passes` by name, ordered after
the built-in `shape_memory` (both in the `analyse` phase); its notes (`fxstar.note`) show in
`fxstar.dump` and `fxstar.diff`, its decision is `program.decisions.custom["linear_flops"]`.
A pass that rewrites the graph: examples/rewrite_pass.py.

Which module a node came from is in `node.meta["nn_module_stack"]`, as torch.export records
it: a dict whose values are `(path, class name)` of each module the call went through,
outermost first. For the reference GPT's first attention projection:

    {'L__self__': ('', 'fxstar.models.gpt.GPT'),
     'L__self__h.0': ('h.0', 'fxstar.models.gpt.Block'),
     'L__self__h.0.attn': ('h.0.attn', 'fxstar.models.gpt.CausalSelfAttention'),
     'L__self__h.0.attn.c_attn': ('h.0.attn.c_attn', 'torch.nn.modules.linear.Linear')}

(the keys are export's own names: read the values). Placeholders and the output have none, nor
do nodes a pass inserts unless it copies the entry from the node it replaces (the built-in
rewrites do). `block_of` below groups by it: the first module of the stack whose path ends in
an index (`h.0`: a block of a ModuleList), else the outermost named module (`head`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx

from fxstar import passes
from fxstar.dump import diff, dump, note
from fxstar.program import Program


@dataclass
class LinearFlops:
    total: int = 0
    per_block: dict[str, int] = field(default_factory=dict)


def block_of(node: fx.Node) -> str:
    """The block `node` came from, by node.meta["nn_module_stack"] ('(root)' without one)."""
    paths = [path for path, _ in (node.meta.get("nn_module_stack") or {}).values() if path]
    for path in paths:
        if path.rsplit(".", 1)[-1].isdigit():
            return path
    return paths[0] if paths else "(root)"


@passes.register(name="linear_flops", after=("shape_memory",), replace=True)
def linear_flops(program: Program) -> Program:
    """Analysis: 2 * batch * in * out FLOPs on each aten.linear, the total and per block."""
    flops = LinearFlops()
    for node in program.graph_module.graph.nodes:
        if node.target is torch.ops.aten.linear.default:
            x, w = node.args[0].meta["val"], node.args[1].meta["val"]
            count = 2 * x.numel() * w.shape[0]
            note(node, "flops", f"{count:,}")
            flops.total += count
            block = block_of(node)
            flops.per_block[block] = flops.per_block.get(block, 0) + count
    program.decisions.custom["linear_flops"] = flops
    return program


def main() -> None:
    from fxstar.engine import compile
    from fxstar.models.gpt import tiny
    from fxstar.plan import Plan

    model, (idx, targets) = tiny()
    engine = compile(model, Plan(passes=["linear_flops", "shape_memory"]), (idx, targets))
    print(dump(engine, "linear_flops"))
    print(diff(engine, "shape_memory", "linear_flops"))
    flops = engine.program.decisions.custom["linear_flops"]
    print(f"linear FLOPs per forward: {flops.total:,}")
    print("per block: " + ", ".join(f"{b} {n:,}" for b, n in flops.per_block.items()))


if __name__ == "__main__":
    main()
