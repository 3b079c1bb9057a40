"""What one training step needs, by kind of memory, before it runs (`fxstar plan`).

Parameters, gradients and optimizer state come from the parameter table and the plan, as
if no pass paged them; activations from the `shape_memory` analysis, on the graph the plan's
rewrites (checkpointing, offload, tiling) left when it ran, which the table's title names.
`estimate` is the figure a budget is chosen by: the smallest device_memory the plan works with.
"""

from __future__ import annotations

from dataclasses import dataclass

from fxstar.passes import ensure_fresh
from fxstar.passes.chunk_layout import BudgetNeed, LayoutSearch, budget_need, nonmodel_peak
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
    report = program.decisions.shape_memory
    if report is not None:
        rows.append(EstimateRow("activations saved", report.saved_bytes, "for backward"))
        rows.append(EstimateRow("largest backward temporary", report.largest_backward,
                                "gradients one op allocates at once"))  # fmt: skip
    rows.append(EstimateRow("total", sum(r.nbytes for r in rows), "peak of one step, roughly"))
    return rows


def measured_after(program: Program) -> list[str]:
    """The rewrites that ran before the activations were measured (the latest shape_memory
    stage): checkpointing, offload or tiling change the activation rows."""
    from fxstar.passes import rewrites

    found = [i for i, s in enumerate(program.stages) if s.by == "pass" and s.name == "shape_memory"]
    if not found:
        return []
    return [s.name for s in program.stages[: found[-1]] if s.by == "pass" and rewrites(s.name)]


def format_estimate(program: Program) -> str:
    """The table; with shape_memory run, its activation rows are measured on the graph the
    plan's rewrites left, like the smallest budget below it: re-measured if a rewrite ran
    since, unless chunk_schedule did (chunk_layout had them measured just before; the
    chunked graph runs through the chunk runtime, which the analysis does not)."""
    if program.decisions.shape_memory is not None and "chunk_schedule" not in program.passes_run():
        ensure_fresh(program, "shape_memory")
    rows = training_memory(program)
    width = max(len(r.kind) for r in rows)
    after = measured_after(program)
    title = "one step, no memory passes" if not after else (
        f"one step, model state unpaged; activations measured after {', '.join(after)}"
    )  # fmt: skip
    lines = [f"training memory estimate ({title}):"]
    for r in rows:
        lines.append(f"  {r.kind:<{width}}  {format_size(r.nbytes):>12}  {r.note}")
    if program.decisions.shape_memory is None:
        lines.append("  (activations not measured: the shape_memory pass did not run)")
    else:
        lines.append(estimate(program).format())
    return "\n".join(lines)


@dataclass(frozen=True)
class Estimate:
    """What a compiled plan needs of the compute tier (`engine.estimate()`)."""

    activation_peak: int  # bytes of activations and temporaries at backward's fullest moment
    param_bytes: int
    device_memory: int  # the smallest budget this plan compiles and runs with (CPU-only)
    chunk_size: int  # elements per chunk at that budget
    need: BudgetNeed  # the moment that sets device_memory

    def format(self) -> str:
        return (
            f"smallest device_memory for this plan: {format_size(self.device_memory)} "
            f"({self.device_memory:,} bytes), chunk_size {self.chunk_size:,}\n"
            f"  set where {self.need.moment()}\n"
            f"  activations peak at {format_size(self.activation_peak)} (backward); "
            f"parameters {format_size(self.param_bytes)}"
        )


def estimate(program: Program) -> Estimate:
    """From what chunk_layout found (the first capture), from the access plan of a layout
    already fixed (later captures), or, for a plan without chunks, by asking the same search
    (activations measured first if no shape_memory ran on the graph as it is)."""
    decided = program.decisions
    need = decided.budget_need
    if need is None and decided.chunk_plan is not None:
        need = budget_need(program, decided.chunk_plan.access, decided.chunk_layout)
    if need is None:
        ensure_fresh(program, "shape_memory")
        need = LayoutSearch(program).smallest()
    return Estimate(nonmodel_peak(program), program.param_bytes, need.device_memory,
                    need.chunk_size, need)  # fmt: skip
