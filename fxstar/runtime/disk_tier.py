"""The disk tier: chunk parts (an fp32 master, Adam's moments) kept in files under a directory
the user names, brought to host memory a few pieces at a time.

Why a stream, not a cache: the optimizer step visits every chunk once, in one order, so the
bytes it needs next are known. `DiskTier.stream` reads item i+1 while the caller updates item
i and writes item i-1 back, through a ring of `depth` host slots: at most `depth` items' parts
are in host memory at once (`peak_staging_bytes`), whatever the model's size. An item is a
chunk's parts whole, or an `Extent`: byte ranges of them (a piece of a chunk, so the slots stay
small whatever the chunk size: runtime/disk_pieces.py). Reads and
writes run on the C++ core's I/O threads (runtime/disk_io.py, O_DIRECT where the filesystem
allows it), the GIL released while they run and while a wait blocks.

The directory belongs to one engine: an exclusive lock on a file in it (flock) refuses a second
engine by name, in this process or another. `close()` removes the files this tier created, the
lock, and the directory if the tier created it, unless `keep=True`; a file it did not create
is never touched. A part's file is sized and its blocks reserved when the part is added, so a
full disk shows at setup; an I/O error later is a DiskIOError naming the file, raised by the
wait that needed the bytes.

A part may also be mapped (`map`): a tensor over the file's pages (mmap, shared), for values
that something must be able to read or write at any moment without a step asking for them:
the fp32 masters, which the engine's stable parameters view. The kernel reads a page in when
it is touched and keeps the file and the mapping coherent with the stream's requests (a direct
read writes dirty pages back first, a direct write invalidates the cached ones); `unmap_pages`
gives the pages touched back, so the host holds only what was read since. What a mapping
cannot do is name an error: a failing disk under a touched page is the kernel's SIGBUS, so
`check_mapped` compares each mapped file's size with its part's before the engine touches them.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import time
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from fxstar.errors import DiskIOError, FxstarError
from fxstar.runtime.disk_io import (
    DIRECT_ALIGNMENT,
    DiskFile,
    DiskIO,
    DiskIORequest,
    aligned_buffer,
    aligned_size,
)
from fxstar.runtime.host import release_pages
from fxstar.runtime.tiers import Tier

__all__ = ["DiskTier", "DiskTierError", "DiskTierStats", "Extent"]

LOCK_NAME = ".fxstar-disk-tier.lock"
DEFAULT_DEPTH = 3  # slots: the item read ahead, the one updated, the one written back


class DiskTierError(FxstarError):
    """The disk tier's directory cannot be used: another engine holds it, or it is not a
    directory."""


@dataclass
class DiskTierStats:
    """What the tier moved and waited for."""

    bytes_read: int = 0
    bytes_written: int = 0
    wait_seconds: float = 0.0  # the caller blocked on I/O (not hidden behind its work)
    streams: int = 0
    peak_staging_bytes: int = 0  # host bytes of the slots of one stream
    per_stream: list[tuple[int, int, float]] = field(default_factory=list)  # read, written, wait


@dataclass
class _Slot:
    buffers: dict[str, torch.Tensor]  # part -> aligned uint8 host buffer
    pending: list[DiskIORequest] = field(default_factory=list)  # writes from this slot


@dataclass(frozen=True)
class Extent:
    """What one position of a stream moves of an item's parts: per part, byte ranges of its
    file (whole DIRECT_ALIGNMENT blocks), laid one after another in the slot's buffer, of which
    the caller sees the first `lengths[part]` bytes (a piece of a chunk: runtime/disk_pieces.py)."""

    item: Hashable
    ranges: dict[str, tuple[tuple[int, int], ...]]  # part -> (offset, nbytes) of its file
    lengths: dict[str, int]

    def nbytes(self, part: str) -> int:
        return sum(n for _, n in self.ranges[part])


class DiskTier(Tier):
    """Parts of chunks in files under `directory` (see the module). A part is named by
    `(item, part)`: `item` any hashable (a chunk id), `part` a short name ('master')."""

    name: ClassVar[str] = "disk"

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        keep: bool = False,
        depth: int = DEFAULT_DEPTH,
        threads: int = 2,
        direct: bool = True,
    ):
        if depth < 2:
            raise ValueError(f"depth: at least 2 slots (one updated, one read ahead), got {depth}")
        self.directory = Path(directory)
        self.keep, self.depth, self.direct = keep, depth, direct
        self.created_directory = not self.directory.exists()
        if not self.created_directory and not self.directory.is_dir():
            raise DiskTierError(f"disk tier: {self.directory} exists and is not a directory")
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = self._lock()
        self.io = DiskIO(threads)
        self.files: dict[tuple[Hashable, str], DiskFile] = {}
        self.sizes: dict[tuple[Hashable, str], int] = {}  # bytes the caller stores in each
        self.mapped: dict[tuple[Hashable, str], torch.Tensor] = {}  # map(): the file's pages
        self.stats = DiskTierStats()
        # what close() does, also when the tier is dropped unclosed (at collection or exit)
        self._release = weakref.finalize(self, _release, self.io, self.files, self.mapped,
                                         self.directory, self._lock_fd, keep,
                                         self.created_directory)  # fmt: skip

    def _lock(self) -> int:
        path = self.directory / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DiskTierError(
                f"disk tier: {self.directory} is in use by another engine (process {owner}, "
                f"which holds {path.name}); give each engine a directory of its own"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        return fd

    # -- parts ----------------------------------------------------------------------------------

    def path_of(self, item: Hashable, part: str) -> Path:
        return self.directory / part_name(item, part)

    def add(self, item: Hashable, part: str, nbytes: int) -> None:
        """A part of `nbytes`, reading as zeros: its file made and its blocks reserved now (a
        full disk is a DiskIOError here, not mid-step)."""
        self._check_open()
        key = (item, part)
        if key in self.files:
            raise ValueError(f"disk tier: part {part!r} of {item!r} was added already")
        path = self.path_of(item, part)
        if path.exists():  # a file of a tier that was not closed: its bytes are not zeros
            os.truncate(path, 0)
        self.files[key] = DiskFile(str(path), aligned_size(nbytes), direct=self.direct)
        self.sizes[key] = nbytes

    def has(self, item: Hashable, part: str) -> bool:
        return (item, part) in self.files

    def map(self, item: Hashable, part: str) -> torch.Tensor:
        """The part's bytes as a uint8 tensor over its file's pages (see the module): writes
        reach the file, reads see what the stream wrote. The mapping lives as long as the
        tensor (and its views); `close` removes the file, not the pages a view still maps."""
        self._check_open()
        key = (item, part)
        if key not in self.files:
            raise KeyError(f"disk tier: no part {part!r} of {item!r}")
        if key not in self.mapped:
            nbytes = self.sizes[key]
            if nbytes == 0:
                self.mapped[key] = torch.empty(0, dtype=torch.uint8)
            else:
                fd = os.open(self.path_of(item, part), os.O_RDWR)
                try:
                    pages = mmap.mmap(fd, aligned_size(nbytes))  # shared, read and write
                finally:
                    os.close(fd)
                self.mapped[key] = torch.frombuffer(pages, dtype=torch.uint8, count=nbytes)
        return self.mapped[key]

    def unmap_pages(self, item: Hashable | None = None) -> int:
        """Give back the mapped pages touched since (written ones stay in the file), of every
        mapped part or `item`'s: the host holds none until they are touched again. Returns
        the bytes given."""
        return sum(release_pages(t) for key, t in self.mapped.items()
                   if item is None or key[0] == item)  # fmt: skip

    def check_mapped(self) -> None:
        """A DiskIOError naming a mapped part's file that is shorter than the part: touching
        the missing pages would end the process (SIGBUS), so it is said before they are."""
        for key, t in self.mapped.items():
            path = self.path_of(*key)
            try:
                size = os.stat(path).st_size
            except FileNotFoundError:
                continue  # unlinked, still open and mapped: the pages are all there
            if size < t.nbytes:
                raise DiskIOError(
                    f"disk tier: {path} holds {size:,} bytes, its part {key[1]!r} of {key[0]!r} "
                    f"{t.nbytes:,}: the file was cut short outside the engine",
                    operation="read", path=str(path), offset=0, nbytes=t.nbytes,
                    failed_at=size, errno=None, strerror="file shorter than its part",
                )  # fmt: skip

    def bytes_on_disk(self) -> int:
        return sum(f.size for f in self.files.values())

    def write(self, item: Hashable, part: str, data: torch.Tensor) -> None:
        """Store `data` (contiguous host tensor of the part's bytes) now."""
        key = self._key(item, part, data)
        staged = aligned_buffer(aligned_size(self.sizes[key]))
        staged[: data.nbytes].copy_(data.reshape(-1).view(torch.uint8))
        self._wait([self.io.write(self.files[key], 0, staged)])
        self.stats.bytes_written += staged.nbytes

    def read(self, item: Hashable, part: str, out: torch.Tensor) -> torch.Tensor:
        """Read the part into `out` (contiguous host tensor of its bytes) now."""
        key = self._key(item, part, out)
        staged = aligned_buffer(aligned_size(self.sizes[key]))
        self._wait([self.io.read(self.files[key], 0, staged)])
        self.stats.bytes_read += staged.nbytes
        out.reshape(-1).view(torch.uint8).copy_(staged[: out.nbytes])
        return out

    def _key(self, item: Hashable, part: str, t: torch.Tensor) -> tuple[Hashable, str]:
        self._check_open()
        key = (item, part)
        if key not in self.files:
            raise KeyError(f"disk tier: no part {part!r} of {item!r}")
        if not t.is_contiguous() or t.device.type != "cpu" or t.nbytes != self.sizes[key]:
            raise ValueError(
                f"disk tier: part {part!r} of {item!r} holds {self.sizes[key]:,} bytes; got a "
                f"{'contiguous' if t.is_contiguous() else 'non-contiguous'} {t.device} tensor "
                f"of {t.nbytes:,}"
            )
        return key

    # -- the stream a step reads and writes through ---------------------------------------------

    def stream(
        self, items: Sequence[Hashable | Extent], parts: Sequence[str], *,
        write_back: bool = True,
    ) -> Iterator[tuple[Hashable | Extent, dict[str, torch.Tensor]]]:  # fmt: skip
        """Each of `items` in order with its `parts` in host memory: {part: uint8 tensor of
        the part's bytes} (an `Extent`: of its ranges, one after another), read ahead one item
        and written back (`write_back`) once the caller asks for the next, through `depth`
        slots. Whatever the caller changed in a yielded item's buffers is written back, also
        when it stops early or raises; every request is waited for before the stream ends.
        Iterate it under `contextlib.closing` so an early stop ends it at once, not when the
        generator is collected."""
        self._check_open()
        extents = [self._extent(item, parts) for item in items]
        largest = {p: max((e.nbytes(p) for e in extents), default=0) for p in parts}
        slots = [_Slot({p: aligned_buffer(n) for p, n in largest.items()})
                 for _ in range(min(self.depth, max(len(items), 1)))]  # fmt: skip
        self.stats.streams += 1
        self.stats.peak_staging_bytes = max(self.stats.peak_staging_bytes,
                                            len(slots) * sum(largest.values()))  # fmt: skip
        before = (self.stats.bytes_read, self.stats.bytes_written, self.stats.wait_seconds)
        reads: dict[int, list[DiskIORequest]] = {}  # position -> its reads in flight

        def requests(position: int, start: Callable) -> list[DiskIORequest]:
            """`start(file, offset, buffer)` for each range of the position's parts."""
            slot, extent = slots[position % len(slots)], extents[position]
            made = []
            for p in parts:
                at = 0
                for offset, nbytes in extent.ranges[p]:
                    made.append(start(self.files[(extent.item, p)], offset,
                                      slot.buffers[p][at : at + nbytes]))  # fmt: skip
                    at += nbytes
            return made

        def start_read(position: int) -> None:
            slot = slots[position % len(slots)]
            self._wait(slot.pending)  # the write that used the slot before has landed
            slot.pending = []
            reads[position] = requests(position, self.io.read)

        def finish(position: int) -> None:
            if not write_back:
                return
            slots[position % len(slots)].pending += requests(position, self.io.write)
            self.stats.bytes_written += sum(map(extents[position].nbytes, parts))

        position = -1
        try:
            if items:
                start_read(0)
            for position, extent in enumerate(extents):
                if position + 1 < len(items):
                    start_read(position + 1)
                self._wait(reads.pop(position))
                self.stats.bytes_read += sum(map(extent.nbytes, parts))
                slot = slots[position % len(slots)]
                yield items[position], {p: slot.buffers[p][: extent.lengths[p]] for p in parts}
                finish(position)
                position = -1
        finally:
            if position >= 0:  # stopped inside an item: what it changed is kept, as on the host
                finish(position)
            with contextlib.suppress(Exception):  # a read ahead nobody will use
                for pending in reads.values():
                    self._wait(pending)
            self._wait([w for slot in slots for w in slot.pending])
            read, written, waited = before
            self.stats.per_stream.append((self.stats.bytes_read - read,
                                          self.stats.bytes_written - written,
                                          self.stats.wait_seconds - waited))  # fmt: skip

    def _extent(self, item: Hashable | Extent, parts: Sequence[str]) -> Extent:
        """An item of a stream as the byte ranges it moves: a whole item's parts whole."""
        if not isinstance(item, Extent):
            for part in parts:
                if (item, part) not in self.files:
                    raise KeyError(f"disk tier: no part {part!r} of {item!r}")
            return Extent(item, {p: ((0, aligned_size(self.sizes[(item, p)])),) for p in parts},
                          {p: self.sizes[(item, p)] for p in parts})  # fmt: skip
        for part in parts:
            key = (item.item, part)
            if key not in self.files:
                raise KeyError(f"disk tier: no part {part!r} of {item.item!r}")
            for offset, nbytes in item.ranges[part]:
                if (
                    offset % DIRECT_ALIGNMENT
                    or nbytes % DIRECT_ALIGNMENT
                    or (offset + nbytes > aligned_size(self.sizes[key]))
                ):
                    raise ValueError(
                        f"disk tier: part {part!r} of {item.item!r}: the range of {nbytes:,} "
                        f"bytes at {offset:,} is not whole {DIRECT_ALIGNMENT}-byte blocks "
                        f"within its {aligned_size(self.sizes[key]):,} bytes"
                    )
        return item

    def _wait(self, requests: Sequence[DiskIORequest]) -> None:
        """Every request waited for, then the first one's error raised: none is left in
        flight (its error would surface again at close)."""
        start, error = time.perf_counter(), None
        for request in requests:
            try:
                request.wait()
            except Exception as e:  # noqa: BLE001 -- raised once all are waited for
                error = error or e
        self.stats.wait_seconds += time.perf_counter() - start
        if error is not None:
            raise error

    # -- lifetime -------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return not self._release.alive

    def _check_open(self) -> None:
        if self.closed:
            raise DiskTierError(f"disk tier: {self.directory} was closed")

    def close(self) -> None:
        """Finish the I/O, then remove the parts' files, the lock and (if this tier made it)
        the directory, unless `keep`; files this tier did not create stay."""
        self._release()

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def describe(self) -> str:
        s = self.stats
        return (
            f"disk tier {self.directory}: {len(self.files)} parts, {self.bytes_on_disk():,} bytes "
            f"on disk; {s.bytes_read:,} read, {s.bytes_written:,} written, "
            f"{s.wait_seconds:.3f} s waited; at most {s.peak_staging_bytes:,} bytes in host "
            f"slots ({self.depth} pieces)"
        )


def _release(io: DiskIO, files: dict, mapped: dict, directory: Path, lock_fd: int, keep: bool,
             created: bool) -> None:  # fmt: skip
    """DiskTier.close (see it); `files` and `mapped` as the tier holds them (a mapping lives on
    in the tensors viewing it)."""
    mapped.clear()
    try:
        io.close()
    finally:
        if not keep:
            for item, part in files:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(directory / part_name(item, part))
            with contextlib.suppress(FileNotFoundError):
                os.unlink(directory / LOCK_NAME)
        os.close(lock_fd)
        if not keep and created:
            with contextlib.suppress(OSError):  # not empty: someone put files there
                directory.rmdir()
        files.clear()


def part_name(item: Hashable, part: str) -> str:
    return f"fxstar-{item}-{part}.bin"
