"""What a Trainer's log line adds under fxstar: tokens a second, and memory per tier.

The Trainer logs loss, learning rate and gradient norm; an fxstar run is also judged by its
throughput and by what each tier holds (the point of paging parameters through a budget), so
both go into the same log dict, where the progress bar, TensorBoard or W&B show them.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from fxstar import placement

if TYPE_CHECKING:
    from fxstar.engine import Engine

__all__ = ["Throughput", "tier_memory"]

MIB = 2**20


class Throughput:
    """Tokens trained between two reads of `per_second()`, over the wall time between them."""

    def __init__(self) -> None:
        self.tokens = 0
        self.since = time.perf_counter()

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def per_second(self) -> float:
        """The rate since the last read (or since made), and a new interval begun."""
        now = time.perf_counter()
        rate = self.tokens / max(now - self.since, 1e-9)
        self.tokens, self.since = 0, now
        return rate


def tier_memory(engine: Engine) -> dict[str, float]:
    """MiB per tier of a chunk engine (none without chunks: the model is not paged).

    compute_chunks_peak: parameter chunks on the compute tier at their fullest so far;
    compute_kept: chunks HybridAdam keeps there for good, with their optimizer state;
    activations_peak: bytes saved for backward at the fullest moment of a traced step;
    host: chunk homes and optimizer state on the host (beside any CPU-only arena);
    cuda_max_allocated: torch's peak on the card, where the compute tier is one."""
    chunks = engine.chunks
    if chunks is None:
        return {}
    chunk_plan = engine.program.decisions.chunk_plan
    kept = getattr(engine.optimizer, "kept", None)  # HybridAdam's, once it stepped
    host, _ = placement.host_need(engine.plan, chunk_plan, kept)
    memory = {
        "compute_chunks_peak_mib": chunks.arena.stats()["peak_in_use"] / MIB,
        "compute_kept_mib": chunks.kept_bytes() / MIB,
        "activations_peak_mib": chunks.tracer.peak_nonmodel / MIB,
        "host_mib": host / MIB,
    }
    if chunks.device.type == "cuda":
        memory["cuda_max_allocated_mib"] = torch.cuda.max_memory_allocated(chunks.device) / MIB
    return {name: round(value, 3) for name, value in memory.items()}
