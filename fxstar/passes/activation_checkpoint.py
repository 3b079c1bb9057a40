"""activation_checkpoint: fuse each chosen region into a submodule recomputed in backward.

Follows the decision of `checkpoint_regions`. The form, which later passes descend into:

    checkpoint_0 = self.checkpoint_0                      # get_attr of an fx.GraphModule
    h_0 = recompute.run_region(checkpoint_0, dropout, p_h_0_ln_1_weight, ...)
        <the region's nodes, printed indented under the call>

- a region is a submodule `checkpoint_<i>` of the program's GraphModule whose placeholders
  are the region's inputs, named after the outer nodes that feed them; parameters used
  inside are inputs too (never get_attr), so a pass that fetches parameters for the region
  can put its nodes inside it, and they run again during recomputation; a runtime object
  the program's graph holds (the tensor-parallel `tp_group`) the region holds too, as a
  get_attr of its own, so recomputation finds it (its RNG stream is replayed);
- the call is a call_function node with the get_attr of the submodule among its arguments
  (the first one here; `region_of(node)` finds it, whatever wraps the call); the submodule
  is marked (`meta[REGION_KEY]`, the region's module path), so the submodules of torch's
  own higher-order ops (`wrap_with_set_grad_enabled` for a `torch.no_grad()` block,
  `wrap_with_autocast`) are not taken for regions; with one output the call's value is that
  output, with several a tuple read through `getitem`s;
- `run_region` calls `torch.utils.checkpoint.checkpoint(region, *inputs,
  use_reentrant=False)`, which saves only the inputs and replays the RNG state (dropout);
- the inputs the region's recomputation takes from copies (`Region.copied`: what is written in
  place from its forward on, BatchNorm's running statistics) are named, as the submodule's
  placeholders, in `meta[COPIED_INPUTS_KEY]`; the call's notes name what it writes.
Runs before the chunk passes (`chunk_layout`, `chunk_schedule`) so their fetch/release nodes
land inside regions and are recomputed with them.
"""

from __future__ import annotations

import operator

from torch import fx, nn

from fxstar.dump import NOTES_KEY, note
from fxstar.passes import Pass, register
from fxstar.passes.checkpoint_regions import Region, model_names
from fxstar.program import Program
from fxstar.runtime.recompute import COPIED_INPUTS_KEY, run_region
from fxstar.sizes import format_size

__all__ = [
    "REGION_KEY",
    "REGION_PREFIX",
    "ActivationCheckpoint",
    "fuse_region",
    "region_calls",
    "region_of",
]

REGION_PREFIX = "checkpoint_"
REGION_KEY = "fxstar.region"
"""GraphModule.meta key that marks a region submodule (value: the region's module path)."""


def _region_arg(node: fx.Node) -> tuple[int, fx.GraphModule] | None:
    """(position, submodule) of the first argument of `node` that is a region's get_attr."""
    if node.op != "call_function":
        return None
    for i, arg in enumerate(node.args):
        if isinstance(arg, fx.Node) and arg.op == "get_attr":
            module = getattr(node.graph.owning_module, str(arg.target), None)
            if isinstance(module, fx.GraphModule) and REGION_KEY in module.meta:
                return i, module
    return None


def _held_runtime(gm: fx.GraphModule, node: fx.Node) -> bool:
    """A get_attr of a module that is not a region: a runtime object the graph holds."""
    if node.op != "get_attr":
        return False
    module = getattr(gm, str(node.target), None)
    return isinstance(module, nn.Module) and not isinstance(module, fx.GraphModule)


def region_of(node: fx.Node) -> fx.GraphModule | None:
    """The region submodule a call node runs, or None if it is not a region call."""
    found = _region_arg(node)
    return None if found is None else found[1]


def region_inputs(node: fx.Node) -> tuple[int, tuple]:
    """(index of the first region input in node.args, the inputs): what follows the region's
    own get_attr argument (an offloaded call has other modules before it)."""
    found = _region_arg(node)
    if found is None:
        raise ValueError(f"{node.name} is not a region call")
    return found[0] + 1, tuple(node.args[found[0] + 1 :])


