"""The disk I/O engine's read and write throughput against a plain sequential read and write of
the same bytes on the same disk, in paired rounds of the same run.

The engine (fxstar._C.DiskIO through fxstar.runtime.disk_io) writes a file as chunk-sized
requests, all queued at once, then syncs it (fdatasync), and reads it back the same way; it
opens its file with O_DIRECT where the filesystem allows it (the table says which). The
reference is what `dd bs=CHUNK conv=fsync` does, in Python: one thread, os.pwrite/os.preadv
of CHUNK-byte buffers in file order through the page cache, the write timed up to its fsync.
Issue 30's target: the engine at >= 70% of the reference, read and write.

Caches: writes are timed until the bytes are on the device as far as the kernel knows (fsync
or fdatasync). Before every read the file's pages are synced and dropped from the page cache
(posix_fadvise DONTNEED, no root needed), so both sides read from the device; a cache below
the kernel (a virtual machine's host cache, the drive's own) is not dropped and serves both
sides alike. Each round runs the two back to back, in alternating order, and only same-round
ratios are reported: a disk's speed drifts more than a CPU's.

It needs twice --size of free disk in --dir (it refuses to start, in one line, with less) and
twice --size of host memory; the default run moves 1 GiB each way 7 times (under a minute).

    python benchmarks/disk_io.py                        # 1 GiB in 64 MiB requests, /tmp's disk
    python benchmarks/disk_io.py --dir /mnt/nvme --size 4G --json disk_io.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from fxstar.runtime.disk_io import DiskFile, DiskIO, aligned_buffer, aligned_size

TARGET = 0.7  # the engine at >= 70% of a plain sequential read/write of the same bytes


@dataclass
class Row:
    operation: str  # read | write
    reference_gbps: float  # median over rounds
    engine_gbps: float
    ratio_min: float  # engine / reference throughput, same round
    ratio_median: float
    ratio_max: float


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def filesystem_of(path: str) -> str:
    """The type of the filesystem that holds `path` (the longest mount point above it)."""
    best, kind = "", "?"
    real = os.path.realpath(path)
    with open("/proc/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            point = fields[1]
            inside = real == point or real.startswith(point.rstrip("/") + "/")
            if inside and len(point) > len(best):
                best, kind = point, fields[2]
    return kind


def drop_cached(path: str) -> None:
    """Sync the file and drop its pages from the page cache, so the next read meets the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class Plain:
    """dd in Python: one thread, chunk-sized buffers, file order, through the page cache."""

    def __init__(self, path: str, chunks: list[memoryview]):
        self.path, self.chunks = path, chunks

    def write(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            offset = 0
            for chunk in self.chunks:
                done = 0
                while done < len(chunk):
                    done += os.pwrite(fd, chunk[done:], offset + done)
                offset += len(chunk)
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(self) -> None:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            offset = 0
            for chunk in self.chunks:
                done = 0
                while done < len(chunk):
                    got = os.preadv(fd, [chunk[done:]], offset + done)
                    if got == 0:
                        raise OSError(f"{self.path} ended at byte {offset + done}")
                    done += got
                offset += len(chunk)
        finally:
            os.close(fd)


class Engine:
    """Every chunk queued at once on the engine's threads, then waited (and synced)."""

    def __init__(self, io: DiskIO, file: DiskFile, chunks: list[torch.Tensor]):
        self.io, self.file, self.chunks = io, file, chunks

    def _all(self, submit: Callable) -> None:
        offset, pending = 0, []
        for chunk in self.chunks:
            pending.append(submit(self.file, offset, chunk))
            offset += chunk.numel()
        for request in pending:
            request.wait()

    def write(self) -> None:
        self._all(self.io.write)
        self.file.sync()

    def read(self) -> None:
        self._all(self.io.read)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="a directory on the disk")
    parser.add_argument("--size", default="1G", help="bytes moved each way per round")
    parser.add_argument("--chunk", default="64M", help="bytes per request (and per dd block)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2, help="the engine's I/O threads")
    parser.add_argument("--piece", default="8M", help="the engine's piece of a request")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    chunk = aligned_size(parse_size(args.chunk))
    count = max(1, parse_size(args.size) // chunk)
    nbytes = count * chunk
    free = shutil.disk_usage(args.dir).free
    if free < 2 * nbytes + (256 << 20):
        print(f"disk_io: needs {2 * nbytes / 2**30:.1f} GiB free in {args.dir}, has "
              f"{free / 2**30:.1f} GiB; pass --size or --dir")  # fmt: skip
        return 1

    written = aligned_buffer(nbytes)
    written.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    back = aligned_buffer(nbytes, zero=True)
    work = tempfile.mkdtemp(prefix="fxstar-disk-io-", dir=args.dir)
    try:
        with DiskIO(threads=args.threads, piece_bytes=aligned_size(parse_size(args.piece))) as io:
            engine_path, plain_path = f"{work}/engine", f"{work}/plain"
            file = DiskFile(engine_path, nbytes)  # created and its blocks reserved
            fd = os.open(plain_path, os.O_WRONLY | os.O_CREAT, 0o644)
            os.posix_fallocate(fd, 0, nbytes)  # the same for the reference
            os.close(fd)
            engine_w = Engine(io, file, list(written.split(chunk)))
            engine_r = Engine(io, file, list(back.split(chunk)))
            plain_w = Plain(plain_path, [memoryview(c.numpy()) for c in written.split(chunk)])
            plain_r = Plain(plain_path, [memoryview(c.numpy()) for c in back.split(chunk)])
            mode = "O_DIRECT" if file.direct else "buffered (the filesystem refused O_DIRECT)"
            print(
                f"disk I/O: {nbytes / 2**30:.2f} GiB in {count} requests of {chunk >> 20} MiB, "
                f"{args.rounds} rounds, in {args.dir} ({filesystem_of(args.dir)}); engine: "
                f"{args.threads} threads, {args.piece} pieces, {mode}"
            )
            times: dict[str, list[float]] = {k: [] for k in ("pw", "ew", "pr", "er")}
            for i in range(args.rounds):
                first, second = ("p", "e") if i % 2 == 0 else ("e", "p")
                writers = {"p": plain_w, "e": engine_w}
                readers = {"p": plain_r, "e": engine_r}
                for side in (first, second):
                    times[side + "w"].append(timed(writers[side].write))
                for side in (first, second):
                    drop_cached(engine_path if side == "e" else plain_path)
                    back.zero_()
                    times[side + "r"].append(timed(readers[side].read))
                    if not torch.equal(back, written):
                        raise SystemExit(f"disk_io: the {side} read did not give the bytes back")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    rows = []
    for op, p, e in (("write", "pw", "ew"), ("read", "pr", "er")):
        ratios = [tp / te for tp, te in zip(times[p], times[e])]
        rows.append(
            Row(
                operation=op,
                reference_gbps=nbytes / statistics.median(times[p]) / 1e9,
                engine_gbps=nbytes / statistics.median(times[e]) / 1e9,
                ratio_min=min(ratios),
                ratio_median=statistics.median(ratios),
                ratio_max=max(ratios),
            )
        )
    header = f"{'op':<6} {'plain GB/s':>10} {'engine GB/s':>11} {'engine/plain min':>17} {'median':>7} {'max':>6}"  # noqa: E501
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r.operation:<6} {r.reference_gbps:>10.2f} {r.engine_gbps:>11.2f} "
            f"{r.ratio_min:>17.0%} {r.ratio_median:>7.0%} {r.ratio_max:>6.0%}"
        )
    lines = [
        f"{'PASS' if r.ratio_median >= TARGET else 'MISS'} {r.operation}: the engine at "
        f"{r.ratio_median:.0%} of a plain sequential {r.operation} (median of {args.rounds} "
        f"rounds, >= {TARGET:.0%})"
        for r in rows
    ]
    for line in lines:
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"benchmark": "disk_io", "dir": args.dir, "filesystem": filesystem_of(args.dir),
                 "direct": mode == "O_DIRECT", "bytes": nbytes, "chunk_bytes": chunk,
                 "threads": args.threads, "rounds": args.rounds, "times": times,
                 "rows": [asdict(r) for r in rows], "targets": lines},
                f,
                indent=2,
            )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
