"""MemoryTracer: bytes per moment of a step, by kind, on each tier.

A moment is a chunk access (the positions of the AccessPlan). At each one the tracer notes
the chunk bytes resident on the compute tier, the share they were allowed, and the bytes
autograd keeps saved for backward at that instant (counted once per storage, from the
saved-tensor hooks: a saved tensor counts from when it is packed until autograd drops it).
On CPU-only machines activations live in ordinary memory, so this count is how they are known.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch


@dataclass
class Moment:
    access: int
    phase: str
    chunk: int
    chunk_bytes: int  # resident on the compute tier after the access
    share: int  # what chunks were allowed at this moment
    nonmodel_bytes: int  # saved for backward, alive at this moment
    pinned_bytes: int = 0  # chunks in use at this moment: what could not have been evicted


class _Saved:
    """What a pack hook returns for an activation: the tensor, counted while it lives."""

    __slots__ = ("tensor", "key", "tracer")

    def __init__(self, tensor: torch.Tensor, key: int, tracer: MemoryTracer):
        self.tensor, self.key, self.tracer = tensor, key, tracer

    def __del__(self) -> None:
        self.tracer._drop(self.key)


@dataclass
class MemoryTracer:
    moments: list[Moment] = field(default_factory=list)
    last_training: list[Moment] = field(default_factory=list)  # the last step with a backward
    live_bytes: int = 0
    peak_nonmodel: int = 0
    _live: dict[int, list[int]] = field(default_factory=dict)  # storage ptr -> [bytes, refs]
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def begin_step(self) -> None:
        if any(m.phase == "backward" for m in self.moments):
            self.last_training = self.moments
        self.moments = []

    def training_step(self) -> list[Moment]:
        """The moments of the latest step that ran a backward (else of the latest step)."""
        if any(m.phase == "backward" for m in self.moments):
            return self.moments
        return self.last_training or self.moments

    def saved(self, t: torch.Tensor) -> _Saved:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                self._live[key] = [storage.nbytes(), 1]
                self.live_bytes += storage.nbytes()
                self.peak_nonmodel = max(self.peak_nonmodel, self.live_bytes)
            else:
                entry[1] += 1
        return _Saved(t, key, self)

    def unpacked(self, saved: _Saved) -> torch.Tensor:
        return saved.tensor

    def _drop(self, key: int) -> None:
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del self._live[key]
                self.live_bytes -= entry[0]

    def record(
        self, access: int, phase: str, chunk: int, chunk_bytes: int, share: int, pinned: int = 0
    ) -> None:
        self.moments.append(
            Moment(access, phase, chunk, chunk_bytes, share, self.live_bytes, pinned)
        )

    def nonmodel_by_access(self) -> list[int]:
        return [m.nonmodel_bytes for m in self.moments]
