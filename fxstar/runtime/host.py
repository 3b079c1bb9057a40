"""Host-tier memory: aligned buffers from the C++ core, seen by torch without a copy."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap

import torch

from fxstar import _C


def host_empty(
    nbytes: int, *, alignment: int = 0, zero: bool = True, pin: bool = False
) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes` over aligned memory, zeroed unless `zero=False`.

    `zero=False` skips the memset: the tensor then shows whatever the heap held before (bytes
    this process freed, possibly other data), so pass it only for a buffer that is overwritten
    completely before anything reads it.

    Without `pin`, the memory comes from the core: 2 MiB aligned with transparent huge pages
    advised for large buffers, which the CPU Adam streams through fastest. `pin=True` takes
    page-locked memory from torch's CUDA host allocator instead, so copies to a cuda tier can
    run asynchronously on a side stream; it needs a GPU.
    """
    if pin:
        if not torch.cuda.is_available():
            raise RuntimeError("host_empty(pin=True) needs CUDA; this torch sees no GPU")
        tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return tensor.zero_() if zero else tensor
    return torch.from_dlpack(_C.HostBuffer(nbytes, alignment, zero))


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim  # noqa: B018 - glibc only
    except (OSError, AttributeError, TypeError):
        return None
    return libc


def give_back_freed() -> bool:
    """Return the heap memory freed so far to the operating system (glibc's malloc_trim).
    Why: the tensors compile lets go of (a host model's own parameters once the chunk homes
    hold them, tracing's temporaries) are mostly below glibc's mmap threshold, so their pages
    stay resident as free heap until something reuses them, and they count against the host
    all the same. False where the C library has no malloc_trim."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


MADV_DONTNEED = 4  # Linux


def release_pages(t: torch.Tensor) -> int:
    """Give the whole pages inside `t`'s bytes back to the system (madvise MADV_DONTNEED):
    they stop counting as resident, and read as zeros if touched again. For host memory that
    is never read again (the host homes of a chunk kept on the compute tier for good, where a
    CPU-only machine's arena is host memory too). Returns the bytes given back; 0 where the C
    library has no madvise or `t` spans no whole page."""
    libc = _libc()
    if libc is None or t.device.type != "cpu" or t.is_pinned():
        return 0
    page = mmap.PAGESIZE
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    first, last = -(-start // page) * page, end // page * page
    if last <= first:
        return 0
    if libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_DONTNEED):
        return 0
    return last - first
