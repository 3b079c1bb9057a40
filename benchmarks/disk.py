"""The disk tier (plan.disk): what it costs a step, how fast it moves its bytes, and what it
takes off the host.

1. Step time: the same GPT and batch trained by two engines, one keeping Adam's moments (and
   the bf16 model's fp32 masters) on the host and one on the disk tier, timed step by step in
   alternating rounds (the order swapped each round); the same-round ratio disk/host,
   min/median/max, and the disk run's step split into compute and the seconds it waited for
   the disk.
2. Bytes per step: what the disk tier read and wrote in a step against the minimum (each
   disk-homed byte read once and written once).
3. Throughput: the tier's stream over every chunk's parts with nothing to compute (read
   ahead, write back, `depth` host slots) against a plain sequential write and read of the same
   bytes in one file on the same disk (one thread, chunk-sized buffers, fsync), in alternating
   rounds. Target: the stream moves at least 70% of the plain bytes per second.
4. Host bytes per parameter of model state, as the host budget counts them (payloads,
   masters, moments, the disk tier's host slots), with and without the disk tier.

The plain file's pages are dropped from the page cache between its write and its read, so both
sides read from the disk (the tier's files bypass the cache with O_DIRECT where the filesystem
grants it). It needs twice the moments' and masters' bytes of free disk under
--dir and refuses to start with less.

    python benchmarks/disk.py                      # 8 layers, width 768, bf16, ~2 min
    python benchmarks/disk.py --dir /nvme/tmp --json disk.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from disk_io import Plain, drop_cached
from gpt_setup import add_gpt_args, make_gpt

import fxstar
from fxstar import placement

TARGET_THROUGHPUT = 0.70


@dataclass
class Result:
    params: int
    disk_bytes: int  # on disk: moments and (bf16) masters
    step_ratio: tuple[float, float, float]  # disk / host step time, same round: min, median, max
    host_step_s: float  # medians
    disk_step_s: float
    disk_wait_s: float  # per step, median: the step blocked on the disk
    bytes_read_per_step: int
    bytes_written_per_step: int
    minimum_per_step: int  # each moment byte read once and written once (aligned files)
    stream_bytes_per_s: float  # read + written over the stream's seconds, median
    plain_bytes_per_s: float  # the same bytes written then read plainly, median
    throughput_ratio: tuple[float, float, float]
    host_bytes_per_param: float  # host tier, model state
    disk_bytes_per_param: float  # with the disk tier: what stays on the host
    slot_bytes: int  # the disk tier's host slots at their peak, measured
    # per state dtype: bytes per parameter of the moments and of the masters on the disk tier
    disk_part_bytes_per_param: dict[str, dict[str, float]]


def stats(values: list[float]) -> tuple[float, float, float]:
    return min(values), statistics.median(values), max(values)


def engine(args, disk: str | None, state_dtype: str = "fp32"):
    model, idx, targets = make_gpt(args)
    optimizer = {"type": "adamw", "lr": 1e-4, "state_dtype": state_dtype}
    plan = fxstar.Plan(device_memory="auto", precision=args.precision, hybrid_adam=False,
                       optimizer=optimizer, disk=disk)  # fmt: skip
    return fxstar.compile(model, plan, example_inputs=(idx, targets)), idx, targets


def step(e, idx, targets) -> float:
    start = time.perf_counter()
    e(idx, targets).backward()
    e.step()
    return time.perf_counter() - start


def part_bytes_per_param(e) -> dict[str, float]:
    """The disk tier's files per part (moments, master), per parameter they hold state of."""
    tier = e.optimizer.disk
    params = sum(s.numel for c in e.optimizer.on_disk for s in e.chunks.step_chunks.chunk(c).slots)
    sizes: dict[str, int] = {}
    for (_, part), file in tier.files.items():
        sizes[part] = sizes.get(part, 0) + file.size
    return {part: n / params for part, n in sorted(sizes.items())}


def lean_parts(args, work: str) -> dict[str, dict[str, float]]:
    """The disk tier's bytes per parameter with bf16 and 8-bit moments (after a step: the
    moments' files are made at the first)."""
    parts = {}
    for state_dtype in ("bf16", "8bit"):
        e, idx, targets = engine(args, os.path.join(work, state_dtype), state_dtype)
        with e:
            step(e, idx, targets)
            parts[state_dtype] = part_bytes_per_param(e)
    return parts


def host_per_param(e) -> float:
    need, _ = placement.host_need(e.plan, e.program.decisions.chunk_plan)
    return need / sum(p.numel() for p in e.parameters())


