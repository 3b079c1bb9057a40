"""Gradients into the chunks' gradient buffers, copied beside backward where that pays.

Autograd hands each parameter leaf's gradient to a hook as it is produced; the gradient is
added into the chunk's gradient buffer (on the host tier, or on the compute tier for a fixed
chunk), which the stable parameter's `.grad` views. The first gradient of a step is a copy:
into a host-tier buffer on an asynchronous compute Device it runs on the copy stream, on a
CPU-only machine on a worker thread (off by default there), and backward's end waits for every
copy in flight; into a kept chunk's compute-tier buffer it runs on the current stream. The
ChunkManager owns one GradAccumulator and delegates to it (composition: the copies in flight
and which slots hold a gradient are state nothing else writes).

Why a copy, and not autograd accumulating into the buffer itself: with the leaf's `.grad`
unset, AccumulateGrad steals the incoming gradient (no copy of its own), so this path costs one
copy, 8 bytes of traffic per fp32 element. Presetting `.grad` to the buffer's view would make
AccumulateGrad add in place instead (12 bytes) into a buffer zeroed first (4 more): 2.4x the
copy's time for 85M fp32 parameters (benchmarks/grad_copies.py). The copy runs in fxstar._C
(tier_copy; torch's copy_ took 1.9x as long), and the report gives its share of a step.
"""

from __future__ import annotations

import concurrent.futures
import time
import weakref
from collections.abc import Callable

import torch
from torch import nn

from fxstar.errors import FxstarError
from fxstar.runtime.device import QueuedCopy
from fxstar.runtime.grad_shards import GradShards
from fxstar.runtime.layout import ParamSlot
from fxstar.runtime.residency import Residency
from fxstar.runtime.tier_copy import copy_payload


class GradientConsumedError(FxstarError, RuntimeError):
    """A gradient the optimizer step overwrote (it shared its parameters' room) was asked for."""


# a copy in flight: a worker thread's future, or a copy queued on the copy stream
PendingCopy = concurrent.futures.Future | QueuedCopy


