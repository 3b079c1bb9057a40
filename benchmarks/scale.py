"""Scale: what training a model larger than the compute device costs on the host.

1. Host bytes per parameter: the peak resident memory of training a GPT, per parameter, for
   eager PyTorch (fused AdamW) and fxstar's chunk engine, from a host model and from a model
   built on the meta device whose weights are read from safetensors into the chunk homes. Each
   run is a process of its own (peak RSS is the process's); compile's own peak apart.
   PatrickStar's paper figure (fp16 + fp32 master) is 14 bytes per parameter.
2. Compile (capture and every pass, no chunk homes) of meta-built GPTs of growing size: time
   and peak memory must not grow with the parameter count (fake tensors throughout).

    python benchmarks/scale.py                    # ~85M parameters, 2 steps; 0.1B..8B compiles
    python benchmarks/scale.py --layers 24 --width 1024 --json scale.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import torch
from gpt_setup import add_gpt_args, make_gpt

import fxstar

RUNS = ("eager", "fxstar fp32", "fxstar fp32 meta+safetensors", "fxstar bf16",
        "fxstar bf16 meta+safetensors")  # fmt: skip


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss() -> int:
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def one_run(run: str, args: argparse.Namespace, weights: str) -> dict:
    """In a child process: build, compile, train `args.steps` steps; the peaks."""
    base = rss()
    if "meta" in run:
        with torch.device("meta"):
            model, idx, targets = make_gpt(args)
        idx, targets = make_gpt_inputs(args)
    else:
        model, idx, targets = make_gpt(args)
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    start = time.perf_counter()
    if run == "eager":
        engine, compile_peak = model, peak_rss()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    else:
        precision = "bf16" if "bf16" in run else "fp32"
        plan = fxstar.Plan(device_memory=args.device_memory, precision=precision,
                           optimizer={"lr": 1e-4})  # fmt: skip
        engine = fxstar.compile(model, plan, (idx, targets),
                                weights=weights if "meta" in run else None)  # fmt: skip
        compile_peak = peak_rss()
    compile_seconds = time.perf_counter() - start
    for _ in range(args.steps):
        loss = engine(idx, targets)
        loss.backward()
        if run == "eager":
            optimizer.step()
            optimizer.zero_grad()
        else:
            engine.step()
            engine.zero_grad()
    arena = engine.chunks.arena.buffer.numel() if run != "eager" else 0
    return {
        "run": run, "params": params, "baseline_rss": base, "compile_peak": compile_peak,
        "peak": peak_rss(), "arena_bytes": arena, "compile_seconds": compile_seconds,
        "loss": loss.item(),
    }  # fmt: skip


# width and depth: one depth, so the graph has the same nodes at every size
COMPILE_SIZES = {"0.1B": (1024, 8), "0.5B": (2304, 8), "2B": (4608, 8), "8B": (9216, 8)}


def compile_only(size: str, args: argparse.Namespace) -> dict:
    """In a child process: capture a meta-built GPT of `size` and run the chunk plan's passes."""
    from fxstar.capture import capture
    from fxstar.models.gpt import GPT, GPTConfig
    from fxstar.passes import PassManager, passes_for

    def meta_gpt(width: int, layers: int) -> GPT:
        cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq_len, n_layer=layers,
                        n_head=width // 128, n_embd=width, dropout=0.0)  # fmt: skip
        with torch.device("meta"):
            return GPT(cfg)

    def compiled(model: GPT):
        plan = fxstar.Plan(device_memory="auto")
        return PassManager(passes_for(plan)).run(capture(model, (idx, targets), plan=plan))

    idx, targets = make_gpt_inputs(args)
    compiled(meta_gpt(128, 1))  # torch's first export imports and caches a few hundred MiB
    model = meta_gpt(*COMPILE_SIZES[size])
    base, start = peak_rss(), time.perf_counter()
    program = compiled(model)
    return {
        "size": size, "params": sum(p.numel() for p in set(model.parameters())),
        "seconds": time.perf_counter() - start, "peak_growth": peak_rss() - base,
        "chunks": len(program.decisions.chunk_layout.chunks),
    }  # fmt: skip


def make_gpt_inputs(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch make_gpt draws (same seed), without building a model."""
    torch.manual_seed(0)
    idx = torch.randint(0, args.vocab, (args.batch_size, args.seq_len))
    return idx, torch.randint(0, args.vocab, (args.batch_size, args.seq_len))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_gpt_args(parser)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(
        "--device-memory",
        default="auto",
        help="the chunk engine's budget (a size or a share of the parameters)",
    )
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--compile-sizes", default=",".join(COMPILE_SIZES))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--weights", help=argparse.SUPPRESS)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    if args.child:
        if args.child in COMPILE_SIZES:
            row = compile_only(args.child, args)
        else:
            row = one_run(args.child, args, args.weights)
        print(json.dumps(row))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        from safetensors.torch import save_model

        model, _, _ = make_gpt(args)
        save_model(model, os.path.join(tmp, "model.safetensors"))
        del model
        rows = [child(run, argv, tmp) for run in args.runs.split(",") if run]
        compiles = [child(size, argv, tmp) for size in args.compile_sizes.split(",") if size]
    if rows:
        print(f"GPT {args.layers} layers, width {args.width}, {rows[0]['params'] / 1e6:.1f}M "
              f"parameters, batch {args.batch_size} x {args.seq_len}, {args.steps} steps; "
              f"device_memory {args.device_memory} (the arena is on the host here)")  # fmt: skip
        print(f"{'run':<30} {'B/param':>8} {'w/o arena':>10} {'compile':>8} {'compile s':>9}")
        for r in rows:
            n, base = r["params"], r["baseline_rss"]
            r["bytes_per_param"] = (r["peak"] - base) / n
            r["bytes_per_param_without_arena"] = (r["peak"] - base - r["arena_bytes"]) / n
            r["compile_bytes_per_param"] = (r["compile_peak"] - base) / n
            print(f"{r['run']:<30} {r['bytes_per_param']:>8.1f} "
                  f"{r['bytes_per_param_without_arena']:>10.1f} "
                  f"{r['compile_bytes_per_param']:>8.1f} {r['compile_seconds']:>9.1f}")  # fmt: skip
        print(
            "B/param: (peak RSS - RSS after imports) / parameters, activations included; w/o "
            "arena: less the compute tier's arena (on the host here); compile: the same at the "
            "end of compile"
        )
    print()
    print(f"{'meta GPT':<8} {'params':>8} {'compile s':>9} {'peak growth':>12} {'chunks':>7}")
    for c in compiles:
        print(f"{c['size']:<8} {c['params'] / 1e9:>7.2f}B {c['seconds']:>9.2f} "
              f"{c['peak_growth'] / 2**20:>9.1f}MiB {c['chunks']:>7}")  # fmt: skip
    if compiles:
        growth = max(c["seconds"] for c in compiles) / min(c["seconds"] for c in compiles)
        print(f"compile time, largest over smallest: {growth:.2f}x (target: within 2x)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump({"args": vars(args), "rows": rows, "compiles": compiles}, file, indent=2)
    return 0


def child(what: str, argv: list[str] | None, weights: str) -> dict:
    """Run one row in a process of its own (its peak RSS is the row's)."""
    command = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]),
               "--child", what, "--weights", weights]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{what} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main())
