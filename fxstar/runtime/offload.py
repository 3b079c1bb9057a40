"""Activation offload: the inputs a checkpoint region keeps for its recomputation live on the
host tier between the region's forward and its backward.

Non-reentrant checkpoint saves a region's inputs through the saved-tensor hooks active around
the call (everything saved inside the region goes to checkpoint's own hooks), so hooks pushed
around `run_region` see exactly the inputs. The pack hook copies each input to a host buffer
and keeps no reference to the compute-side tensor: its memory goes back as soon as the forward
no longer needs it. In backward the unpack hook of region i brings its inputs back (or takes
the copy prefetched earlier) and starts the prefetch of region i-1, the next to recompute, so
at most two regions' inputs are resident on the compute side at once.

On CUDA the copies run on a side stream with events (pinned host memory, `record_stream` so
the caching allocator does not reuse memory a copy still reads or writes); on CPU they are
plain copies into `host_empty` buffers. Parameters (leaves that require grad) and tensors
smaller than `min_offload_size` stay where they are, as in torchtune's OffloadActivations:
moving small tensors costs more in launches than it saves.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fxstar.runtime.host import host_empty
from fxstar.runtime.recompute import run_region
from fxstar.sizes import format_size

__all__ = ["ActivationOffload", "OffloadStats", "offload_region"]

MIN_OFFLOAD_SIZE = 1024  # bytes; torchtune's default


@dataclass
class OffloadStats:
    to_host_bytes: int = 0
    to_device_bytes: int = 0
    tensors: int = 0
    kept_small: int = 0  # saved inputs left in place: below min_offload_size
    prefetched: int = 0  # restores that found their copy already started
    peak_resident_bytes: int = 0  # restored inputs alive at once during backward
    peak_resident_regions: int = 0


class _Handle:
    """One offloaded tensor: its host copy, and the compute-side copy once brought back."""

    def __init__(self, t: torch.Tensor, region: int, stream: Any, pool: _HostPool):
        self.region = region
        self.device, self.dtype = t.device, t.dtype
        self.shape, self.stride = t.shape, t.stride()
        self.nbytes = t.numel() * t.element_size()
        dense = _dense(t)
        if not dense:
            self.stride = torch.empty(self.shape, device="meta").stride()
        buffer = pool.take(self.nbytes, t.is_cuda)
        weakref.finalize(self, pool.give, buffer, t.is_cuda)  # back to the pool when freed
        self.host = buffer.view(self.dtype).as_strided(self.shape, self.stride)
        self.restored: torch.Tensor | None = None
        self.event = None
        if t.is_cuda:
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                self.host.copy_(t, non_blocking=True)
                self.event = torch.cuda.Event()
                self.event.record(stream)
            t.record_stream(stream)  # t's memory is not reused before the copy has read it
        else:
            self.host.copy_(t)

    def prefetch(self, stream: Any) -> bool:
        """Start bringing the tensor back; False if it already was."""
        if self.restored is not None:
            return False
        empty = torch.empty_strided
        if self.device.type == "cuda":
            with torch.cuda.stream(stream):
                stream.wait_event(self.event)  # the host copy is complete
                self.restored = empty(self.shape, self.stride, dtype=self.dtype, device=self.device)
                self.restored.copy_(self.host, non_blocking=True)
                self.event = torch.cuda.Event()
                self.event.record(stream)
        else:
            self.restored = empty(self.shape, self.stride, dtype=self.dtype, device=self.device)
            self.restored.copy_(self.host)
        return True

    def take(self, stream: Any) -> torch.Tensor:
        """The compute-side tensor, ready to use on the current stream."""
        self.prefetch(stream)
        t, self.restored = self.restored, None
        if t.is_cuda:
            current = torch.cuda.current_stream(t.device)
            current.wait_event(self.event)
            t.record_stream(current)
        return t


def _dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill exactly numel slots (in any order): its strides can be kept."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return t.storage_offset() >= 0


class _HostPool:
    """Host buffers by size, reused across steps: allocating (and faulting in) fresh host
    memory for every saved input each step costs more than the copy itself."""

    def __init__(self):
        self.free: dict[tuple[int, bool], list[torch.Tensor]] = {}

    def take(self, nbytes: int, pin: bool) -> torch.Tensor:
        free = self.free.get((nbytes, pin))
        if free:
            return free.pop()
        return host_empty(max(nbytes, 1), zero=False, pin=pin)[:nbytes]  # overwritten at once

    def give(self, buffer: torch.Tensor, pin: bool) -> None:
        self.free.setdefault((buffer.numel(), pin), []).append(buffer)


class ActivationOffload(nn.Module):
    """Run-time state of activation offload for one graph: handles per region, the side
    stream, and the counters `engine.report()` shows. A module, so the graph reaches it with
    get_attr; it holds no parameters."""

    def __init__(self, min_offload_size: int = MIN_OFFLOAD_SIZE):
        super().__init__()
        self.min_offload_size = min_offload_size
        self.stats = OffloadStats()
        self._regions: dict[int, list[_Handle]] = {}
        self._resident: list[tuple[weakref.ref, int, int]] = []  # (tensor, bytes, region)
        self._stream: Any = None
        self._pool = _HostPool()

    def _side_stream(self, device: torch.device) -> Any:
        if device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _offloadable(self, t: torch.Tensor) -> bool:
        if t.is_leaf and t.requires_grad:  # a parameter: its memory is not an activation's
            return False
        if t.numel() * t.element_size() < self.min_offload_size:
            self.stats.kept_small += 1
            return False
        return t.device.type in ("cpu", "cuda")

    def run(self, index: int, region: nn.Module, *inputs: Any) -> Any:
        """`run_region(region, *inputs)` with the inputs it saves moved to the host tier."""
        if index == 0:
            self._regions = {}  # a new forward
        handles: list[_Handle] = []
        self._regions[index] = handles

        def pack(t: torch.Tensor) -> Any:
            if not self._offloadable(t):
                return t
            handle = _Handle(t, index, self._side_stream(t.device), self._pool)
            handles.append(handle)
            self.stats.to_host_bytes += handle.nbytes
            self.stats.tensors += 1
            return handle

        def unpack(saved: Any) -> torch.Tensor:
            if not isinstance(saved, _Handle):
                return saved
            stream = self._side_stream(saved.device)
            if saved.restored is not None:
                self.stats.prefetched += 1
            elif saved.prefetch(stream):
                self._restored(saved)
            t = saved.take(stream)
            self._prefetch(saved.region - 1)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return run_region(region, *inputs)

    def _prefetch(self, index: int) -> None:
        for handle in self._regions.get(index, ()):
            if handle.prefetch(self._side_stream(handle.device)):
                self._restored(handle)

    def _restored(self, handle: _Handle) -> None:
        """Count a tensor brought back, and the peak of what is resident now."""
        self.stats.to_device_bytes += handle.nbytes
        self._resident = [r for r in self._resident if r[0]() is not None]
        self._resident.append((weakref.ref(handle.restored), handle.nbytes, handle.region))
        resident = sum(r[1] for r in self._resident)
        regions = len({r[2] for r in self._resident})
        self.stats.peak_resident_bytes = max(self.stats.peak_resident_bytes, resident)
        self.stats.peak_resident_regions = max(self.stats.peak_resident_regions, regions)

    def reset_stats(self) -> None:
        self.stats = OffloadStats()
        self._resident = []

    def report(self) -> str:
        s = self.stats
        return (
            f"activation offload: {format_size(s.to_host_bytes)} to host, "
            f"{format_size(s.to_device_bytes)} back ({s.tensors} tensors, {s.prefetched} "
            f"prefetched, {s.kept_small} small kept); peak resident in backward "
            f"{format_size(s.peak_resident_bytes)} in {s.peak_resident_regions} region(s)"
        )

    def extra_repr(self) -> str:
        return f"min_offload_size={self.min_offload_size}"


def offload_region(offload: ActivationOffload, index: int, region: nn.Module, *inputs: Any) -> Any:
    """What an offloaded region's call node runs (see ActivationOffload.run)."""
    return offload.run(index, region, *inputs)
