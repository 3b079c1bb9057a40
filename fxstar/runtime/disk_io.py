"""Asynchronous reads and writes of whole host buffers at offsets in files: the disk tier's I/O.

Why threads in the C++ core: a disk tier reads chunk i+1 and writes chunk i-1 while the CPU
Adam updates chunk i, so the I/O must run beside Python, not in it. `_C.DiskIO` keeps a few
I/O threads doing pread/pwrite (O_DIRECT where the filesystem allows it: the page cache would
only hold a second copy of bytes that are read once a step); `read` and `write` queue a request
and return a handle at once, `wait` blocks without the GIL. Every failure (disk full, EIO, a
short read past the end of a file, a vanished or read-only directory) is a `DiskIOError` naming
the file, offset and bytes, raised by the `wait` that needed the bytes, never a silent zero.

Files: one file per stored array (a chunk part's master weights, each Adam moment) rather
than one file of everything at offsets. Each file is sized and its blocks reserved when it is
opened, so a full disk shows at setup; a part can be dropped or resized without an offset
allocator; and an error names the file of the part it hit. A file's requests may still be at
any offset, so a caller that wants several parts in one file can have them.

Requests on a file opened with `direct=True` (the default) must be aligned to
`DIRECT_ALIGNMENT` (offset, size and buffer address) on every filesystem, whether or not
O_DIRECT was granted (`DiskFile.direct` says which), so code that passes on tmpfs passes on a
disk; `aligned_buffer` gives such buffers. Requests are not ordered against each other: wait
for a write before reading the region it wrote.
"""

from __future__ import annotations

import atexit
import sys
import weakref

import torch

from fxstar import _C
from fxstar.errors import DiskIOError
from fxstar.runtime.host import host_empty

__all__ = [
    "DIRECT_ALIGNMENT",
    "DiskFile",
    "DiskIO",
    "DiskIOError",
    "DiskIORequest",
    "aligned_buffer",
    "aligned_size",
]

DIRECT_ALIGNMENT: int = _C.DISK_DIRECT_ALIGNMENT
DiskFile = _C.DiskFile
DiskIORequest = _C.DiskIORequest

# Two threads keep a disk busy for the megabyte requests of a chunk (each request is cut into
# pieces the threads share) without taking the cores the Adam kernels run on.
DEFAULT_THREADS = 2
DEFAULT_QUEUE_DEPTH = 32
DEFAULT_PIECE_BYTES = 8 << 20


def aligned_size(nbytes: int) -> int:
    """`nbytes` rounded up to DIRECT_ALIGNMENT: the size of a direct request that holds it."""
    return -(-nbytes // DIRECT_ALIGNMENT) * DIRECT_ALIGNMENT


def aligned_buffer(nbytes: int, *, zero: bool = False) -> torch.Tensor:
    """A uint8 host tensor of `nbytes` whose address is DIRECT_ALIGNMENT-aligned; `nbytes`
    must be a multiple of it for direct requests (see `aligned_size`). Not zeroed unless asked:
    a read overwrites all of it."""
    return host_empty(nbytes, alignment=DIRECT_ALIGNMENT, zero=zero)


_open_engines: weakref.WeakSet[DiskIO] = weakref.WeakSet()


class DiskIO:
    """A pool of I/O threads for `DiskFile`s. `read`/`write` queue a request of a whole
    buffer (any dtype, contiguous, in host memory) and return a `DiskIORequest`; its `wait()`
    blocks without the GIL and raises DiskIOError on failure. At most `queue_depth` requests
    are in flight (a further submit blocks until one finishes). `close()` (also at exit, or
    leaving a `with` block) finishes what is queued and stops the threads; it raises the
    first failure of a request whose handle was dropped without waiting."""

    def __init__(
        self,
        threads: int = DEFAULT_THREADS,
        *,
        queue_depth: int = DEFAULT_QUEUE_DEPTH,
        piece_bytes: int = DEFAULT_PIECE_BYTES,
    ):
        self._core = _C.DiskIO(threads, queue_depth, piece_bytes)
        _open_engines.add(self)

    def read(self, file: DiskFile, offset: int, buffer: torch.Tensor) -> DiskIORequest:
        """Queue a read of `buffer.nbytes` bytes at `offset` of `file` into `buffer`."""
        return self._core.read(file, offset, buffer)

    def write(self, file: DiskFile, offset: int, buffer: torch.Tensor) -> DiskIORequest:
        """Queue a write of `buffer`'s bytes at `offset` of `file`."""
        return self._core.write(file, offset, buffer)

    def close(self) -> None:
        self._core.close()

    @property
    def closed(self) -> bool:
        return self._core.closed

    @property
    def threads(self) -> int:
        return self._core.threads

    def stats(self) -> dict[str, int]:
        """bytes_read, bytes_written, requests, failures and in_flight so far."""
        return self._core.stats()

    def __enter__(self) -> DiskIO:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@atexit.register
def _close_open_engines() -> None:
    # the threads finish what is queued before the interpreter tears down the buffers' owners
    for engine in list(_open_engines):
        try:
            engine.close()
        except DiskIOError as error:  # no step is left to raise it in: said, not dropped
            print(f"fxstar: a disk request nobody waited for failed: {error}", file=sys.stderr)
