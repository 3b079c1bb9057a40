"""Dynamic partition: bytes moved host -> compute per step at a chunk share of the parameter
bytes (25% by default) when the chunks follow each moment's share (what the budget leaves
beside that moment's bytes besides chunks: the runtime's way, on a card through
arena.PooledBlocks), against the fixed arena (the budget less the activations' peak, at every
moment), and against what a Belady-optimal cache moves under the per-moment shares (benchmarks/
chunks.py's simulator). Run on fxstar.testing.SimulatedDevice, whose chunk blocks come from
its allocator as a card's do. Bytes moved are deterministic: one run gives them.

    python benchmarks/dynamic_partition.py --layers 4 --width 256 --heads 8 --json dp.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

from chunks import belady_bytes
from gpt_setup import add_gpt_args, make_gpt

import fxstar
from fxstar.passes.chunk_layout import nonmodel_peak
from fxstar.runtime.device import using_device
from fxstar.testing.async_device import SimulatedDevice


@dataclass
class Row:
    share: str
    device_memory: int
    activation_peak: int
    dynamic_bytes: int  # moved per step, per-moment shares
    fixed_bytes: int  # moved per step, the arena fixed at the budget less the peak
    belady_bytes: int  # a Belady-optimal cache under the per-moment shares
    dynamic_vs_fixed: float
    dynamic_vs_belady: float


def moved_per_step(args, budget: int, fixed: int | None, steps: int) -> tuple[int, object]:
    """Bytes moved host -> compute in the last of `steps` steps, and the engine."""
    model, idx, targets = make_gpt(args)
    with SimulatedDevice(seed=0, max_delay=0.0) as device, using_device(device):
        engine = fxstar.compile(model, fxstar.Plan(device_memory=budget, hybrid_adam=False),
                                (idx, targets))  # fmt: skip
        if fixed is not None:  # the fixed arena: one share at every moment
            engine.program.decisions.chunk_plan.static_share = fixed
        engine.chunks.checking = True
        for _ in range(steps):
            before = engine.chunks.stats.bytes_to_compute
            engine(idx, targets).backward()
            engine.step()
            moved = engine.chunks.stats.bytes_to_compute - before
        manager = engine.chunks
        plan = engine.program.decisions.chunk_plan.access
        manager._plan = plan
        capacity = [manager.share(t) // manager.layout.chunk_bytes for t in range(len(plan))]
        used = {c.id: c.used * manager.layout.dtype.itemsize for c in manager.layout.chunks}
        ideal = belady_bytes(plan.chunks, capacity, used, in_use=plan.in_use)
        engine.close()
    return moved, ideal


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_gpt_args(parser)
    parser.add_argument("--shares", default="25", help="chunk share, %% of parameter bytes")
    parser.add_argument("--steps", type=int, default=3, help="steps; the last one is counted")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)

    model, idx, targets = make_gpt(args)
    probe = fxstar.compile(model, fxstar.Plan(passes=["shape_memory"]), (idx, targets))
    param_bytes, peak = probe.program.param_bytes, nonmodel_peak(probe.program)
    rows = []
    for share in args.shares.split(","):
        budget = peak + int(int(share) / 100 * param_bytes)
        dynamic, ideal = moved_per_step(args, budget, None, args.steps)
        fixed, _ = moved_per_step(args, budget, budget - peak, args.steps)
        rows.append(Row(f"{share}%", budget, peak, dynamic, fixed, ideal,
                        dynamic / fixed if fixed else float("nan"),
                        dynamic / ideal if ideal else float("nan")))  # fmt: skip
    print(f"GPT {args.layers} layers, d={args.width}: {param_bytes / 2**20:.1f} MiB of "
          f"parameters, activations peak ~{peak / 2**20:.1f} MiB")  # fmt: skip
    header = ("share", "budget MiB", "dynamic MiB", "fixed MiB", "Belady MiB", "vs fixed",
              "vs Belady")  # fmt: skip
    widths = (6, 11, 12, 10, 11, 9, 10)
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, widths, strict=True)))
    for r in rows:
        cells = (r.share, f"{r.device_memory / 2**20:.1f}", f"{r.dynamic_bytes / 2**20:.1f}",
                 f"{r.fixed_bytes / 2**20:.1f}", f"{r.belady_bytes / 2**20:.1f}",
                 f"{r.dynamic_vs_fixed:.2f}x", f"{r.dynamic_vs_belady:.2f}x")  # fmt: skip
        print(" ".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "dynamic_partition", "config": vars(args),
                       "rows": [asdict(r) for r in rows]}, f, indent=2)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
