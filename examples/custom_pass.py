"""A pass written outside fxstar: annotate every linear with its forward FLOPs.

Registered with `@fxstar.passes.register`, listed in `plan.passes` by name, ordered after
the built-in `shape_memory` (both in the `analyse` phase); its notes (`fxstar.note`) show in
`fxstar.dump` and `fxstar.diff`, its decision is `program.decisions.custom["linear_flops"]`.
A pass that rewrites the graph: examples/rewrite_pass.py.
"""

from __future__ import annotations

import torch

from fxstar import passes
from fxstar.dump import diff, dump, note
from fxstar.program import Program


@passes.register(name="linear_flops", after=("shape_memory",), replace=True)
def linear_flops(program: Program) -> Program:
    """Analysis: 2 * batch * in * out FLOPs on each aten.linear, and the total."""
    total = 0
    for node in program.graph_module.graph.nodes:
        if node.target is torch.ops.aten.linear.default:
            x, w = node.args[0].meta["val"], node.args[1].meta["val"]
            flops = 2 * x.numel() * w.shape[0]
            note(node, "flops", f"{flops:,}")
            total += flops
    program.decisions.custom["linear_flops"] = total
    return program


def main() -> None:
    from fxstar.engine import compile
    from fxstar.models.gpt import tiny
    from fxstar.plan import Plan

    model, (idx, targets) = tiny()
    engine = compile(model, Plan(passes=["linear_flops", "shape_memory"]), (idx, targets))
    print(dump(engine, "linear_flops"))
    print(diff(engine, "shape_memory", "linear_flops"))
    print(f"linear FLOPs per forward: {engine.program.decisions.custom['linear_flops']:,}")


if __name__ == "__main__":
    main()
