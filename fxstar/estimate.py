"""What one training step needs, by kind of memory, before it runs (`fxstar plan`).

Parameters, gradients and optimizer state come from the parameter table and the plan;
activations from the `shape_memory` analysis. Later passes (chunks, checkpointing, offload)
change where these bytes live; this table is the baseline they are judged against.
"""

from __future__ import annotations

from dataclasses import dataclass

from fxstar.passes.shape_memory import META_KEY
from fxstar.program import Program
from fxstar.sizes import format_size

# fp32 words of optimizer state per trainable parameter element
STATE_WORDS = {"adamw": 2, "adam": 2, "sgd": 1}


@dataclass
class EstimateRow:
    kind: str
    nbytes: int
    note: str


def training_memory(program: Program) -> list[EstimateRow]:
    """Rows of the estimate; needs `shape_memory` to have run for the activation rows."""
    plan = program.plan
    trainable = sum(p.numel for p in program.params if p.requires_grad)
    rows = [
        EstimateRow("parameters", program.param_bytes, f"{len(program.params)} tensors, ties once"),
        EstimateRow("gradients", trainable * 4, "fp32, one per trainable parameter"),
    ]
    kind = plan.optimizer.type
    words = STATE_WORDS.get(kind, 2)
    rows.append(EstimateRow("optimizer state", trainable * 4 * words, f"{kind}: {words} x fp32"))
    report = program.meta.get(META_KEY)
    if report is not None:
        rows.append(EstimateRow("activations saved", report.saved_bytes, "for backward"))
        rows.append(EstimateRow("largest backward temporary", report.largest_backward,
                                "gradients one op allocates at once"))  # fmt: skip
    rows.append(EstimateRow("total", sum(r.nbytes for r in rows), "peak of a plain step, roughly"))
    return rows


def format_estimate(program: Program) -> str:
    rows = training_memory(program)
    width = max(len(r.kind) for r in rows)
    lines = ["training memory estimate (one step, no memory passes):"]
    for r in rows:
        lines.append(f"  {r.kind:<{width}}  {format_size(r.nbytes):>12}  {r.note}")
    if program.meta.get(META_KEY) is None:
        lines.append("  (activations not measured: the shape_memory pass did not run)")
    return "\n".join(lines)
