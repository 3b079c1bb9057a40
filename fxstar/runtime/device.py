"""The compute device as the runtime sees it: streams, events, waits, asynchronous copies,
page-locked host memory, free/total memory, synchronize. One interface, so the runtime's
asynchronous paths are written once and run on an accelerator, on the host, and on the
simulated asynchronous device the tests use (fxstar/testing/async_device.py), where a missing
wait reads poison instead of passing by luck.

Implementations:
    AcceleratorDevice  torch's own device-generic APIs (torch.accelerator, torch.Stream,
                       torch.Event): CUDA, and any accelerator torch drives the same way
    HostDevice         the CPU: every stream is the host thread, every call synchronous

The rules every implementation keeps, as CUDA's semantics state them:
- Work queued on a stream (`launch`, `copy`) runs in the order it was queued on that stream;
  work on two streams is unordered unless one waits (`wait_event`, `wait_stream`).
- `event.record(stream)` marks the point after what `stream` has queued so far; the event is
  complete once that work has run. A wait or synchronize takes the latest record at the time it
  is called; an event never recorded counts as complete.
- The current stream is where ordinary torch ops run. Host code reads a tensor a side stream
  wrote only after `event.synchronize()` (or `stream.synchronize()`, `device.synchronize()`);
  the current stream reads it only after `current.wait_event(event)`.
- Memory a side stream still reads or writes is kept from reuse by `record_stream`.

How today's runtime call sites map onto it (device: the compute tier's Device; side: a stream
from `device.new_stream()`; current: `device.current_stream()`):

- chunks.ChunkManager.__init__: `torch.cuda.Stream(device)` -> `device.new_stream()`;
  `pin = device.type == 'cuda'` -> `device.asynchronous`.
- chunks.ChunkManager._sample: `torch.cuda.memory_allocated` -> `device.memory_allocated()`.
- residency.Residency.copy: `copy_stream.wait_stream(current)`, `copy_` under the stream,
  `event.record`, `current.wait_event(event)` -> `q = device.copy_after(dst, src, side)`,
  `current.wait_event(q.done)`; to the host also `q.done.synchronize()`.
- grad_copies.GradAccumulator._copy_on_stream: wait, timing events around `copy_`,
  `src.record_stream` -> `device.copy_after(dst, src, side, timing=True)` (PendingCopy holds
  the QueuedCopy); .wait: `end.synchronize()`, `start.elapsed_time(end)`,
  `current.wait_stream(copy_stream)` -> `q.done.synchronize()`, `q.seconds()`,
  `current.wait_stream(side)`.
- offload.ActivationOffload._side_stream: `torch.cuda.Stream(device)` -> `device.new_stream()`.
- offload._Handle.__init__: wait, `copy_` under the stream, `Event().record`,
  `t.record_stream(stream)` -> `self.event = device.copy_after(self.host, t, side).done`.
- offload._Handle.prefetch: `stream.wait_event(event)`, `empty_strided` and `copy_` under the
  stream, `Event().record` -> `side.wait_event(event)`, `device.empty(shape, dtype,
  stride=..., stream=side)`, `device.copy(restored, host, side)`, `side.record_event()`.
- offload._Handle.take: `current.wait_event(event)`, `t.record_stream(current)` ->
  `current.wait_event(event)`, `device.record_stream(t, current)`.
- page-locked host buffers (host.host_empty(pin=True) from offload._HostPool.take,
  tiers.HostTier.empty, weights' scratch) -> `device.host_empty(nbytes)`.
- a card's capacity (arena.device_memory_bytes, passes.chunk_layout.auto_budget:
  `get_device_properties(device).total_memory`) -> `device.memory_info()[1]`.
- engine inputs `x.to(device, non_blocking=True)` -> `device.copy` into `device.empty(...)`.

Data-parallel broadcasts/all-gathers (data_parallel.fetch/gather with wait=False) and the
tensor-parallel collectives run on the backend's own streams; their `work.wait()` orders the
current stream after them, and stays as it is.
"""

from __future__ import annotations

import functools
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from fxstar.runtime.host import host_empty
from fxstar.runtime.tier_copy import copy_payload

__all__ = [
    "AcceleratorDevice",
    "Device",
    "Event",
    "HostDevice",
    "HostEvent",
    "HostStream",
    "QueuedCopy",
    "Stream",
    "device_for",
    "host_memory_info",
]


@runtime_checkable
class Event(Protocol):
    """A point in a stream's work (torch.Event has these methods)."""

    def record(self, stream: Stream | None = None) -> None: ...
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...
    def elapsed_time(self, end: Event) -> float: ...  # milliseconds


