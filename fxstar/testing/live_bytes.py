"""LiveBytes: the peak of tensor memory a step allocates, measured op by op.

On a CPU-only machine there is no allocator to ask, so this counts storages: one counts from
the op that creates it (an output whose storage no input has) until it dies; storages made
outside the mode (parameters, host buffers) never count. It is how the activation estimates
of `shape_memory` are checked against a real step (tests, benchmarks/activations.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LiveBytes", "step_peak"]


class LiveBytes(TorchDispatchMode):
    """Peak bytes of storages created under the mode and alive at once.

    Events are keyed by a birth number, not the storage's address: an address freed early in
    the step is often reused later (by a gradient, say), and leaving one out by address then
    left out both (the peak moved by tens of MiB from run to run)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int, int]] = {}  # address -> (ref, bytes, birth)
        self.events: list[tuple[int, int]] = []  # (birth, +bytes | -bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage()._cdata
            for t in pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for key, (ref, nbytes, birth) in list(self.live.items()):
            if ref.expired():
                del self.live[key]
                self.events.append((birth, -nbytes))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage._cdata  # the weak ref keeps it from being reused while tracked
                if key not in inputs and key not in self.live:
                    self.live[key] = (StorageWeakRef(storage), storage.nbytes(), len(self.events))
                    self.events.append((len(self.events), storage.nbytes()))
        return out

    def births(self, tensors: list[torch.Tensor]) -> set[int]:
        """The birth numbers of these tensors' storages, which must still be alive."""
        keys = {t.untyped_storage()._cdata for t in tensors}
        return {birth for key, (_, _, birth) in self.live.items() if key in keys}

    def peak(self, exclude: set[int]) -> int:
        now = best = 0
        for birth, delta in self.events:
            if birth not in exclude:
                now += delta
                best = max(best, now)
        return best


def step_peak(fn, params: Iterable[torch.Tensor], inputs: Sequence) -> int:
    """Peak bytes of one forward+backward of `fn(*inputs)` (a loss), the gradients of
    `params` left out: activations and temporaries, what a compute tier must hold for them."""
    tracer = LiveBytes()
    with tracer:
        fn(*inputs).backward()
    grads = [p.grad for p in params if p.grad is not None]
    return tracer.peak(tracer.births(grads))
