"""One copy of a chunk payload or gradient, through fxstar._C wherever both ends are host memory.

torch's `copy_` forks its whole OpenMP team for a large CPU copy and joins every thread of it,
so on a busy machine it waits for the slowest of them (docs/results.md). `_C.copy_into` copies
1 MiB blocks in the caller while at most COPY_THREADS - 1 helpers take blocks from the same
counter, waits for no helper that is not running (csrc/tier_copy.hpp), and releases the GIL.
Every chunk move and gradient copy on the CPU path goes through `copy_payload`, so the choice
of path lives in one place; what it cannot take (another device, a dtype conversion, a strided
view, a broadcast) stays torch's.
"""

from __future__ import annotations

import os

import torch

from fxstar import _C

# The caller plus one helper where cores are plentiful; on a host of 2 cores the caller alone: a
# helper there competes with the other core's work, and a helper preempted in the middle of a
# block makes the caller wait a scheduler slice (measured: benchmarks/copies.py).
COPY_THREADS = 2 if (os.cpu_count() or 1) >= 4 else 1
# below this a torch copy_ is as fast: the call's fixed costs (two DLPack exports) dominate
MIN_CORE_BYTES = 1 << 16
CORE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def core_copyable(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether `_C.copy_into` can do `dst.copy_(src)` byte for byte."""
    return (
        dst.device.type == "cpu"
        and src.device.type == "cpu"
        and dst.dtype == src.dtype
        and dst.dtype in CORE_DTYPES
        and dst.shape == src.shape
        and dst.is_contiguous()
        and src.is_contiguous()
        and dst.nbytes >= MIN_CORE_BYTES
    )


def copy_payload(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src, as `dst.copy_(src)` computes it, in `_C` when both are plain host buffers.

    The core copy does not bump dst's version counter: callers track chunk versions
    themselves (Residency), and nothing autograd saved views these buffers."""
    if core_copyable(dst, src):
        _C.copy_into(dst.detach(), src.detach(), num_threads=COPY_THREADS)
    else:
        dst.copy_(src)
