"""Chunk moves against a plain memcpy of the same bytes, quiet and loaded, in the same run.

A chunk move is what Residency.load does on a CPU-only machine: a host home into its arena
block through `tier_copy.copy_payload` (fxstar._C's copy). The reference is libc's memcpy of
the same bytes between the same buffers (ctypes.memmove, one thread); torch's `copy_`, which
the chunk moves used before, is shown beside them. Each round times them back to back, in an
order that rotates from round to round, and only same-round ratios are reported: this host's
bandwidth drifts. "loaded" runs the same rounds while a second process spins on every core.

    python benchmarks/copies.py                          # 16 MiB and 64 MiB chunks
    python benchmarks/copies.py --sizes 4M,64M --json copies.json
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch

from fxstar import _C
from fxstar.runtime import tier_copy
from fxstar.runtime.arena import ArenaBuffer
from fxstar.runtime.host import host_empty

TARGET = 0.9  # chunk moves at >= 90% of memcpy's bandwidth, quiet and loaded
SPIN = """import os, sys
for _ in range(int(sys.argv[1]) - 1):
    if os.fork() == 0:
        break
while True:
    pass
"""


@dataclass
class Row:
    load: str  # quiet | loaded
    chunk_bytes: int
    name: str
    gbps: float  # median over rounds
    vs_memcpy: float  # median of same-round (memcpy time / this time)


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


@contextlib.contextmanager
def spinning(cores: int) -> Iterator[None]:
    """A second process (forked once per core) that spins on every core until the block ends."""
    spinner = subprocess.Popen([sys.executable, "-c", SPIN, str(cores)], start_new_session=True)
    time.sleep(0.5)  # let the forks start
    try:
        yield
    finally:
        os.killpg(spinner.pid, signal.SIGKILL)  # the session holds only the spinner's forks
        spinner.wait()


def copies_for(nbytes: int) -> dict[str, Callable[[], object]]:
    """A chunk's host home and an arena block of its size, and the ways to copy one into the
    other; the bytes are touched once first so no page fault is timed."""
    home = host_empty(nbytes).view(torch.float32)
    home.copy_(torch.randn(home.numel()))
    arena = ArenaBuffer(2 * nbytes)
    offset = arena.alloc(nbytes)
    block = arena.view(offset, home.shape, torch.float32)
    block.zero_()
    dst, src = block.data_ptr(), home.data_ptr()
    return {
        "memcpy (libc, same bytes)": lambda: ctypes.memmove(dst, src, nbytes),
        "chunk move (tier_copy, fxstar._C)": lambda: tier_copy.copy_payload(block, home),
        "_C.copy_into, caller + 1 helper": lambda: _C.copy_into(block, home, num_threads=2),
        "torch copy_ (the chunk moves before)": lambda: block.copy_(home),
    }


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench(load: str, nbytes: int, rounds: int) -> list[Row]:
    ops = copies_for(nbytes)
    for fn in ops.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in ops}
    names = list(ops)
    for i in range(rounds):  # each copy takes each place in the order equally often
        for name in names[i % len(names) :] + names[: i % len(names)]:
            times[name].append(timed(ops[name]))
    reference = times["memcpy (libc, same bytes)"]
    return [
        Row(
            load=load,
            chunk_bytes=nbytes,
            name=name,
            gbps=nbytes / statistics.median(ts) / 1e9,
            vs_memcpy=statistics.median(r / t for r, t in zip(reference, ts)),
        )
        for name, ts in times.items()
    ]


def print_table(rows: list[Row]) -> None:
    header = f"{'load':<7} {'chunk':>8} {'copy':<38} {'GB/s':>7} {'vs memcpy':>10}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r.load:<7} {r.chunk_bytes >> 20:>6}Mi {r.name:<38} {r.gbps:>7.1f} "
            f"{r.vs_memcpy:>9.0%}"
        )


def verdicts(rows: list[Row]) -> list[str]:
    lines = []
    for r in rows:
        if r.name.startswith("chunk move"):
            ok = r.vs_memcpy >= TARGET
            lines.append(
                f"{'PASS' if ok else 'MISS'} {r.load} {r.chunk_bytes >> 20} MiB: chunk moves at "
                f"{r.vs_memcpy:.0%} of memcpy (>= {TARGET:.0%})"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="16M,64M", help="chunk bytes, e.g. 4M,64M")
    parser.add_argument("--rounds", type=int, default=21, help="timing rounds per size and load")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    cores = os.cpu_count() or 1
    print(
        f"chunk moves: fxstar._C copy with {tier_copy.COPY_THREADS} threads, {cores} cores, "
        f"torch {torch.__version__} ({torch.get_num_threads()} intra-op threads)"
    )
    rows = []
    for nbytes in (parse_size(s) for s in args.sizes.split(",")):
        rows += bench("quiet", nbytes, args.rounds)
        with spinning(cores):
            rows += bench("loaded", nbytes, args.rounds)
    print_table(rows)
    lines = verdicts(rows)
    for line in lines:
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"benchmark": "copies", "cores": cores, "copy_threads": tier_copy.COPY_THREADS,
                 "rows": [asdict(r) for r in rows], "targets": lines},
                f,
                indent=2,
            )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
