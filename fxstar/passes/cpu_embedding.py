"""cpu_embedding (rewrite): embedding lookups on the host, the weight kept out of the chunks.

An embedding matrix (vocabulary x width) is often the largest parameter, and the chunk size
must hold the largest parameter. A lookup only reads the rows its token ids name, so the
matrix can stay on the host: the ids go there (`ops.to_host`), the rows come back
(`ops.to_compute`), and the weight's gradient is applied on the host by the optimizer. A
weight that is also read elsewhere — an lm head tied to the embedding — is needed on the
compute tier anyway: it stays in the chunks, and the dump says so.

Under bf16/fp16 the host weight is the fp32 master itself (nothing on the host needs a
low-precision copy): the lookup runs in fp32 and the rows are rounded to the compute dtype on
their way back, so the gradient reaching the master is fp32, as for chunked masters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fxstar.dump import note
from fxstar.passes import Pass, register
from fxstar.program import Program
from fxstar.runtime import ops

EMBEDDING = torch.ops.aten.embedding.default
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # fp32: no cast


@dataclass
class HostEmbeddings:
    """cpu_embedding's decision: the lookups that move to the host, by node name, and the
    embedding weights moved or kept in the chunks (read elsewhere too), by parameter name."""

    lookups: list[str] = field(default_factory=list)
    host: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)


def decide(program: Program) -> HostEmbeddings:
    """Every lookup of a parameter that nothing but lookups reads moves; notes say why not."""
    kinds = program.placeholder_kinds()
    decision = HostEmbeddings()
    for node in [n for n in program.graph_module.graph.nodes if n.target is EMBEDDING]:
        weight = node.args[0]
        slot = kinds.get(getattr(weight, "name", ""))
        if slot is None or slot.kind != "parameter":
            continue
        others = [u for u in weight.users if u.target is not EMBEDDING]
        if others:
            decision.kept.append(slot.target)
            note(node, "cpu_embedding", f"kept in chunks: also read by {others[0].name}")
            continue
        decision.lookups.append(node.name)
        decision.host.append(slot.target)
        note(node, "cpu_embedding", "on the host")
    decision.host, decision.kept = sorted(set(decision.host)), sorted(set(decision.kept))
    return decision


def rewrite(program: Program, decision: HostEmbeddings) -> None:
    """The ids go to the host before each chosen lookup, the rows come back after it."""
    compute_dtype = COMPUTE_DTYPES.get(program.plan.precision)
    graph = program.graph_module.graph
    nodes = {n.name: n for n in graph.nodes}
    for name in decision.host:
        program.param(name).host_resident = True
    runtime = ops.runtime_node(program.graph_module) if decision.lookups else None
    for node in (nodes[name] for name in decision.lookups):
        with graph.inserting_before(node):
            ids = graph.call_function(ops.to_host, (node.args[1],))
        node.replace_input_with(node.args[1], ids)
        with graph.inserting_after(node):
            back = graph.call_function(ops.to_compute, (node, runtime, compute_dtype))
        node.replace_all_uses_with(back, delete_user_cb=lambda user, back=back: user is not back)


@register
class CpuEmbedding(Pass):
    name = "cpu_embedding"
    phase = "place"
    rewrites = True
    before = ("chunk_layout",)
    implements = ("cpu_embedding",)

    def enabled_by(self, plan) -> bool:
        return plan.cpu_embedding

    def __call__(self, program: Program) -> Program:
        program.decisions.cpu_embedding = decision = decide(program)
        rewrite(program, decision)
        return program


__all__ = ["CpuEmbedding", "HostEmbeddings"]
