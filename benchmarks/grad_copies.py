"""A gradient into its chunk's buffer: the copy backward makes, against autograd accumulating
into the buffer itself, for the linears of a GPT, in the same run.

Today a parameter leaf has no `.grad`: AccumulateGrad steals the gradient the backward op made,
and a hook copies it into the chunk's gradient buffer (`tier_copy.copy_payload`, fxstar._C).
The alternative is a leaf whose `.grad` is preset to its view of the buffer: AccumulateGrad then
adds in place, into a buffer that must be zeroed first. Each gradient is written just before it
is taken, as the op that made it leaves it (hot in cache as far as it fits). The order of the
ways rotates from round to round; only same-round ratios are reported.

    python benchmarks/grad_copies.py                     # d=768, 12 layers: 85M parameters
    python benchmarks/grad_copies.py --layers 4 --json grad_copies.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from fxstar.runtime.tier_copy import copy_payload


def linear_shapes(width: int, layers: int) -> list[tuple[int, int]]:
    """The weights of a GPT block's linears (qkv, attention out, MLP up and down), per layer."""
    return [(3 * width, width), (width, width), (4 * width, width), (width, 4 * width)] * layers


def ways(width: int, layers: int) -> tuple[dict[str, Callable[[], float]], int]:
    """Each way of landing every gradient in the flat buffer, timing only that part."""
    shapes = linear_shapes(width, layers)
    numel = sum(a * b for a, b in shapes)
    buffer = torch.zeros(numel)
    views, offset = [], 0
    for a, b in shapes:
        views.append(buffer[offset : offset + a * b].view(a, b))
        offset += a * b
    grads = [torch.full(shape, 0.5) for shape in shapes]

    def each(land: Callable[[torch.Tensor, torch.Tensor], object]) -> float:
        total = 0.0
        for view, grad in zip(views, grads, strict=True):
            grad.mul_(1.0)  # just made by its op
            start = time.perf_counter()
            land(view, grad)
            total += time.perf_counter() - start
        return total

    def zeroed_then_added() -> float:
        start = time.perf_counter()
        buffer.zero_()
        return time.perf_counter() - start + each(lambda v, g: v.add_(g))

    return {
        "copy (tier_copy, fxstar._C): today": lambda: each(copy_payload),
        "copy (torch copy_): before": lambda: each(lambda v, g: v.copy_(g)),
        "preset .grad: zero, then add in place": zeroed_then_added,
    }, numel


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    ops, numel = ways(args.width, args.layers)
    names = list(ops)
    for fn in ops.values():  # first touch
        fn()
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(args.rounds):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            times[name].append(ops[name]())
    today = times[names[0]]
    rows = [
        {
            "way": name,
            "ms": statistics.median(ts) * 1e3,
            "vs_today": statistics.median(t / r for t, r in zip(ts, today)),
        }
        for name, ts in times.items()
    ]
    print(f"gradients of {numel / 1e6:.0f}M fp32 parameters into their chunk buffer, one step")
    print(f"{'way':<40} {'ms':>8} {'time vs today':>14}")
    for row in rows:
        print(f"{row['way']:<40} {row['ms']:>8.1f} {row['vs_today']:>13.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "grad_copies", "parameters": numel, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
