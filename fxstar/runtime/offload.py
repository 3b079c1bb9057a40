"""Activation offload: the inputs a checkpoint region keeps for its recomputation live on the
host tier between the region's forward and its backward.

Non-reentrant checkpoint saves a region's inputs through the saved-tensor hooks active around
the call (everything saved inside the region goes to checkpoint's own hooks), so hooks pushed
around `run_region` see exactly the inputs. The pack hook copies each input to a host buffer
and keeps no reference to the compute-side tensor: its memory goes back as soon as the forward
no longer needs it. In backward the unpack hook of region i brings its inputs back (or takes
the copy prefetched earlier) and starts the prefetch of region i-1, the next to recompute, so
at most two regions' inputs are resident on the compute side at once.

The copies run on a side stream of the compute Device (runtime/device.py), into its host
buffers (page-locked on an accelerator): each copy to the host is queued after what the current
stream queued, the copy back after it on the same stream, and the current stream waits for the
copy back before the tensor is handed to backward (`record_stream` keeps the caching allocator
from reusing memory a copy still reads or writes). On the host's Device they are plain copies.
The Device is the one `device_for` gives the first offloaded tensor's device. Parameters
(leaves that require grad) and tensors smaller than `min_offload_size` stay where they are, as
in torchtune's OffloadActivations: moving small tensors costs more in launches than it saves.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fxstar.runtime.device import Device, Event, Stream, device_for
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

    def __init__(self, t: torch.Tensor, region: int, device: Device, side: Stream,
                 pool: _HostPool):  # fmt: skip
        self.region = region
        self.device, self.dtype = t.device, t.dtype
        self.shape, self.stride = t.shape, t.stride()
        self.nbytes = t.numel() * t.element_size()
        dense = _dense(t)
        if not dense:
            self.stride = torch.empty(self.shape, device="meta").stride()
        buffer = pool.take(self.nbytes)
        weakref.finalize(self, pool.give, buffer)  # back to the pool when freed
        self.host = buffer.view(self.dtype).as_strided(self.shape, self.stride)
        self.restored: torch.Tensor | None = None
        # after the current stream produced t; the copy back follows on the same stream
        self.event: Event = device.copy_after(self.host, t, side).done

    def prefetch(self, device: Device, side: Stream) -> bool:
        """Start bringing the tensor back on `side` (after its copy to the host: the same
        stream); False if it already was."""
        if self.restored is not None:
            return False
        self.restored = device.empty(self.shape, self.dtype, stride=self.stride, stream=side)
        device.copy(self.restored, self.host, side)
        self.event = side.record_event()
        return True

    def take(self, device: Device, side: Stream) -> torch.Tensor:
        """The compute-side tensor, ready to use on the current stream."""
        self.prefetch(device, side)
        t, self.restored = self.restored, None
        current = device.current_stream()
        current.wait_event(self.event)
        device.record_stream(t, current)
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
    memory for every saved input each step costs more than the copy itself. A buffer given
    back may still be read by its copy back; the next copy into it is queued after that one
    on the same side stream."""

    def __init__(self, device: Device):
        self.device = device
        self.free: dict[int, list[torch.Tensor]] = {}

    def take(self, nbytes: int) -> torch.Tensor:
        free = self.free.get(nbytes)
        if free:
            return free.pop()
        return self.device.host_empty(max(nbytes, 1), zero=False)[:nbytes]  # overwritten at once

    def give(self, buffer: torch.Tensor) -> None:
        self.free.setdefault(buffer.numel(), []).append(buffer)


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
        # the compute Device, its side stream and host buffers: made at the first offload
        self._device: Device | None = None
        self._stream: Stream | None = None
        self._pool: _HostPool | None = None

    def _side(self, t: torch.Tensor) -> tuple[Device, Stream, _HostPool]:
        if self._device is None:
            self._device = device_for(t.device)
            self._stream = self._device.new_stream()
            self._pool = _HostPool(self._device)
        return self._device, self._stream, self._pool

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
            handle = _Handle(t, index, *self._side(t))
            handles.append(handle)
            self.stats.to_host_bytes += handle.nbytes
            self.stats.tensors += 1
            return handle

        def unpack(saved: Any) -> torch.Tensor:
            if not isinstance(saved, _Handle):
                return saved
            device, stream = self._device, self._stream  # set by the pack
            if saved.restored is not None:
                self.stats.prefetched += 1
            elif saved.prefetch(device, stream):
                self._restored(saved)
            t = saved.take(device, stream)
            self._prefetch(saved.region - 1)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return run_region(region, *inputs)

    def _prefetch(self, index: int) -> None:
        for handle in self._regions.get(index, ()):
            if handle.prefetch(self._device, self._stream):
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
