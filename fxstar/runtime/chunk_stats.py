"""What the chunk runtime counts, in one record.

Residency (loads, evictions, bytes moved, the steps and their time), the gradient copies (their
time, what backward's end waited for) each add to the same ChunkStats; the manager's report
and the benchmarks read it. It sits in a module of its own so that none of those owns it.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

RECENT_STEPS = 1000  # training steps whose moved bytes ChunkStats keeps one by one


@dataclass
class ChunkStats:
    loads: int = 0  # host -> compute copies
    bytes_to_compute: int = 0
    bytes_to_host: int = 0  # gradients crossing back (cuda)
    evictions: int = 0
    prefetch_hits: int = 0
    cache_hits: int = 0
    unexpected_accesses: int = 0
    copy_seconds: float = 0.0  # chunk moves and gradient copies through Residency.copy
    copy_bytes: int = 0  # the bytes those copies moved: their achieved bandwidth
    grad_copy_seconds: float = 0.0  # gradient copies to their buffers, however they ran
    grad_wait_seconds: float = 0.0  # of that, what backward's end still had to wait for
    steps: int = 0
    # bytes moved host->compute by the most recent training steps (bounded), and over all
    per_step_bytes: collections.deque[int] = field(
        default_factory=lambda: collections.deque(maxlen=RECENT_STEPS)
    )
    moved_bytes_total: int = 0
    training_steps: int = 0
    # wall time of those steps (each from its forward's start to the next forward's), and the
    # gradient copy time within them: the share of a step the copies take
    training_seconds: float = 0.0
    training_grad_copy_seconds: float = 0.0

    def copy_gbps(self) -> float | None:
        """Bytes per second of the timed copies, in GB/s; None before any copy."""
        if self.copy_seconds <= 0 or self.copy_bytes == 0:
            return None
        return self.copy_bytes / self.copy_seconds / 1e9

    def grad_copy_share(self) -> float | None:
        """The share of the training steps' wall time spent copying gradients into the
        chunks' buffers (the copies hidden beside backward included); None before a step."""
        if self.training_seconds <= 0:
            return None
        return self.training_grad_copy_seconds / self.training_seconds

    def end_step(self, moved: int, seconds: float = 0.0) -> None:
        """A training step ended: it moved `moved` bytes host->compute in `seconds`."""
        self.per_step_bytes.append(moved)
        self.moved_bytes_total += moved
        self.training_steps += 1
        self.training_seconds += seconds
        self.training_grad_copy_seconds = self.grad_copy_seconds
