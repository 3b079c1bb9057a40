"""A full training step (forward, backward, optimizer) on a ~90M-parameter GPT, fp32 and bf16:
the fxstar engine with the whole model fitting against eager PyTorch with torch's fused AdamW,
timed in interleaved rounds of one run; and the optimizer phase alone.

fp32: eager fp32 + torch.optim.AdamW(fused=True) vs the engine (HybridAdam over fp32 chunks).
bf16: eager under torch.autocast(bfloat16) with fp32 parameters + fused AdamW (how torch users
train in bf16 on a CPU) vs the engine in bf16 (bf16 chunks, fp32 masters, HybridAdam writing
the bf16 copy in the same pass); the optimizer phase also against torch doing that same work
(bf16 weights, fp32 masters: upcast gradients, fused AdamW, copy back). The engine gets a
budget that holds the whole training state, so HybridAdam keeps the chunks on the compute
tier; a third engine copies gradients beside backward (overlap_grad_copies='on').

    python benchmarks/step.py
    python benchmarks/step.py --layers 2 --width 256 --json step.json   # quick
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from gpt_setup import add_gpt_args, make_gpt

import fxstar

TARGETS = {"fp32_step": 1.02, "bf16_step": 1.0, "bf16_optimizer": 1.3}
STATE_BYTES_PER_PARAMETER = 12 * 4  # a budget that holds the whole training state


@dataclass
class Row:
    precision: str
    eager_step_ms: float
    engine_step_ms: float
    step_ratio: float  # engine / eager, median of same-round ratios
    eager_optimizer_ms: float
    engine_optimizer_ms: float
    optimizer_speedup: float  # eager / engine
    masters_optimizer_ms: float | None = None  # bf16: torch with fp32 masters (EagerMasters)
    masters_speedup: float | None = None  # its optimizer phase / fxstar's
    kept_chunks: str = ""  # chunks HybridAdam kept on the compute tier, of all
    overlap_step_ratio: float | None = None  # the engine with gradient copies beside backward
    grad_copy_ms: float | None = None  # per step, with overlap_grad_copies on
    grad_copy_hidden: float | None = None  # share of that hidden behind backward


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Eager:
    def __init__(self, model, precision: str):
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        self.precision = precision

    def forward_backward(self, idx, targets) -> None:
        cast = torch.autocast("cpu", dtype=torch.bfloat16) if self.precision == "bf16" else None
        with cast or contextlib.nullcontext():
            loss = self.model(idx, targets)
        loss.backward()

    def optimize(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class EagerMasters:
    """How torch trains bf16 weights with fp32 masters (the work fxstar's bf16 step does):
    bf16 model, fused AdamW over fp32 copies, gradients upcast into them, weights copied back."""

    def __init__(self, model):
        self.model = model.to(torch.bfloat16)
        self.params = list(self.model.parameters())
        self.masters = [p.detach().float().requires_grad_() for p in self.params]
        self.optimizer = torch.optim.AdamW(self.masters, lr=1e-4, fused=True)

    def forward_backward(self, idx, targets) -> None:
        self.model(idx, targets).backward()

    def optimize(self) -> None:
        for param, master in zip(self.params, self.masters):
            master.grad = param.grad.float()
        self.optimizer.step()
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.masters)
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)


class Compiled:
    def __init__(self, model, precision: str, inputs, overlap: str = "auto"):
        # the whole training state fits: parameters, gradients, Adam's moments (and masters)
        # and the activations, so HybridAdam keeps every chunk on the compute tier
        budget = STATE_BYTES_PER_PARAMETER * sum(p.numel() for p in model.parameters())
        plan = fxstar.Plan(precision=precision, optimizer={"lr": 1e-4}, device_memory=budget,
                           overlap_grad_copies=overlap)  # fmt: skip
        self.engine = fxstar.compile(model, plan, inputs)

    def forward_backward(self, idx, targets) -> None:
        self.engine(idx, targets).backward()

    def optimize(self) -> None:
        self.engine.step()


def bench(precision: str, args: argparse.Namespace) -> Row:
    eager_model, idx, targets = make_gpt(args)
    eager = Eager(eager_model, precision)
    compiled = Compiled(make_gpt(args)[0], precision, (idx, targets))
    overlapped = Compiled(make_gpt(args)[0], precision, (idx, targets), overlap="on")
    runners = [("eager", eager), ("engine", compiled), ("overlap", overlapped)]
    if precision == "bf16":
        runners.append(("masters", EagerMasters(make_gpt(args)[0])))
    rows: dict[str, dict[str, list[float]]] = {}
    for _ in range(1 + args.steps):  # the first round warms up
        for name, runner in runners:
            fb = timed(lambda r=runner: r.forward_backward(idx, targets))
            opt = timed(runner.optimize)
            times = rows.setdefault(name, {"step": [], "optimizer": []})
            times["step"].append(fb + opt)
            times["optimizer"].append(opt)
    e, c, o = rows["eager"], rows["engine"], rows["overlap"]
    manager = compiled.engine.chunks
    kept = f"{len(compiled.engine.optimizer.device_chunks)}/{len(manager.chunks)}"
    copies = overlapped.engine.chunks.stats
    row = Row(
        precision=precision,
        eager_step_ms=statistics.median(e["step"][1:]) * 1e3,
        engine_step_ms=statistics.median(c["step"][1:]) * 1e3,
        step_ratio=statistics.median(b / a for a, b in zip(e["step"][1:], c["step"][1:])),
        eager_optimizer_ms=statistics.median(e["optimizer"][1:]) * 1e3,
        engine_optimizer_ms=statistics.median(c["optimizer"][1:]) * 1e3,
        optimizer_speedup=statistics.median(
            a / b for a, b in zip(e["optimizer"][1:], c["optimizer"][1:])
        ),
        kept_chunks=kept,
        overlap_step_ratio=statistics.median(b / a for a, b in zip(e["step"][1:], o["step"][1:])),
        grad_copy_ms=copies.grad_copy_seconds / (1 + args.steps) * 1e3,
        grad_copy_hidden=overlapped.engine.chunks.grad_copy_overlap(),
    )
    if precision == "bf16":
        m = rows["masters"]["optimizer"][1:]
        row.masters_optimizer_ms = statistics.median(m) * 1e3
        row.masters_speedup = statistics.median(a / b for a, b in zip(m, c["optimizer"][1:]))
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_gpt_args(parser)
    parser.add_argument("--steps", type=int, default=5, help="timed rounds per precision")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    n = sum(p.numel() for p in make_gpt(args)[0].parameters())
    print(f"GPT {args.layers} layers, d={args.width}, vocab {args.vocab}: {n / 1e6:.1f}M "
          f"parameters; batch {args.batch_size} x {args.seq_len}; "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    rows = [bench(p, args) for p in args.precisions.split(",")]
    header = ("precision", "eager ms", "engine ms", "ratio", "eager opt ms", "fxstar opt ms",
              "opt speedup", "kept chunks")  # fmt: skip
    widths = (9, 10, 10, 7, 13, 14, 12, 12)
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, widths)))
    for r in rows:
        cells = (r.precision, f"{r.eager_step_ms:.0f}", f"{r.engine_step_ms:.0f}",
                 f"{r.step_ratio:.3f}x", f"{r.eager_optimizer_ms:.0f}",
                 f"{r.engine_optimizer_ms:.0f}", f"{r.optimizer_speedup:.2f}x",
                 r.kept_chunks)  # fmt: skip
        print(" ".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
    print("eager: fused AdamW (bf16: autocast, fp32 parameters); engine: HybridAdam over chunks.")
    for r in rows:
        if r.masters_optimizer_ms is not None:
            print(f"{r.precision} torch with bf16 weights and fp32 masters (upcast gradients, "
                  f"fused AdamW, copy back): optimizer {r.masters_optimizer_ms:.0f} ms"
                  )  # fmt: skip
    for r in rows:
        print(f"{r.precision} with overlap_grad_copies='on' (a worker thread copies gradients "
              f"into their buffers while backward goes on): {r.grad_copy_ms:.0f} ms of copies "
              f"per step, {r.grad_copy_hidden:.0%} hidden; step {r.overlap_step_ratio:.3f}x "
              "eager")  # fmt: skip
    verdicts = []
    for r in rows:
        target = TARGETS[f"{r.precision}_step"]
        ok = r.step_ratio <= target
        verdicts.append(f"{'PASS' if ok else 'MISS'} {r.precision} step {r.step_ratio:.3f}x "
                        f"eager (<= {target}x)")  # fmt: skip
        if r.precision == "bf16":
            target = TARGETS["bf16_optimizer"]
            ok = r.masters_speedup >= target
            verdicts.append(f"{'PASS' if ok else 'MISS'} bf16 optimizer {r.masters_speedup:.2f}x "
                            f"faster than torch's doing the same work (>= {target}x); "
                            f"{r.optimizer_speedup:.2f}x autocast + fused AdamW, which keeps no "
                            "bf16 weights to write")  # fmt: skip
    for line in verdicts:
        print(line)
    if args.json:
        payload = {"benchmark": "step", "config": vars(args), "rows": [asdict(r) for r in rows],
                   "targets": verdicts}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
