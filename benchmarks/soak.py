"""Soak: many training steps with chunks (evicting), checkpoint regions, activation offload and
the memory monitor, sampling the process's resident memory, the arena's bytes in use, live
tensors and Python objects. After warm-up every figure must stay flat (within 2% of its value
at the end of warm-up, a few MiB of allocator noise allowed for RSS); a leak shows as a slope.

    python benchmarks/soak.py                        # 1000 steps, small GPT
    python benchmarks/soak.py --steps 200 --json soak.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from dataclasses import asdict, dataclass

import torch
from gpt_setup import add_gpt_args, make_gpt

import fxstar

TOLERANCE = 0.02
RSS_SLACK = 4 << 20  # allocator noise, bytes


@dataclass
class Sample:
    step: int
    rss_bytes: int
    arena_in_use: int
    live_tensors: int
    python_objects: int
    monitor_samples: int


def rss_bytes() -> int:
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def sample(step: int, engine: fxstar.Engine) -> Sample:
    gc.collect()
    objects = gc.get_objects()
    manager = engine.chunks
    return Sample(
        step=step,
        rss_bytes=rss_bytes(),
        arena_in_use=manager.arena.stats()["in_use"],
        live_tensors=sum(
            type(o) is torch.Tensor or type(o) is torch.nn.Parameter for o in objects
        ),  # fmt: skip
        # the monitor's samples are bounded on their own (max_samples): counted apart
        python_objects=len(objects) - (len(manager.monitor.samples) if manager.monitor else 0),
        monitor_samples=len(manager.monitor.samples) if manager.monitor else 0,
    )


def drift(samples: list[Sample], field: str, slack: int = 0) -> tuple[float, bool]:
    """Largest deviation after warm-up relative to the value at the end of warm-up."""
    base = getattr(samples[0], field)
    worst = max(abs(getattr(s, field) - base) for s in samples)
    return worst / max(base, 1), worst <= TOLERANCE * base + slack


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_gpt_args(parser)
    parser.set_defaults(vocab=512, width=128, layers=4, heads=4, seq_len=64, batch_size=2)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=50, help="sample every N steps")
    parser.add_argument("--json", help="write the samples and verdicts here")
    args = parser.parse_args()
    if args.steps < 4 * args.every:
        parser.error("--steps must be at least four sampling intervals")
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    model, idx, targets = make_gpt(args)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    plan = fxstar.Plan(
        device_memory=param_bytes, static_partition=True, warmup_gpu_chunk_mem_ratio=0.6,
        checkpoint="blocks", offload_activations=True, async_mem_monitor=True,
        optimizer={"type": "adamw", "lr": 1e-4},
    )  # fmt: skip
    engine = fxstar.compile(model, plan, example_inputs=(idx, targets))
    warmup = max(args.steps // 10, args.every)
    samples: list[Sample] = []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        engine(idx, targets).backward()
        engine.step()
        if step >= warmup and step % args.every == 0:
            samples.append(sample(step, engine))
    seconds = time.perf_counter() - start
    verdicts = {
        "rss_bytes": drift(samples, "rss_bytes", RSS_SLACK),
        "arena_in_use": drift(samples, "arena_in_use"),
        "live_tensors": drift(samples, "live_tensors"),
        "python_objects": drift(samples, "python_objects"),
    }
    print(f"soak: {args.steps} steps in {seconds:.1f}s ({1e3 * seconds / args.steps:.1f} ms/step), "
          f"{engine.chunks.stats.evictions} evictions; samples from step {warmup}")  # fmt: skip
    print(f"{'step':>6} {'RSS MiB':>9} {'arena B':>9} {'tensors':>8} {'objects':>8} {'monitor':>8}")
    for s in samples:
        print(f"{s.step:>6} {s.rss_bytes / 2**20:>9.1f} {s.arena_in_use:>9} {s.live_tensors:>8} "
              f"{s.python_objects:>8} {s.monitor_samples:>8}")  # fmt: skip
    for name, (ratio, ok) in verdicts.items():
        print(f"{name}: largest drift {ratio:.2%} after warm-up: {'PASS' if ok else 'FAIL'}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            judged = {k: {"drift": r, "pass": ok} for k, (r, ok) in verdicts.items()}
            json.dump({"steps": args.steps, "seconds": seconds, "warmup": warmup,
                       "samples": [asdict(s) for s in samples], "verdicts": judged},
                      file, indent=2)  # fmt: skip
    engine.close()


if __name__ == "__main__":
    main()
