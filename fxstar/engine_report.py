"""`engine.report()`: what an engine compiled, decided and measured, as text; and the
picture of its memory per moment (`engine.memory_timeline()`)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from fxstar import placement
from fxstar.sizes import format_size
from fxstar.training_step import describe_optimizer

if TYPE_CHECKING:
    from fxstar.engine import Engine

__all__ = ["memory_timeline", "report"]


def report(engine: Engine) -> str:
    """Parameters, captures, passes and, if shape_memory ran, activation memory."""
    if not engine.programs:
        return "fxstar engine: nothing compiled yet"
    program = engine.program
    tied = sum(len(p.aliases) - 1 for p in program.params)
    lines = [
        f"fxstar engine for {type(engine.model).__name__}: {len(program.params)} parameter "
        f"tensors ({tied} tied aliases), {format_size(program.param_bytes)}",
        f"captures: {len(engine.programs)} (one per input signature and mode)",
        "passes run: " + (", ".join(program.passes_run()) or "none"),
        "compile time: "
        + ", ".join(f"{name} {seconds:.2f}s" for name, seconds in program.timings.items()),
        describe_optimizer(engine.plan, engine.store),
    ]
    if engine._weights_line is not None:
        lines.append(engine._weights_line)
    if engine.chunks is not None:
        lines.append(engine.chunks.report())
        optimizer = engine._optimizer
        given = getattr(optimizer, "given_back", None)
        if given:
            lines.append(
                f"kept chunks {sorted(given)} went back to the host tier with their optimizer "
                "state: a later input's plan had no room for them beside its own"
            )
        describe_state = getattr(optimizer, "describe_state", None)  # HybridAdam's
        if describe_state is not None:
            lines.append(describe_state())
        kept = getattr(optimizer, "kept", None)  # None: as forecast
        lines.append(placement.describe_host(engine.plan, program.decisions.chunk_plan, kept))
        lines.append(program.decisions.chunk_plan.describe().splitlines()[0])
        observed = program.decisions.chunk_observed
        if observed is not None:
            lines.append(f"observed in the first traced step: {observed.describe()}")
    scaler = engine.scaler
    if scaler is not None:
        lines.append(
            f"fp16 loss scale {scaler.scale:g}; {scaler.skipped_steps} steps skipped for overflow"
        )
    memory = program.decisions.shape_memory
    if memory is not None:
        lines.append(memory.format())
    else:
        lines.append("activation memory: add 'shape_memory' to plan.passes to measure it")
    # what passes want reported: strings, or callables read now (run-time counters)
    for line in program.decisions.report_lines:
        lines.append(line() if callable(line) else str(line))
    return "\n".join(lines)


def memory_timeline(engine: Engine, path: str | os.PathLike) -> str:
    """A PNG of memory per moment of the last step: chunks, activations, share, budget."""
    from fxstar.timeline import plot_timeline

    chunks = engine.chunks
    if chunks is None:
        raise ValueError("memory_timeline needs the chunk engine: set plan.device_memory")
    budget = chunks.budget
    title = f"{type(engine.model).__name__}: device_memory " + (
        "none (every chunk resident)" if budget is None else format_size(budget)
    )
    line = chunks.arena.capacity if budget is None else budget
    return plot_timeline(chunks.tracer, line, path, title)