def region_calls(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.GraphModule]]:
    """(call node, region submodule) of every region, in graph order."""
    return [(n, m) for n in gm.graph.nodes if (m := region_of(n)) is not None]


def fuse_region(program: Program, region: Region, name: str) -> fx.Node:
    """Move `region`'s nodes into submodule `name`, called through `run_region`."""
    gm = program.graph_module
    graph = gm.graph
    by_name = {n.name: n for n in graph.nodes}
    nodes = [by_name[n] for n in region.nodes]
    members = set(nodes)
    inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in members))
    # a runtime object the program's graph holds (the tensor-parallel group): the region
    # holds it too, rather than take it as an input
    held = [a for a in inputs if _held_runtime(gm, a)]
    inputs = [a for a in inputs if a not in held]
    outputs = [n for n in nodes if any(u not in members for u in n.users)]
    if not outputs:
        raise ValueError(f"checkpoint region {region.module!r} has no outputs used after it")

    body = fx.Graph()
    env: dict[fx.Node, fx.Node] = {a: body.get_attr(a.target) for a in held}
    for a in inputs:
        env[a] = body.placeholder(a.name)
        env[a].meta = {k: a.meta[k] for k in ("val", "tensor_meta") if k in a.meta}
    for n in nodes:
        env[n] = body.node_copy(n, env.__getitem__)
    body.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[o] for o in outputs))
    submodule = fx.GraphModule(gm, body, class_name=name)
    submodule.meta[REGION_KEY] = region.module
    copied = [env[a].name for a in inputs if a.name in region.copied]
    if copied:
        submodule.meta[COPIED_INPUTS_KEY] = tuple(copied)
    gm.add_submodule(name, submodule)

    with graph.inserting_after(nodes[-1]):
        module_node = graph.get_attr(name)
    with graph.inserting_after(module_node):
        call = graph.create_node(
            "call_function", run_region, (module_node, *inputs), name=_python_name(region.module)
        )
    call.meta["nn_module_stack"] = _region_stack(nodes[0], region.module)
    saved = f"{format_size(region.saved_bytes)} -> {format_size(region.keep_bytes)}"
    call.meta[NOTES_KEY] = {"region": region.module, "nodes": len(nodes)}
    if region.saved_bytes:
        note(call, "saved", saved)
    if region.writes:
        note(call, "writes", model_names(program, region.writes))
    if len(outputs) == 1:
        call.meta["val"] = outputs[0].meta.get("val")
        results = [call]
    else:
        call.meta["val"] = tuple(o.meta.get("val") for o in outputs)
        results = []
        last = call
        for i, o in enumerate(outputs):
            with graph.inserting_after(last):
                last = graph.call_function(operator.getitem, (call, i))
            last.meta["val"] = o.meta.get("val")
            results.append(last)
    for old, new in zip(outputs, results, strict=True):
        old.replace_all_uses_with(new, delete_user_cb=lambda user: user not in members)
    for n in reversed(nodes):
        graph.erase_node(n)
    return call


def _python_name(module: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in module) or "region"


def _region_stack(node: fx.Node, module: str) -> dict:
    """The node's module stack down to the region's module (for the dump's `@h.0`)."""
    out = {}
    for key, (path, kind) in (node.meta.get("nn_module_stack") or {}).items():
        out[key] = (path, kind)
        if path == module:
            break
    return out


@register
class ActivationCheckpoint(Pass):
    """Rewrite: each chosen region becomes a checkpointed submodule call."""

    name = "activation_checkpoint"
    phase = "restructure"
    rewrites = True
    requires = ("checkpoint_regions",)

    def enabled_by(self, plan) -> bool:
        return plan.checkpoint is not None

    def __call__(self, program: Program) -> Program:
        decision = program.decisions.checkpoint_regions
        if decision is None:
            return program
        for i, region in enumerate(decision.chosen):
            fuse_region(program, region, f"{REGION_PREFIX}{i}")
        if decision.chosen:
            first = next(n for n, _ in region_calls(program.graph_module))
            note(first, "checkpoint", decision.summary())
        program.decisions.report_lines.append(f"activation checkpoint: {decision.summary()}")
        return program
