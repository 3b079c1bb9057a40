"""CPU Adam throughput: fxstar's kernels against torch, as shares of this machine's bandwidth.

The roofline is `adam_traffic`, a loop in fxstar._C with Adam's exact memory traffic (read
param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq: 28 bytes per element) and
trivial arithmetic. This host's bandwidth drifts by up to 2x within minutes, so every row is
timed interleaved with the roofline, round by round, and only same-round ratios are reported.

    python benchmarks/adam.py                      # 1M, 16M, 64M, 256M elements
    python benchmarks/adam.py --sizes 1M,16M --json adam.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from fxstar.runtime import cpu_adam

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01
LOSS_SCALE, MAX_NORM = 1024.0, 1.0
TARGETS = {"fp32_share": 0.95, "fp32_vs_torch": 1.1, "mixed_vs_torch": 1.3, "from_size": 16 << 20}


@dataclass
class Row:
    size: int
    name: str
    bytes: int  # the bytes the operation must move at the least
    seconds: float  # median over rounds
    gbps: float
    roofline_share: float  # median of same-round (roofline time / row time)
    speedup: float | None = None  # against the row's torch baseline, median of same-round ratios
    baseline: str | None = None


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def clip_scale(sum_sq: float) -> float:
    """1/loss_scale times the clip-norm factor, from the scaled gradients' sum of squares."""
    norm = sum_sq**0.5 / LOSS_SCALE
    return (1.0 / LOSS_SCALE) * min(1.0, MAX_NORM / (norm + 1e-6))


def kernels_for(n: int, threads: int) -> tuple[dict[str, Callable[[], object]], dict[str, int]]:
    """The timed operations for n elements, sharing buffers so 256M fits in memory."""
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * 1e-2
    m, v = torch.zeros(n), torch.zeros(n)
    g_bf16 = (g * LOSS_SCALE).bfloat16()
    p_bf16 = torch.empty(n, dtype=torch.bfloat16)
    param = torch.nn.Parameter(p)  # torch's optimizers step the same storage
    param.grad = g
    fused = torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    foreach = torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=True)
    step = [0]
    step_t = torch.tensor(0.0)

    def fxstar_fp32():
        step[0] += 1
        cpu_adam.adam_step(
            p,
            g,
            m,
            v,
            step=step[0],
            lr=LR,
            betas=BETAS,
            eps=EPS,
            weight_decay=WD,
            num_threads=threads,
        )

    def fxstar_mixed():
        stats = cpu_adam.grad_stats(g_bf16, num_threads=threads)
        if not stats.finite:
            return
        step[0] += 1
        cpu_adam.adam_step(
            p,
            g_bf16,
            m,
            v,
            step=step[0],
            lr=LR,
            betas=BETAS,
            eps=EPS,
            weight_decay=WD,
            grad_scale=clip_scale(stats.sum_sq),
            out=p_bf16,
            num_threads=threads,
        )

    g32 = torch.empty(n)  # preallocated: a fresh 4n-byte tensor per step would page-fault

    def torch_mixed(norm_of_bf16: bool) -> Callable[[], None]:
        """Upcast into a preallocated buffer, one norm for the clip factor and the overflow flag,
        fused AdamW with the unscale folded into its grad_scale, then the bf16 copy."""

        def run():
            if norm_of_bf16:  # torch's fastest norm, though rounded to bf16
                norm = torch._foreach_norm([g_bf16])[0].float()
                g32.copy_(g_bf16)
            else:
                g32.copy_(g_bf16)
                norm = torch.linalg.vector_norm(g32)
            found_inf = (~torch.isfinite(norm)).float()
            step_t.add_(1)
            torch._fused_adamw_(
                [p],
                [g32],
                [m],
                [v],
                [],
                [step_t],
                lr=LR,
                beta1=BETAS[0],
                beta2=BETAS[1],
                weight_decay=WD,
                eps=EPS,
                amsgrad=False,
                maximize=False,
                grad_scale=torch.tensor(1.0 / clip_scale(float(norm) ** 2)),
                found_inf=found_inf,
            )
            p_bf16.copy_(p)

        return run

    ops = {
        "roofline (adam_traffic)": lambda: cpu_adam.adam_traffic(p, g, m, v, num_threads=threads),
        "fxstar fp32": fxstar_fp32,
        "torch fused AdamW": fused.step,
        "torch foreach AdamW": foreach.step,
        "fxstar mixed (stats + adam, bf16 in/out)": fxstar_mixed,
        "torch mixed: upcast, norm, fused(grad_scale), copy": torch_mixed(False),
        "torch mixed: bf16 foreach_norm, upcast, fused, copy": torch_mixed(True),
    }
    deepspeed = deepspeed_step(p, g, m, v)
    if deepspeed is not None:
        ops["DeepSpeed CPUAdam"] = deepspeed
    fp32_bytes, mixed_bytes = 28 * n, 30 * n  # mixed: 2 (stats) + 2 + 12 + 12 + 2 (bf16 out)
    nbytes = {name: mixed_bytes if "mixed" in name else fp32_bytes for name in ops}
    return ops, nbytes


