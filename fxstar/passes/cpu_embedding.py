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

import torch

from fxstar.dump import NOTES_KEY
from fxstar.passes import Pass, register
from fxstar.plan import mark_implemented
from fxstar.program import Program
from fxstar.runtime import ops

mark_implemented("cpu_embedding")

META_KEY = "fxstar.cpu_embedding"  # Program.meta: names moved to the host, names kept
EMBEDDING = torch.ops.aten.embedding.default
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # fp32: no cast


@register
class CpuEmbedding(Pass):
    name = "cpu_embedding"
    before = ("chunk_layout", "chunk_schedule")
    after = ("tiled_linear", "activation_checkpoint")

    def enabled_by(self, plan) -> bool:
        return plan.cpu_embedding

    def __call__(self, program: Program) -> Program:
        compute_dtype = COMPUTE_DTYPES.get(program.plan.precision)
        graph = program.graph_module.graph
        kinds = program.placeholder_kinds()
        moved, kept = [], []
        runtime = None
        for node in [n for n in graph.nodes if n.target is EMBEDDING]:
            weight = node.args[0]
            slot = kinds.get(getattr(weight, "name", ""))
            if slot is None or slot.kind != "parameter":
                continue
            notes = node.meta.setdefault(NOTES_KEY, {})
            others = [u for u in weight.users if u.target is not EMBEDDING]
            if others:
                kept.append(slot.target)
                notes["cpu_embedding"] = f"kept in chunks: also read by {others[0].name}"
                continue
            program.param(slot.target).host_resident = True
            with graph.inserting_before(node):
                ids = graph.call_function(ops.to_host, (node.args[1],))
            node.replace_input_with(node.args[1], ids)
            runtime = runtime or ops.runtime_node(program.graph_module)
            with graph.inserting_after(node):
                back = graph.call_function(ops.to_compute, (node, runtime, compute_dtype))
            node.replace_all_uses_with(
                back, delete_user_cb=lambda user, back=back: user is not back
            )
            notes["cpu_embedding"] = "on the host"
            moved.append(slot.target)
        program.meta[META_KEY] = {"host": sorted(set(moved)), "kept": sorted(set(kept))}
        graph.lint()
        program.graph_module.recompile()
        return program


__all__ = ["META_KEY", "CpuEmbedding"]
