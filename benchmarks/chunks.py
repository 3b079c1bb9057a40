"""The chunk engine on a ~90M-parameter GPT: step time and bytes moved at 100%, 50% and 25% of
the parameter bytes as chunk share, against eager PyTorch in the same run, and against what a
Belady-optimal cache of the same capacity would move for the same access sequence (computed by
a small simulator here, independent of the engine's code).

    python benchmarks/chunks.py                       # vocab 8192, d=768, 12 layers, 4 x 256
    python benchmarks/chunks.py --layers 4 --width 256 --heads 8 --json chunks.json   # quick
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import time
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass

import torch
from gpt_setup import add_gpt_args, make_gpt

import fxstar
from fxstar.passes.chunk_layout import nonmodel_peak

TARGET_FULL_RATIO, TARGET_MOVED_RATIO = 1.05, 1.1


@dataclass
class Row:
    share: str
    device_memory: int
    chunks: int
    chunk_bytes: int
    step_ms: float
    step_ratio: float  # engine step / eager step, same rounds
    moved_bytes: int  # host -> compute per step (steady state)
    moved_per_param_byte: float
    belady_bytes: int
    moved_vs_belady: float
    evictions_per_step: float


def belady_bytes(chunks: list[int], capacity: list[int], nbytes: dict[int, int],
                 unchanged: Collection[int] = (),
                 in_use: Sequence[Collection[int]] = ()) -> int:  # fmt: skip
    """Bytes a Belady-optimal cache moves for one step of `chunks` (chunk c weighs nbytes[c]),
    holding at most capacity[t] chunks at access t, and never evicting those `in_use[t]`
    (when given: the chunks a step still reads then). The optimizer changes every chunk
    between steps but those `unchanged` (frozen), so each other chunk's first access in a
    step misses whatever the cache held. The step is simulated after one like it (the cache
    starts as that one left it) and its bytes counted."""
    steps = chunks + chunks
    future: dict[int, list[int]] = {}
    for t, c in enumerate(steps):
        future.setdefault(c, []).append(t)
    resident: set[int] = set()
    fresh: set[int] = set()  # current: loaded during this step, or unchanged since
    moved = 0
    for t, c in enumerate(steps):
        if t == len(chunks):  # the update: only the unchanged chunks' copies stay current
            fresh &= set(unchanged)
        if c not in resident or c not in fresh:
            moved += nbytes[c] if t >= len(chunks) else 0
            resident.add(c)
            fresh.add(c)
        busy = set(in_use[t % len(chunks)]) if in_use else set()
        while len(resident) > max(capacity[t % len(chunks)], 1):
            victim = max((x for x in resident if x != c and x not in busy),
                         key=lambda x: next_use(future[x], t))  # fmt: skip
            resident.discard(victim)
    return moved


def next_use(positions: list[int], t: int) -> int:
    i = bisect.bisect_right(positions, t)
    return positions[i] if i < len(positions) else 1 << 62


def train_step(model, optimizer, idx, targets) -> float:
    start = time.perf_counter()
    model(idx, targets).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_gpt_args(parser)
    parser.add_argument("--shares", default="100,50,25", help="chunk share, % of param bytes")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)

    eager, idx, targets = make_gpt(args)
    probe = fxstar.compile(make_gpt(args)[0], fxstar.Plan(passes=["shape_memory"]), (idx, targets))
    param_bytes = probe.program.param_bytes
    activations = nonmodel_peak(probe.program)
    print(f"GPT {args.layers} layers, d={args.width}, vocab {args.vocab}: "
          f"{param_bytes / 4 / 1e6:.1f}M parameters ({param_bytes / 2**20:.0f} MiB fp32); "
          f"activations + temporaries ~{activations / 2**20:.0f} MiB; "
          f"{torch.get_num_threads()} threads")  # fmt: skip

    engines = {}
    for share in args.shares.split(","):
        budget = activations + int(int(share) / 100 * param_bytes)
        model = make_gpt(args)[0]
        engine = fxstar.compile(model, fxstar.Plan(device_memory=budget), (idx, targets))
        optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-4)
        engines[share] = (engine, optimizer, budget)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-4)

    train_step(eager, eager_opt, idx, targets)  # warm-up, and the tracer's first step
    for engine, optimizer, _ in engines.values():
        train_step(engine, optimizer, idx, targets)
    times: dict[str, list[float]] = {"eager": [], **{s: [] for s in engines}}
    moved: dict[str, list[int]] = {s: [] for s in engines}
    evictions: dict[str, list[int]] = {s: [] for s in engines}
    for _ in range(args.steps):  # interleaved rounds: drift hits every row alike
        times["eager"].append(train_step(eager, eager_opt, idx, targets))
        for share, (engine, optimizer, _) in engines.items():
            before = (engine.chunks.stats.bytes_to_compute, engine.chunks.stats.evictions)
            times[share].append(train_step(engine, optimizer, idx, targets))
            moved[share].append(engine.chunks.stats.bytes_to_compute - before[0])
            evictions[share].append(engine.chunks.stats.evictions - before[1])

    rows = []
    for share, (engine, _, budget) in engines.items():
        manager = engine.chunks
        plan = engine.program.decisions.chunk_plan.access
        chunk_bytes = manager.layout.chunk_bytes
        capacity = [manager.share(t) // chunk_bytes for t in range(len(plan))]
        manager._plan = plan  # share() reads the plan's per-moment bytes
        used = {c.id: c.used * manager.layout.dtype.itemsize for c in manager.layout.chunks}
        ideal = belady_bytes(plan.chunks, capacity, used)
        step_moved = int(statistics.median(moved[share]))
        ratios = [e / b for e, b in zip(times[share], times["eager"])]
        rows.append(Row(
            share=f"{share}%", device_memory=budget, chunks=len(manager.layout.chunks),
            chunk_bytes=chunk_bytes, step_ms=statistics.median(times[share]) * 1e3,
            step_ratio=statistics.median(ratios), moved_bytes=step_moved,
            moved_per_param_byte=step_moved / param_bytes, belady_bytes=ideal,
            moved_vs_belady=step_moved / ideal if ideal else float("nan"),
            evictions_per_step=statistics.median(evictions[share]),
        ))  # fmt: skip

    eager_ms = statistics.median(times["eager"]) * 1e3
    print(f"eager step (forward, backward, AdamW): {eager_ms:.0f} ms")
    header = ("share", "chunks", "chunk MiB", "step ms", "vs eager", "moved MiB", "x params",
              "Belady MiB", "vs Belady", "evictions")  # fmt: skip
    widths = (6, 7, 10, 9, 9, 10, 9, 11, 10, 10)
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, widths)))
    for r in rows:
        cells = (r.share, r.chunks, f"{r.chunk_bytes / 2**20:.1f}", f"{r.step_ms:.0f}",
                 f"{r.step_ratio:.3f}x", f"{r.moved_bytes / 2**20:.0f}",
                 f"{r.moved_per_param_byte:.2f}x", f"{r.belady_bytes / 2**20:.0f}",
                 f"{r.moved_vs_belady:.2f}x", f"{r.evictions_per_step:.0f}")  # fmt: skip
        print(" ".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
    verdicts = []
    for r in rows:
        if r.share == "100%":
            ok = r.step_ratio <= TARGET_FULL_RATIO
            verdicts.append(f"{'PASS' if ok else 'MISS'} 100%: step {r.step_ratio:.3f}x eager "
                            f"(<= {TARGET_FULL_RATIO}x)")  # fmt: skip
        if r.share == "25%":
            ok = r.moved_vs_belady <= TARGET_MOVED_RATIO
            verdicts.append(f"{'PASS' if ok else 'MISS'} 25%: moves {r.moved_vs_belady:.2f}x "
                            f"Belady (<= {TARGET_MOVED_RATIO}x)")  # fmt: skip
    for line in verdicts:
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            payload = {"benchmark": "chunks", "config": vars(args), "eager_step_ms": eager_ms,
                       "rows": [asdict(r) for r in rows], "targets": verdicts}  # fmt: skip
            json.dump(payload, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