def deepspeed_step(p, g, m, v) -> Callable[[], object] | None:
    """DeepSpeed's CPUAdam when it is importable and builds here; it is not a dependency."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception:
        return None
    try:
        param = torch.nn.Parameter(p)
        param.grad = g
        return DeepSpeedCPUAdam([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD).step
    except Exception:
        return None


BASELINES = {
    "fxstar fp32": ["torch fused AdamW"],
    "fxstar mixed (stats + adam, bf16 in/out)": [
        "torch mixed: upcast, norm, fused(grad_scale), copy",
        "torch mixed: bf16 foreach_norm, upcast, fused, copy",
    ],
}


def bench_size(n: int, threads: int, rounds: int) -> list[Row]:
    """Each round times every operation once, each between two runs of the roofline; a row's
    share compares it with the geometric mean of the two runs around it (unbiased under a
    linear drift; the minimum of the two, used before, flattered the roofline by its noise)."""
    ops, nbytes = kernels_for(n, threads)
    for fn in ops.values():  # first touch and warm-up
        fn()
    roof = "roofline (adam_traffic)"
    times: dict[str, list[float]] = {name: [] for name in ops}
    around: dict[str, list[float]] = {name: [] for name in ops}  # the roofline beside each time
    for _ in range(rounds):
        before = timed(ops[roof])
        for name, fn in ops.items():
            if name == roof:
                continue
            times[name].append(timed(fn))
            after = timed(ops[roof])
            around[name].append((before * after) ** 0.5)
            times[roof].append(after)
            before = after
    around[roof] = times[roof]
    rows = []
    for name, ts in times.items():
        shares = [(nbytes[name] / t) / (nbytes[roof] / r) for t, r in zip(ts, around[name])]
        row = Row(
            size=n,
            name=name,
            bytes=nbytes[name],
            seconds=statistics.median(ts),
            gbps=nbytes[name] / statistics.median(ts) / 1e9,
            roofline_share=statistics.median(shares),
        )
        if name in BASELINES:
            # The fastest composition torch offers, judged by its median.
            best = min(BASELINES[name], key=lambda b: statistics.median(times[b]))
            row.baseline = best
            row.speedup = statistics.median(b / a for a, b in zip(ts, times[best]))
        rows.append(row)
    return rows


def print_table(rows: list[Row]) -> None:
    header = f"{'elements':>9} {'kernel':<50} {'ms':>8} {'GB/s':>7} {'roof':>6} {'speedup':>8}"
    print(header)
    print("-" * len(header))
    for r in rows:
        speed = f"{r.speedup:.2f}x" if r.speedup is not None else ""
        print(
            f"{r.size / (1 << 20):>8.0f}M {r.name:<50} {r.seconds * 1e3:>8.2f} {r.gbps:>7.1f} "
            f"{r.roofline_share:>6.0%} {speed:>8}"
        )
    print(
        "roof: share of the Adam-shaped bandwidth measured just before and after; speedup: against"
    )
    print("torch fused AdamW (fp32) or the fastest torch composition of the same mixed step.")


def check_targets(rows: list[Row]) -> list[str]:
    """Lines saying which targets of the issue hold at 16M elements and above."""
    lines = []
    for r in rows:
        if r.size < TARGETS["from_size"] or r.speedup is None:
            continue
        if r.name == "fxstar fp32":
            ok = r.roofline_share >= TARGETS["fp32_share"] and r.speedup >= TARGETS["fp32_vs_torch"]
            lines.append(
                f"{'PASS' if ok else 'MISS'} fp32 at {r.size >> 20}M: {r.roofline_share:.0%} of "
                f"roofline (>= 95%), {r.speedup:.2f}x torch fused (>= 1.1x)"
            )
        else:
            ok = r.speedup >= TARGETS["mixed_vs_torch"]
            lines.append(
                f"{'PASS' if ok else 'MISS'} mixed at {r.size >> 20}M: {r.speedup:.2f}x the "
                f"fastest torch composition (>= 1.3x)"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1M,16M,64M,256M", help="element counts, e.g. 1M,16M")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    print(
        f"fxstar CPU Adam, variant {cpu_adam.selected_variant()}, {args.threads} threads, "
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}"
    )
    rows = []
    for n in sizes:
        rows += bench_size(n, args.threads, args.rounds)
    print_table(rows)
    verdicts = check_targets(rows)
    for line in verdicts:
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "benchmark": "adam",
                    "variant": cpu_adam.selected_variant(),
                    "threads": args.threads,
                    "torch": torch.__version__,
                    "rows": [asdict(r) for r in rows],
                    "targets": verdicts,
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