class GradAccumulator:
    """Gradients of the chunk parameters, summed into their buffers across backward passes."""

    def __init__(self, residency: Residency, *, low_precision: bool, overlap: bool):
        self.residency = residency
        self.compute_device = residency.compute_device
        self.stable: dict[str, nn.Parameter] = residency.stable
        self.low_precision = low_precision
        self.overlap = overlap  # copy gradients beside backward (overlap_grad_copies)
        self.present: set[str] = set()  # slots given a gradient since the last zero_grad
        # slots whose gradient the optimizer step overwrote with parameters (bf16/fp16, the
        # gradient in its payload's room): gone until zero_grad, never read as if it were there
        self.consumed: set[str] = set()
        # data parallel with sharded payloads: gradients staged and reduced to their owners,
        # which take them through `take` (runtime/grad_shards.py); None otherwise
        self.shards: GradShards | None = None
        self._pending: list[PendingCopy] = []
        self._copier: concurrent.futures.ThreadPoolExecutor | None = None
        self._wait_queued = False

    def shutdown(self) -> None:
        """Stop the copy thread, if one was started."""
        if self._copier is not None:
            self._copier.shutdown(wait=True)
            self._copier = None

    # -- the buffers ----------------------------------------------------------------------------

    def grad_view(self, slot: ParamSlot) -> torch.Tensor:
        grad = self.residency.chunks[slot.chunk].grad
        return grad[slot.offset : slot.offset + slot.numel].view(slot.shape)

    def slot_grad(self, slot: ParamSlot) -> torch.Tensor | None:
        """This step's gradient of a parameter, or None when it got none."""
        if self.low_precision:
            self._check_not_consumed(slot, "read")
            return self.grad_view(slot) if slot.name in self.present else None
        return self.stable[slot.name].grad

    def has_grad(self, slot: ParamSlot) -> bool:
        """The slot got a gradient since the last zero_grad."""
        if self.low_precision:
            return slot.name in self.present
        return self.stable[slot.name].grad is not None

    def set_has_grad(self, slot: ParamSlot, has: bool) -> None:
        """The slot's gradient is what its buffer holds now (`has`), or it has none: data
        parallelism moved it to its owner."""
        if self.low_precision:
            (self.present.add if has else self.present.discard)(slot.name)
        else:
            self.stable[slot.name].grad = self.grad_view(slot) if has else None

    def _check_not_consumed(self, slot: ParamSlot, doing: str) -> None:
        if slot.name in self.consumed:
            raise GradientConsumedError(
                f"cannot {doing} the gradient of {slot.name}: under bf16/fp16 a chunk's "
                "gradient takes the room of its low-precision parameters, and the optimizer "
                "step replaced it with the updated parameters. Read gradients before "
                "engine.step(), call engine.zero_grad() after it, or compile with "
                "grads_in_host=False (2 more bytes per parameter) to keep them past the step."
            )

    def consumed_by_step(self, slot: ParamSlot) -> None:
        """The optimizer wrote this slot's updated parameters over its gradient."""
        if slot.name in self.present:
            self.consumed.add(slot.name)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.wait()  # a copy in flight would land after the zeroing
        if self.shards is not None:  # what a backward that raised left staged
            self.shards.discard()
        for chunk in self.residency.chunks:
            chunk.restore_params()  # a gradient no step consumed gives its room back
        self.present.clear()
        self.consumed.clear()
        for p in self.stable.values():
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    # -- accumulation ---------------------------------------------------------------------------

    def hook(self, slot: ParamSlot) -> Callable[[torch.Tensor], None]:
        """The post-accumulate-grad hook of a parameter leaf: its gradient into the buffer."""
        # a weak reference: the hook lives on a tensor that C++ keeps alive, and a strong one
        # would keep the whole manager (arena, host chunks, moments) past its engine
        accumulator = weakref.ref(self)

        def hook(leaf: torch.Tensor) -> None:
            grad, leaf.grad = leaf.grad, None
            self = accumulator()
            if self is not None:
                self.add(slot, grad)

        return hook

    def add(self, slot: ParamSlot, grad: torch.Tensor) -> None:
        if self.shards is not None:  # to the owner first, which then takes its average
            self.shards.add(slot, grad)
        else:
            self.take(slot, grad)

    def take(self, slot: ParamSlot, grad: torch.Tensor, *, at_once: bool = False) -> None:
        """Add `grad` into the slot's buffer (the first one of a step is copied there; with
        `at_once`, never beside backward: the caller reuses `grad`'s memory)."""
        stable = self.stable[slot.name]
        if self.low_precision:  # in the chunk's own dtype; the masters have no .grad
            self._check_not_consumed(slot, "accumulate into")
            # before the copy: a load from now on restores the parameters in the room
            self.residency.chunks[slot.chunk].take_room(slot)
            if slot.name in self.present:
                self.wait()
                buffer = self.grad_view(slot)
                buffer.add_(grad.to(buffer.device))
            else:
                self._copy(slot, grad, at_once)
                self.present.add(slot.name)
        elif stable.grad is None:
            buffer = self.grad_view(slot)
            self._copy(slot, grad, at_once)  # a copy: bitwise what eager stores
            stable.grad = buffer
        else:
            self.wait()
            stable.grad.add_(grad.to(stable.grad.device))

    # -- the copies and their overlap -----------------------------------------------------------

    def _copy(self, slot: ParamSlot, src: torch.Tensor, at_once: bool = False) -> None:
        """A gradient into its slot's buffer: at once, or beside the rest of backward
        (overlap): on the copy stream when the buffer is on the host tier of an asynchronous
        device, on a worker thread when the device is the host's."""
        dst = self.grad_view(slot)
        stats = self.residency.stats
        to_host = not self.residency.chunks[slot.chunk].kept  # else a compute-tier buffer
        asynchronous = self.compute_device.asynchronous
        if at_once or not self.overlap or (asynchronous and not to_host):
            start = time.perf_counter()
            if to_host:
                self.residency.copy(dst, src, to_host=True)
            else:
                self.residency.copy_within(dst, src)
            stats.grad_copy_seconds += time.perf_counter() - start
            return
        if not self._wait_queued:  # backward's end waits for every copy in flight
            torch.autograd.Variable._execution_engine.queue_callback(self.wait)
            self._wait_queued = True
        if asynchronous:
            residency = self.residency
            self._pending.append(
                self.compute_device.copy_after(dst, src, residency.copy_stream, timing=True)
            )
            stats.bytes_to_host += src.numel() * src.element_size()
            return
        if self._copier is None:
            self._copier = concurrent.futures.ThreadPoolExecutor(1, "fxstar-grad-copies")
        self._pending.append(self._copier.submit(self._timed_copy, dst, src))

    def _timed_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        start = time.perf_counter()
        copy_payload(dst, src)
        self.residency.stats.grad_copy_seconds += time.perf_counter() - start

    def wait(self) -> None:
        """Block until every gradient copy in flight is done; time what was not hidden."""
        self._wait_queued = False
        if not self._pending:
            return
        stats = self.residency.stats
        start = time.perf_counter()
        for item in self._pending:
            if isinstance(item, concurrent.futures.Future):
                item.result()
            else:  # the host reads the buffers next (the optimizer, a later add)
                item.done.synchronize()
                stats.grad_copy_seconds += item.seconds()
        self._pending.clear()
        stats.grad_wait_seconds += time.perf_counter() - start

    def overlap_share(self) -> float | None:
        """The share of gradient copy time hidden behind backward, None before any copy."""
        st = self.residency.stats
        if not self.overlap or st.grad_copy_seconds == 0:
            return None
        return max(0.0, 1.0 - st.grad_wait_seconds / st.grad_copy_seconds)