def throughput(e, directory: str, rounds: int):
    """(stream B/s per round, plain B/s per round): both move every disk-homed part's bytes
    out and in, the stream as a step does (its pieces, nothing computed)."""
    tier, optimizer = e.optimizer.disk, e.optimizer
    spans = [(c, slice(0, optimizer.chunks.chunk(c).used)) for c in optimizer.on_disk]

    def stream_once() -> int:
        """One pass of the step's stream; the bytes it moved."""
        before = tier.stats.bytes_read + tier.stats.bytes_written
        with optimizer.stream_pieces(spans) as stream:
            for chunk_id, span in spans:
                for _ in stream.spans(chunk_id, span):
                    pass
        for file in tier.files.values():
            file.sync()
        return tier.stats.bytes_read + tier.stats.bytes_written - before

    buffers = [memoryview(bytearray(f.size)) for f in tier.files.values()]
    plain = Plain(os.path.join(directory, "plain.bin"), buffers)
    streamed, plained = [], []
    for r in range(rounds):
        order = ("stream", "plain") if r % 2 == 0 else ("plain", "stream")
        for what in order:
            start = time.perf_counter()
            if what == "stream":
                moved = stream_once()
                streamed.append(moved / (time.perf_counter() - start))
            else:
                plain.write()
                drop_cached(plain.path)  # the read meets the disk, as the tier's O_DIRECT reads do
                plain.read()
                plained.append(2 * sum(map(len, buffers)) / (time.perf_counter() - start))
    os.unlink(plain.path)
    return streamed, plained


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_gpt_args(parser)
    parser.set_defaults(layers=8, width=768, heads=12, seq_len=128, batch_size=2)
    parser.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    parser.add_argument("--rounds", type=int, default=4, help="paired rounds (steps)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the tier's files go")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)

    host, idx, targets = engine(args, None)
    params = sum(p.numel() for p in host.parameters())
    need = 2 * 12 * params  # moments and master (fp32) for the tier and the plain file beside
    free = shutil.disk_usage(args.dir).free
    if free < need:
        print(f"disk.py: needs {need / 2**30:.1f} GiB free under {args.dir}, has "
              f"{free / 2**30:.1f} GiB; give --dir on a larger disk or fewer --layers")  # fmt: skip
        return 2
    work = tempfile.mkdtemp(prefix="fxstar-disk-bench-", dir=args.dir)
    try:
        disk, _, _ = engine(args, os.path.join(work, "state"))
        step(host, idx, targets)  # the first step places and makes the moments
        step(disk, idx, targets)
        tier = disk.optimizer.disk
        host_times, disk_times, waits, ratios, moved = [], [], [], [], []
        for r in range(args.rounds):
            before = (tier.stats.bytes_read, tier.stats.bytes_written, tier.stats.wait_seconds)
            if r % 2 == 0:
                host_times.append(step(host, idx, targets))
                disk_times.append(step(disk, idx, targets))
            else:
                disk_times.append(step(disk, idx, targets))
                host_times.append(step(host, idx, targets))
            ratios.append(disk_times[-1] / host_times[-1])
            waits.append(tier.stats.wait_seconds - before[2])
            moved.append((tier.stats.bytes_read - before[0], tier.stats.bytes_written - before[1]))
        on_disk = tier.bytes_on_disk()
        streamed, plained = throughput(disk, work, args.rounds)
        result = Result(
            params=params, disk_bytes=on_disk, step_ratio=stats(ratios),
            host_step_s=statistics.median(host_times), disk_step_s=statistics.median(disk_times),
            disk_wait_s=statistics.median(waits),
            bytes_read_per_step=moved[-1][0], bytes_written_per_step=moved[-1][1],
            minimum_per_step=2 * on_disk,
            stream_bytes_per_s=statistics.median(streamed),
            plain_bytes_per_s=statistics.median(plained),
            throughput_ratio=stats([s / p for s, p in zip(streamed, plained, strict=True)]),
            host_bytes_per_param=host_per_param(host), disk_bytes_per_param=host_per_param(disk),
            slot_bytes=tier.stats.peak_staging_bytes,
            disk_part_bytes_per_param={"fp32": part_bytes_per_param(disk),
                                       **lean_parts(args, work)},
        )  # fmt: skip
        host.close()
        disk.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(args, result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "disk", "config": vars(args), "result": asdict(result)}, f,
                      indent=2)  # fmt: skip
    return 0


def report(args, r: Result) -> None:
    mib = 2**20
    print(f"GPT {args.layers} layers, d={args.width}, {args.precision}: {r.params / 1e6:.1f}M "
          f"parameters, {r.disk_bytes / mib:.1f} MiB of moments and masters on the disk "
          "tier")  # fmt: skip
    lo, mid, hi = r.step_ratio
    print(f"step time disk/host (same round): min {lo:.2f}x median {mid:.2f}x max {hi:.2f}x "
          f"(host {r.host_step_s:.3f} s, disk {r.disk_step_s:.3f} s, of which waiting for the "
          f"disk {r.disk_wait_s:.3f} s)")  # fmt: skip
    print(f"bytes per step: read {r.bytes_read_per_step / mib:.1f} MiB, written "
          f"{r.bytes_written_per_step / mib:.1f} MiB; minimum {r.minimum_per_step / mib:.1f} "
          f"MiB in all")  # fmt: skip
    lo, mid, hi = r.throughput_ratio
    verdict = "PASS" if mid >= TARGET_THROUGHPUT else "MISS"
    print(f"{verdict} throughput: stream {r.stream_bytes_per_s / mib:.0f} MiB/s, plain "
          f"sequential {r.plain_bytes_per_s / mib:.0f} MiB/s; stream/plain min {lo:.2f} median "
          f"{mid:.2f} max {hi:.2f} (target >= {TARGET_THROUGHPUT:.2f})")  # fmt: skip
    verdict = "PASS" if r.disk_bytes_per_param <= 4 else "MISS"
    print(f"{verdict} host bytes per parameter (model state): host tier "
          f"{r.host_bytes_per_param:.2f}, with the disk tier {r.disk_bytes_per_param:.2f} "
          "(target <= 4: the payload, whose room the gradient takes, and the tier's host "
          f"slots: {r.slot_bytes / mib:.1f} MiB at their peak, "
          f"{r.slot_bytes / r.params:.2f} per parameter)")  # fmt: skip
    for state_dtype, parts in r.disk_part_bytes_per_param.items():
        print(f"{state_dtype} moments: bytes per parameter on the disk tier "
              + ", ".join(f"{part} {n:.2f}" for part, n in parts.items())
              + " (their 300-step loss against fp32: benchmarks/lean_state.py)")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
