"""SimulatedDevice: an asynchronous compute device on CPU memory, for the tests.

Why: on a CPU every copy is synchronous, so a stream wait or event the runtime forgot cannot
fail any test, and no device may be lent to run the CUDA path. This device keeps CUDA's
ordering rules (fxstar/runtime/device.py) and breaks every program that leans on luck:

- Work queued on a side stream runs later, on that stream's worker thread, in the order it
  was queued, each piece after a delay drawn from the stream's seeded generator.
- Until a piece of work has run, the tensors it writes read as poison (NaN for floating
  dtypes, the byte 0xA5 repeated otherwise, True for bool): from the moment it is queued when
  the stream is idle, else from the moment it starts.
- An event completes when the work queued before it on its stream has run; a stream's wait
  holds back its later work until the event completes.
- The current stream stays synchronous with the Python thread, as CUDA's is with the host for
  reads: its work runs at once, and its waits (`current.wait_event`, `current.wait_stream`)
  block the thread until the event completes.
- An exception in a worker is raised, with the work's label, at the next synchronising call
  (`synchronize`, `stream.synchronize`, `event.synchronize`, a wait of the current stream);
  the failed stream skips its later work until then (its outputs stay poison).

What it cannot catch: the current stream's work is done before any side stream could start,
so a side stream that forgot to wait for the current one (`side.wait_stream(current)`) still
reads finished values, and `record_stream` has nothing to guard (Python keeps queued tensors
alive). Close the device (`close()`, or use it as a context manager) to stop its threads.
"""

from __future__ import annotations

import queue
import random
import threading
import time
import weakref
from collections.abc import Callable, Sequence

import torch

from fxstar.runtime.device import Device, Event, HostStream, Stream, host_memory_info
from fxstar.runtime.host import host_empty

__all__ = ["AsyncWorkError", "SimulatedDevice", "poison", "reads_as_poison"]

POISON_BYTE = 0xA5
MAX_DELAY = 5e-4  # seconds: the default ceiling of a piece of work's delay


class AsyncWorkError(RuntimeError):
    """Work queued on a side stream of the simulated device raised."""


def _pattern(dtype: torch.dtype) -> int | bool | float:
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return True
    return torch.full((dtype.itemsize,), POISON_BYTE, dtype=torch.uint8).view(dtype).item()


def poison(t: torch.Tensor) -> None:
    """Fill `t` with what memory not yet written by its copy reads as."""
    with torch.no_grad():
        t.fill_(_pattern(t.dtype))


def reads_as_poison(t: torch.Tensor) -> bool:
    """Whether every element of `t` is poison (an empty tensor is not)."""
    if t.numel() == 0:
        return False
    value = _pattern(t.dtype)
    if isinstance(value, float):
        return bool(torch.isnan(t).all())
    return bool((t == value).all())


class _Signal:
    """One record of an event: set once the work queued before it has run."""

    __slots__ = ("done", "time")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.time: float | None = None

    def set(self) -> None:
        self.time = time.perf_counter()
        self.done.set()


