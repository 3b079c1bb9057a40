"""offload_activations: checkpoint regions keep their inputs on the host tier until backward.

Rewrites each region call of the `checkpoint` pass,

    h_0 = recompute.run_region(checkpoint_0, dropout, ...)
into
    h_0 = offload.offload_region(activation_offload, 0, checkpoint_0, dropout, ...)

where `activation_offload` is a submodule (fxstar.runtime.offload.ActivationOffload) holding
the run-time state: host copies per region, the side stream, and the bytes moved, which
`engine.report()` shows. The region form is unchanged (same submodule, same inputs), so passes
that descend into regions see the same thing. Without checkpoint regions there is nothing to
offload: a clear error, not a silent no-op.
"""

from __future__ import annotations

from fxstar.dump import NOTES_KEY
from fxstar.passes import Pass, register
from fxstar.passes.activation_checkpoint import region_calls
from fxstar.plan import PlanError
from fxstar.program import Program
from fxstar.runtime.offload import ActivationOffload, offload_region

__all__ = ["OffloadActivations"]

OFFLOAD_MODULE = "activation_offload"


@register
class OffloadActivations(Pass):
    """Rewrite: region calls go through the activation offloader."""

    name = "offload_activations"
    phase = "restructure"
    rewrites = True
    requires = ("activation_checkpoint",)
    implements = ("offload_activations",)

    def enabled_by(self, plan) -> bool:
        return plan.offload_activations

    def __call__(self, program: Program) -> Program:
        gm = program.graph_module
        calls = region_calls(gm)
        if not calls:
            raise PlanError(
                "offload_activations moves the inputs of checkpoint regions, and there are "
                "none: set plan.checkpoint ('blocks', 'auto' or module patterns) as well"
                + ("" if program.plan.checkpoint is None else " (no region was found)")
            )
        offloader = ActivationOffload()
        gm.add_submodule(OFFLOAD_MODULE, offloader)
        graph = gm.graph
        first = next(n for n in graph.nodes if n.op != "placeholder")
        with graph.inserting_before(first):
            state = graph.get_attr(OFFLOAD_MODULE)
        for index, (call, _) in enumerate(calls):
            module_node, *inputs = call.args
            call.target = offload_region  # in place: the node keeps its name and users
            call.args = (state, index, module_node, *inputs)
            call.meta[NOTES_KEY] = {**call.meta.get(NOTES_KEY, {}), "offload": "host"}
        program.decisions.offload_activations = offloader
        program.decisions.report_lines.append(offloader.report)
        return program
