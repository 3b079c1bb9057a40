"""A rewrite pass written outside fxstar: GELU becomes its tanh approximation.

What a rewrite pass declares, and what the PassManager then does for it:
- `phase="restructure"`: it runs after sharding and the analyses asked for on their own, and
  before placement and the chunk schedule, which see the rewritten graph;
- `rewrites=True`: the manager lints and recompiles the graph after it and marks analyses
  stale (a later pass that `requires_fresh=("shape_memory",)` gets a new measurement);
- `tolerance=(rtol, atol)`: the approximation changes numbers; under `plan.verify` the
  stage is checked against the one before within this tolerance instead of bitwise.
It decides first (which nodes, recorded on `program.decisions.custom`), then rewrites
exactly that, and says so on each node with `fxstar.note`.
"""

from __future__ import annotations

import torch

import fxstar
from fxstar import passes
from fxstar.program import Program

GELU = torch.ops.aten.gelu.default


@passes.register(name="tanh_gelu", phase="restructure", rewrites=True, tolerance=(2e-3, 2e-3),
                 replace=True)  # fmt: skip
def tanh_gelu(program: Program) -> Program:
    """Rewrite: exact GELU -> tanh approximation (cheaper on some hardware)."""
    graph = program.graph_module.graph
    chosen = [n.name for n in graph.nodes
              if n.target is GELU and n.kwargs.get("approximate", "none") == "none"]  # fmt: skip
    program.decisions.custom["tanh_gelu"] = chosen  # the decision, before the rewrite
    nodes = {n.name: n for n in graph.nodes}
    for name in chosen:
        node = nodes[name]
        node.kwargs = {**node.kwargs, "approximate": "tanh"}
        fxstar.note(node, "tanh_gelu", "approximate='tanh'")
    return program


def main() -> None:
    from fxstar.models.gpt import tiny

    model, (idx, targets) = tiny()
    plan = fxstar.Plan(passes=["tanh_gelu"], checkpoint="blocks", verify=True)
    engine = fxstar.compile(model, plan, (idx, targets))
    print("passes:", ", ".join(engine.pass_manager.names))
    # shape_memory was not asked for: checkpoint_regions requires it fresh, so it ran after
    # the rewrite, on the graph the regions are cut from
    print("stages:", ", ".join(stage.name for stage in engine.program.stages))
    print(fxstar.diff(engine, "capture", "tanh_gelu", color=False))
    print(f"rewritten: {len(engine.program.decisions.custom['tanh_gelu'])} GELUs, verified "
          "against eager within the pass's tolerance")  # fmt: skip


if __name__ == "__main__":
    main()