class _Context:
    """What a device's streams and events share: its current stream and the failures waiting
    to be raised. Never the device itself, so a device nobody holds is collected and its
    threads stop."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending: list[tuple[SimStream, str, BaseException]] = []
        self.current = _CurrentStream(self)

    def new_event(self) -> SimEvent:
        return SimEvent(self)

    def fail(self, stream: SimStream, where: str, error: BaseException) -> None:
        with self.lock:
            stream._failed = True  # its later work is skipped until this is raised
            self.pending.append((stream, where, error))

    def raise_pending(self) -> None:
        """Raise the first failure not raised yet (the failed streams run again after)."""
        with self.lock:
            pending, self.pending = self.pending, []
            for stream, _, _ in pending:
                stream._failed = False
        if not pending:
            return
        _, where, error = pending[0]
        more = f" ({len(pending) - 1} more failed after it)" if len(pending) > 1 else ""
        raise AsyncWorkError(
            f"simulated device: {where} failed: {type(error).__name__}: {error}{more}"
        ) from error


class SimEvent:
    """An event of the simulated device."""

    def __init__(self, context: _Context) -> None:
        self._context = context
        self._signal: _Signal | None = None

    def record(self, stream: Stream | None = None) -> None:
        stream = self._context.current if stream is None else stream
        self._signal = stream._record()

    def query(self) -> bool:
        return self._signal is None or self._signal.done.is_set()

    def synchronize(self) -> None:
        if self._signal is not None:
            self._signal.done.wait()
        self._context.raise_pending()

    def elapsed_time(self, end: Event) -> float:
        """Milliseconds between this event's completion and `end`'s; both must have completed
        (CUDA answers cudaErrorNotReady otherwise), so a missing synchronize fails here."""
        if self._signal is None or end._signal is None:
            raise RuntimeError("elapsed_time needs both events recorded")
        if not (self.query() and end.query()):
            raise RuntimeError("elapsed_time of an event not completed: synchronize it first")
        return (end._signal.time - self._signal.time) * 1e3


class _CurrentStream(HostStream):
    """The simulated device's current stream: synchronous with the Python thread."""

    def __init__(self, context: _Context) -> None:
        super().__init__(context.new_event)
        self._context = context

    def _record(self) -> _Signal:
        signal = _Signal()
        signal.set()
        return signal

    def synchronize(self) -> None:
        self._context.raise_pending()


