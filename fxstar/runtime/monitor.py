"""An optional background sampler of memory use (`plan.async_mem_monitor`, as PatrickStar's).

The tracer sees memory at chunk accesses only; the sampler also sees what happens between
them, at a fixed interval: the chunk bytes resident on the compute tier and the bytes saved
for backward (on a GPU: everything torch has allocated on it). It runs in a daemon thread and
costs a few microseconds per sample.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class Sample:
    seconds: float
    chunk_bytes: int
    nonmodel_bytes: int


@dataclass
class MemoryMonitor:
    """Samples (chunk bytes, other bytes) every `interval` seconds on a thread of its own.
    Bounded: the most recent `max_samples` are kept (older halves dropped), the peak over the
    whole run is kept apart. The thread stops when `read` returns None (its owner is gone)."""

    read: Callable[[], tuple[int, int] | None]
    interval: float = 0.001
    max_samples: int = 20_000
    samples: list[Sample] = field(default_factory=list)
    peak: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> MemoryMonitor:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fxstar-mem-monitor",
                                            daemon=True)  # fmt: skip
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        start = time.perf_counter()
        while not self._stop.wait(self.interval):
            value = self.read()
            if value is None:
                return
            chunks, other = value
            if len(self.samples) >= self.max_samples:
                del self.samples[: self.max_samples // 2]  # keep the recent half
            self.samples.append(Sample(time.perf_counter() - start, chunks, other))
            self.peak = max(self.peak, chunks + other)
