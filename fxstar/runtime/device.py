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

How the runtime uses it (device: the compute tier's Device, `ChunkManager.compute_device`,
from `device_for(plan.device)`; side: a stream from `device.new_stream()`; current:
`device.current_stream()`). A copy crosses the tiers by where its ends lie (a chunk's home
on the host tier or the compute tier), not by `tensor.device`: on the host and the simulated
device both tiers are host memory.

- residency.Residency: one copy stream for every copy between the tiers; `copy` is
  `device.copy_after(dst, src, side)`; to the host the host waits (`done.synchronize()`), to
  the compute tier the current stream waits (`current.wait_event(done)`) at once, or for a
  prefetch at the chunk's access or when its block is given up (`_copied`); before the
  payload's rooms holding gradients are rounded in and before a data-parallel collective
  reads the block, at once.
- grad_copies.GradAccumulator: an overlapped gradient copy to the host tier is
  `device.copy_after(dst, src, side, timing=True)`; backward's end (`wait`) synchronises each
  one's `done` and takes its `seconds()`; a copy into a kept chunk's compute-tier buffer runs
  on the current stream (`device.copy`).
- offload.ActivationOffload: a side stream of its own; a saved input to a host buffer by
  `copy_after`, back by `device.empty(..., stream=side)` and `device.copy(restored, host,
  side)` (after it on the same stream), the current stream waiting for it
  (`current.wait_event`) and `device.record_stream(t, current)` before backward reads it.
- host buffers: payloads and gradients in `device.host_empty` (page-locked on an
  accelerator: tiers.HostTier, offload's pool); masters and moments in the core's buffers.
- chunks.ChunkManager's memory monitor: `device.memory_allocated()`.

Still on torch's own calls: a card's capacity (arena.device_memory_bytes,
passes.chunk_layout.auto_budget: `get_device_properties(device).total_memory`, which
`device.memory_info()[1]` gives), engine inputs (`x.to(device, non_blocking=True)`), and
HybridAdam's device half (torch's fused Adam and its copies on the current stream). The
data-parallel broadcasts and all-gathers and the tensor-parallel collectives run on their
backend's streams; their `work.wait()` orders the current stream after them. Those issued
asynchronously (a prefetch's gather, tensor parallel's overlapped gathers, reduce-scatters and
all-reduces) go through `device.collective`, so on the simulated device their destination
reads as poison until their work is waited for.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

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
    "using_device",
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
    #: whether chunk blocks come from the allocator activations use (arena.PooledBlocks), so
    #: the chunks' share follows each moment's bytes besides chunks; else one arena buffer
    pooled_chunk_blocks: bool = False
    #: whether the residency asserts, at every access, that the chunks resident, the blocks
    #: kept beside them and the activations alive fit the budget (the simulated device: tests)
    audits_budget: bool = False

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

    def collective(
        self, dst: torch.Tensor, issue: Callable[[torch.Tensor], list[Any]]
    ) -> list[Any]:
        """Start an asynchronous collective that writes `dst` (and reads it, in place):
        `issue(target)` starts it on `target` and returns its works. What reads `dst` before
        every work is waited for reads garbage (poison on the simulated device)."""
        return issue(dst)

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
    pooled_chunk_blocks = True

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


_chosen: list[Device] = []  # using_device's, innermost last


@contextlib.contextmanager
def using_device(device: Device) -> Iterator[Device]:
    """While open, `device_for` answers `device` for its torch device type: what an engine
    compiled (and, for activation offload, first run) inside runs its asynchronous work on.
    How the tests put the runtime on fxstar.testing.SimulatedDevice without a Plan option."""
    _chosen.append(device)
    try:
        yield device
    finally:
        _chosen.remove(device)


def device_for(device: torch.device | str) -> Device:
    """The Device for a torch device: the one `using_device` chose for its type, else the host
    for 'cpu' and this machine's accelerator for the rest."""
    device = torch.device(device)
    for chosen in reversed(_chosen):
        if chosen.torch_device.type == device.type:
            return chosen
    if device.type == "cpu":
        return HostDevice()
    return AcceleratorDevice(device)