class SimStream:
    """A side stream: a worker thread running its queue in order."""

    def __init__(self, context: _Context, number: int, seed: int, delays: tuple[float, float]):
        self.number = number
        self.delays: list[float] = []  # every delay drawn, in order (reproducibility)
        self._context = context
        self._rng = random.Random(f"{seed}/{number}")
        self._delay_range = delays
        self._lock = threading.Lock()
        self._queued = 0  # queued and not yet finished, waits and records included
        self._failed = False
        self._closed = False
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, name=f"fxstar-sim-stream-{number}", daemon=True
        )
        self._thread.start()

    def __repr__(self) -> str:
        return f"SimStream({self.number})"

    # -- queueing ----------------------------------------------------------------------------

    def _put(self, item: tuple) -> bool:
        """Queue an item; whether the stream was idle (nothing queued or running) before."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self!r}: the simulated device was closed")
            idle = self._queued == 0
            self._queued += 1
            if item[0] == "run" and idle:  # nothing earlier on this stream reads them
                for t in item[2]:
                    poison(t)
            self._queue.put((*item, idle))
        return idle

    def _record(self) -> _Signal:
        signal = _Signal()
        with self._lock:
            if self._queued == 0 and not self._closed:  # nothing before it to run
                signal.set()
                return signal
        self._put(("signal", signal))
        return signal

    def launch(self, work: Callable[[], object], writes: Sequence[torch.Tensor], label: str):
        delay = self._rng.uniform(*self._delay_range)
        self.delays.append(delay)
        self._put(("run", work, tuple(writes), label or getattr(work, "__qualname__", "work"),
                   delay))  # fmt: skip

    # -- the Stream protocol -----------------------------------------------------------------

    def wait_event(self, event: Event) -> None:
        signal = event._signal
        if signal is not None and not signal.done.is_set():
            self._put(("wait", signal))

    def wait_stream(self, stream: Stream) -> None:
        if stream is not self:
            self.wait_event(stream.record_event())

    def record_event(self, event: Event | None = None) -> Event:
        event = self._context.new_event() if event is None else event
        event.record(self)
        return event

    def query(self) -> bool:
        with self._lock:
            return self._queued == 0

    def synchronize(self) -> None:
        self._record().done.wait()
        self._context.raise_pending()

    # -- the worker --------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            kind, *item, poisoned = self._queue.get()
            if kind == "stop":
                return
            try:
                if kind == "signal":
                    item[0].set()
                elif kind == "wait":
                    item[0].done.wait()
                else:
                    self._work(*item, poisoned)
            finally:
                with self._lock:
                    self._queued -= 1

    def _work(self, work, writes, label: str, delay: float, poisoned: bool) -> None:
        try:
            if not poisoned:
                for t in writes:
                    poison(t)
            if self._failed:  # skipped: what it would have written stays poison
                return
            time.sleep(delay)
            with torch.no_grad():
                work()
        except BaseException as error:  # raised at the next synchronise, not lost here
            self._context.fail(self, f"{label} on stream {self.number}", error)

    def _stop(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(("stop", False))
        self._thread.join()


def _stop_all(streams: list[SimStream]) -> None:
    for stream in streams:
        stream._stop()


class _LandsAtWait:
    """A collective's work on the simulated device: its result reaches the destination at
    `wait()`, as what reads it after waiting on a card sees it."""

    def __init__(self, works: list, landing: torch.Tensor, dst: torch.Tensor) -> None:
        self.works, self.landing, self.dst = [w for w in works if w is not None], landing, dst

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        if self.landing is not None:
            with torch.no_grad():
                self.dst.copy_(self.landing)
            self.works, self.landing = [], None
        return True


class SimulatedDevice(Device):
    """An asynchronous compute device on CPU memory whose side streams run on worker threads
    (see the module docstring). Each piece of side-stream work waits a delay drawn uniformly
    from [min_delay, max_delay] seconds by its stream's generator, seeded from `seed` and the
    stream's number (streams are numbered as they are made)."""

    torch_device = torch.device("cpu")
    asynchronous = True
    pooled_chunk_blocks = True  # chunk blocks as a card's: tensors of the allocator's
    audits_budget = True  # every chunk test on it checks the budget at every access

    def __init__(
        self,
        *,
        seed: int = 0,
        min_delay: float = 0.0,
        max_delay: float = MAX_DELAY,
        total_memory: int | None = None,
    ) -> None:
        if not 0 <= min_delay <= max_delay:
            raise ValueError(
                f"delays: need 0 <= min_delay <= max_delay, got {min_delay}, {max_delay}"
            )
        self.seed = seed
        self.delays = (min_delay, max_delay)
        self.total_memory = host_memory_info()[1] if total_memory is None else total_memory
        self._context = _Context()
        self.streams: list[SimStream] = []
        self.collectives = 0  # asynchronous collectives started (`collective`)
        # threads stop when the device is closed or collected, whichever comes first
        self._finalizer = weakref.finalize(self, _stop_all, self.streams)

    def __enter__(self) -> SimulatedDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def current_stream(self) -> Stream:
        return self._context.current

    def new_stream(self) -> Stream:
        if not self._finalizer.alive:
            raise RuntimeError("the simulated device was closed")
        stream = SimStream(self._context, len(self.streams) + 1, self.seed, self.delays)
        self.streams.append(stream)
        return stream

    def new_event(self, *, timing: bool = False) -> Event:
        return self._context.new_event()  # every event keeps its time

    def launch(self, stream, work, *, writes=(), label=""):
        if stream is self._context.current:
            with torch.no_grad():
                work()
            return
        stream.launch(work, writes, label)

    def collective(self, dst, issue):
        """The collective runs into a copy of `dst`, which reads as poison and takes the
        result only when the work is waited for."""
        landing = dst.clone()  # an in-place collective's input too
        works = issue(landing)
        poison(dst)
        self.collectives += 1
        return [_LandsAtWait(works, landing, dst)]

    def empty(self, shape, dtype, *, stride=None, stream=None):
        if stride is None:
            t = torch.empty(tuple(shape), dtype=dtype)
        else:
            t = torch.empty_strided(tuple(shape), tuple(stride), dtype=dtype)
        poison(t)  # memory nothing wrote yet
        return t

    def host_empty(self, nbytes: int, *, zero: bool = True) -> torch.Tensor:
        return host_empty(nbytes, zero=zero)  # the host's own buffers: nothing to page-lock

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        return None  # the queued work holds its tensors until it has run

    def memory_info(self) -> tuple[int, int]:
        return self.total_memory, self.total_memory  # a card with nothing else on it

    def memory_allocated(self) -> int | None:
        return None

    def synchronize(self) -> None:
        signals = [stream._record() for stream in self.streams]
        for signal in signals:
            signal.done.wait()
        self._context.raise_pending()

    def close(self) -> None:
        """Let queued work finish, stop every worker thread, then raise what failed."""
        self._finalizer()
        self._context.raise_pending()

    @property
    def threads(self) -> list[threading.Thread]:
        """The worker threads still running."""
        return [s._thread for s in self.streams if s._thread.is_alive()]
