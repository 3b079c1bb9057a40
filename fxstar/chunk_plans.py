"""The chunk plan a program runs under: refined from the first traced step, agreed by the
ranks of sharded payloads, and with room for the chunks HybridAdam keeps on the compute tier.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from fxstar.program import Program
from fxstar.runtime.layout import ChunkPlan
from fxstar.runtime.optim import HybridAdam

if TYPE_CHECKING:
    from fxstar.engine import Engine

__all__ = ["AGREED_STAGE", "REFINED_STAGE", "plan_for_run"]

REFINED_STAGE = "chunk_plan_refined"  # the stage recorded when a program's plan is refined
# the stage recorded when the ranks (sharded payloads) derived a plan unlike and took rank 0's
AGREED_STAGE = "chunk_plan_from_rank_0"


def plan_for_run(engine: Engine, program: Program) -> ChunkPlan:
    """The chunk plan `program` runs under now.

    Why this order: a plan is refined from the step it follows before the ranks agree on it
    (each rank derives its refinement from its own traced step); the kept chunks are fitted
    to the plan the ranks will all follow."""
    _refine_plans(engine)
    _agree_plan(engine, program)
    _fit_kept(engine, program.decisions.chunk_plan)
    return program.decisions.chunk_plan


def _refine_plans(engine: Engine) -> None:
    """After the first training step under a compiled ChunkPlan, the program follows a plan
    made from what that step measured: a new object and a new stage of the program
    ('chunk_plan_refined'), the compiled one left as it was decided."""
    chunks = engine.chunks
    observation = chunks.observe()
    if observation is None:
        return
    compiled, observed = observation
    if chunks.sharded:  # every rank refines alike: its loads are collective
        measured = chunks.data_parallel.agree_measured(
            None if observed is None else observed.nonmodel_bytes)  # fmt: skip
        if measured is None:  # some rank's step could not be used: none refines
            return
        observed = dataclasses.replace(observed, nonmodel_bytes=measured)
    if observed is None:
        return
    for program in engine.programs.values():
        if program.decisions.chunk_plan is compiled:
            program.decisions.chunk_plan = compiled.refined(observed)
            program.decisions.chunk_observed = observed
            program.record(REFINED_STAGE, by="engine")


def _agree_plan(engine: Engine, program: Program) -> None:
    """Sharded payloads: every load and eviction is a collective, so before any rank first
    follows a chunk plan the ranks agree on it (ChunkGroups.agree_plan: each rank derived its
    own, from its capture or its traced step); one that differed is replaced by rank 0's,
    recorded as a stage of the program."""
    plan = program.decisions.chunk_plan
    if not engine.chunks.sharded or id(plan) in engine._agreed_plans:
        return
    agreed = engine.chunks.data_parallel.agree_plan(plan)
    engine._agreed_plans[id(agreed)] = agreed
    if agreed is not plan:
        program.decisions.chunk_plan = agreed
        program.record(AGREED_STAGE, by="engine")


def _fit_kept(engine: Engine, plan: ChunkPlan) -> None:
    """The chunks HybridAdam keeps on the compute tier for good are part of every plan: those
    a plan has no room for (a later, larger input) go back to the host tier before it runs,
    the least used first, and stay there."""
    optimizer = engine._optimizer
    if not isinstance(optimizer, HybridAdam) or not optimizer.device_chunks:
        return
    room = plan.kept_room()
    if room is not None and engine.chunks.kept_bytes() > room:
        optimizer.give_back(room)
