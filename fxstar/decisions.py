"""Decisions: what each pass decided about a Program, one typed attribute per pass.

A pass records its decision here before it rewrites (the runtime follows the record, a dump
shows it, a test or a later pass reads it), so what a pass chose never hides in a string key
of a dict. A pass written outside fxstar keeps its own under `custom[its name]`.
Per-node facts (a node's measured bytes, the notes dumps print) stay in `node.meta`.
What the first capture of an engine decides for every later one (its chunk layout, budget and
arena: a layout must be the same for every input shape) is `EngineDecisions`, one object the
engine hands every Program it captures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the types only: passes import this module, never the other way round
    from fxstar.passes.checkpoint_regions import CheckpointDecision
    from fxstar.passes.chunk_layout import BudgetNeed
    from fxstar.passes.chunk_schedule import Fetches
    from fxstar.passes.cpu_embedding import HostEmbeddings
    from fxstar.passes.shape_memory import MemoryReport
    from fxstar.passes.tiled_linear import TileChoice
    from fxstar.passes.tp_sharding import Sharding
    from fxstar.runtime.layout import ChunkLayout, ChunkPlan, Observed
    from fxstar.runtime.offload import ActivationOffload

__all__ = ["Decisions", "EngineDecisions"]


@dataclass
class Decisions:
    """One attribute per built-in pass (None until it ran); `custom` for passes of users."""

    shape_memory: MemoryReport | None = None  # activations measured on the graph as it was
    tp_sharding: Sharding | None = None  # which linears are split how, and the collectives
    tp_agreed: bool = False  # the ranks compared this program's fingerprint and agreed
    tiled_linear: list[TileChoice] | None = None  # the linears tiled, and how
    checkpoint_regions: CheckpointDecision | None = None  # the regions to recompute
    offload_activations: ActivationOffload | None = None  # the host store regions save into
    cpu_embedding: HostEmbeddings | None = None  # embeddings looked up on the host
    chunk_layout: ChunkLayout | None = None  # which chunk and offset each parameter has
    budget_need: BudgetNeed | None = None  # the smallest device_memory the layout works with
    chunk_fetches: Fetches | None = None  # where each graph fetches and releases chunks
    chunk_plan: ChunkPlan | None = None  # what the runtime follows: layout, accesses, budget
    chunk_observed: Observed | None = None  # what the first step measured (the engine)
    report_lines: list[str] = field(default_factory=list)  # lines passes add to the report
    custom: dict[str, Any] = field(default_factory=dict)  # pass name -> its decision


@dataclass
class EngineDecisions:
    """Decided once per engine, followed by each of its captures (None until decided)."""

    chunk_layout: ChunkLayout | None = None  # which chunk and offset: every capture's layout
    auto_budget: int | None = None  # the budget device_memory='auto' settled on
    arena_capacity: int | None = None  # the arena the first chunk plan made: later ones run in it
    kept_bytes: int = 0  # compute-tier bytes HybridAdam keeps as a capture compiles