@runtime_checkable
class Stream(Protocol):
    """An in-order queue of device work (torch.Stream has these methods)."""

    def wait_event(self, event: Event) -> None: ...
    def wait_stream(self, stream: Stream) -> None: ...
    def record_event(self, event: Event | None = None) -> Event: ...
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


@dataclass(frozen=True)
class QueuedCopy:
    """A copy queued by `Device.copy_after`: `done` completes when it has run; `started`
    (timing copies only) is recorded just before it."""

    done: Event
    started: Event | None = None

    def seconds(self) -> float:
        """How long the copy ran on its stream; call after `done.synchronize()`."""
        if self.started is None:
            raise ValueError("a copy queued without timing=True has no duration")
        return self.started.elapsed_time(self.done) / 1e3


def _copy_now(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src on the calling stream: fxstar._C for plain host buffers, else torch's copy,
    asynchronous to the host where the memory allows (page-locked host, device)."""
    if dst.device.type == src.device.type == "cpu":
        copy_payload(dst, src)
    else:
        dst.copy_(src, non_blocking=True)


class Device(ABC):
    """The compute device: where compute-tier tensors live and how work on it is ordered."""

    #: where tensors of the compute tier are allocated
    torch_device: torch.device
    #: whether work queued on a side stream may still be running when the call returns
    asynchronous: bool

    @abstractmethod
    def current_stream(self) -> Stream:
        """The stream ordinary torch ops run on (CUDA's current stream)."""

    @abstractmethod
    def new_stream(self) -> Stream:
        """A side stream: work queued there runs beside the current stream's."""

    @abstractmethod
    def new_event(self, *, timing: bool = False) -> Event:
        """An event; `timing=True` lets `elapsed_time` be taken between two of them."""

    @abstractmethod
    def launch(
        self,
        stream: Stream,
        work: Callable[[], object],
        *,
        writes: Sequence[torch.Tensor] = (),
        label: str = "",
    ) -> None:
        """Queue `work` (torch ops, no autograd) on `stream`. `writes` are the tensors it
        writes: what reads them before the work is known complete reads garbage (poison on
        the simulated device). `label` names the work in errors."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream | None = None) -> None:
        """Queue dst <- src on `stream` (the current one if None); nothing orders it after
        other streams' work: see `copy_after`."""
        label = f"copy into {tuple(dst.shape)} {dst.dtype} on {dst.device}"
        work = functools.partial(_copy_now, dst, src)
        self.launch(self.current_stream() if stream is None else stream, work, writes=(dst,),
                    label=label)  # fmt: skip

    def copy_after(
        self, dst: torch.Tensor, src: torch.Tensor, stream: Stream, *, timing: bool = False
    ) -> QueuedCopy:
        """Queue dst <- src on the side `stream` after everything the current stream has
        queued (which produced `src` or still reads `dst`), keeping `src` from reuse until
        the copy has read it. Whoever reads `dst` waits for the returned copy's `done`."""
        stream.wait_stream(self.current_stream())
        started = None
        if timing:
            started = self.new_event(timing=True)
            started.record(stream)
        self.copy(dst, src, stream)
        done = self.new_event(timing=timing)
        done.record(stream)
        self.record_stream(src, stream)
        return QueuedCopy(done, started)

    @abstractmethod
    def empty(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        *,
        stride: Sequence[int] | None = None,
        stream: Stream | None = None,
    ) -> torch.Tensor:
        """Uninitialised compute-tier memory for work on `stream` (the current if None)."""

    @abstractmethod
    def host_empty(self, nbytes: int, *, zero: bool = True) -> torch.Tensor:
        """A uint8 host buffer that copies to and from this device can run asynchronously
        with (page-locked on an accelerator)."""

    @abstractmethod
    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        """Keep `tensor`'s memory from reuse until `stream`'s work queued so far has run."""

    @abstractmethod
    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device."""

    @abstractmethod
    def memory_allocated(self) -> int | None:
        """Bytes torch holds in tensors on the device; None where it keeps no count."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block until all work queued on the device has run; raise what failed in it."""

    def make_current(self) -> None:  # noqa: B027 - a device without a notion of "current"
        """Make this the process's current device (collectives and bare 'cuda' tensors
        go there)."""

    def close(self) -> None:  # noqa: B027 - nothing to release but for the simulated device
        """Release what the device holds (worker threads on the simulated device)."""


class HostEvent:
    """An event of the host's synchronous streams: complete once recorded."""

    def __init__(self) -> None:
        self._time: float | None = None

    def record(self, stream: Stream | None = None) -> None:
        self._time = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end: Event) -> float:
        if self._time is None or not isinstance(end, HostEvent) or end._time is None:
            raise RuntimeError("elapsed_time needs both events recorded on the host")
        return (end._time - self._time) * 1e3


class HostStream:
    """A stream whose work runs at once on the calling thread: waiting for an event blocks
    until it is complete (at once for host events, later for the simulated device's)."""

    def __init__(self, new_event: Callable[[], Event] = HostEvent) -> None:
        self._new_event = new_event

    def wait_event(self, event: Event) -> None:
        event.synchronize()

    def wait_stream(self, stream: Stream) -> None:
        if stream is not self:
            stream.synchronize()

    def record_event(self, event: Event | None = None) -> Event:
        event = self._new_event() if event is None else event
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class HostDevice(Device):
    """The CPU as the compute device: one synchronous stream, plain host memory."""

    torch_device = torch.device("cpu")
    asynchronous = False

    def __init__(self) -> None:
        self._stream = HostStream()

    def current_stream(self) -> Stream:
        return self._stream

    def new_stream(self) -> Stream:
        return HostStream()

    def new_event(self, *, timing: bool = False) -> Event:
        return HostEvent()

    def launch(self, stream, work, *, writes=(), label=""):
        with torch.no_grad():
            work()

    def empty(self, shape, dtype, *, stride=None, stream=None):
        if stride is None:
            return torch.empty(tuple(shape), dtype=dtype)
        return torch.empty_strided(tuple(shape), tuple(stride), dtype=dtype)

    def host_empty(self, nbytes: int, *, zero: bool = True) -> torch.Tensor:
        return host_empty(nbytes, zero=zero)

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        return None

    def memory_info(self) -> tuple[int, int]:
        return host_memory_info()

    def memory_allocated(self) -> int | None:
        return None

    def synchronize(self) -> None:
        return None


def host_memory_info() -> tuple[int, int]:
    """(available, physical) bytes of this machine's memory (POSIX sysconf)."""
    page = os.sysconf("SC_PAGE_SIZE")
    return page * os.sysconf("SC_AVPHYS_PAGES"), page * os.sysconf("SC_PHYS_PAGES")


class AcceleratorDevice(Device):
    """An accelerator through torch's device-generic APIs; CUDA is the one this project
    targets, others that torch.accelerator drives the same way come with it."""

    asynchronous = True

    def __init__(self, device: torch.device | str) -> None:
        device = torch.device(device)
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is None or accelerator.type != device.type:
            have = "no accelerator" if accelerator is None else f"a {accelerator.type} accelerator"
            raise RuntimeError(f"{device} is not this machine's accelerator: torch sees {have}")
        index = torch.accelerator.current_device_index() if device.index is None else device.index
        self.torch_device = torch.device(device.type, index)

    def current_stream(self) -> Stream:
        return torch.accelerator.current_stream(self.torch_device)

    def new_stream(self) -> Stream:
        return torch.Stream(device=self.torch_device)

    def new_event(self, *, timing: bool = False) -> Event:
        return torch.Event(device=self.torch_device, enable_timing=timing)

    def launch(self, stream, work, *, writes=(), label=""):
        with torch.no_grad(), stream:
            work()

    def empty(self, shape, dtype, *, stride=None, stream=None):
        stream = self.current_stream() if stream is None else stream
        with stream:  # the caching allocator takes the block from this stream's pool
            if stride is None:
                return torch.empty(tuple(shape), dtype=dtype, device=self.torch_device)
            return torch.empty_strided(tuple(shape), tuple(stride), dtype=dtype,
                                       device=self.torch_device)  # fmt: skip

    def host_empty(self, nbytes: int, *, zero: bool = True) -> torch.Tensor:
        return host_empty(nbytes, zero=zero, pin=True)

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        tensor.record_stream(stream)

    def memory_info(self) -> tuple[int, int]:
        return torch.accelerator.get_memory_info(self.torch_device.index)

    def memory_allocated(self) -> int | None:
        return torch.accelerator.memory_allocated(self.torch_device.index)

    def synchronize(self) -> None:
        torch.accelerator.synchronize(self.torch_device.index)

    def make_current(self) -> None:
        torch.accelerator.set_device_index(self.torch_device.index)


def device_for(device: torch.device | str) -> Device:
    """The Device for a torch device: the host for 'cpu', else this machine's accelerator."""
    device = torch.device(device)
    if device.type == "cpu":
        return HostDevice()
    return AcceleratorDevice(device)
