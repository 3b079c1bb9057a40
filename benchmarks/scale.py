"""Scale: what training a model larger than the compute device costs on the host.

1. Host bytes per parameter: the peak resident memory of training a GPT, per parameter, for
   eager PyTorch (fused AdamW) and fxstar's chunk engine, from a host model and from a model
   built on the meta device whose weights are read from safetensors into the chunk homes. Each
   run is a process of its own (peak RSS is the process's); compile's own peak apart. The
   model-state column leaves out the arena (the compute tier, on the host only here) and the
   activations saved for backward (measured in the same run): the targets are 16 bytes for
   fp32 (parameter, gradient, two moments) and 14 for bf16 (fp32 master, two moments, the bf16
   payload whose room the gradient takes), PatrickStar's paper figure.
2. Compile (capture and every pass, no chunk homes) of meta-built GPTs of growing size: time
   and peak memory must not grow with the parameter count (fake tensors throughout).
3. `--largest`: the deepest GPT of width 2048 that trains two steps within the host's memory
   (less a reserve), eager fp32 against fxstar bf16 with a 2 GiB arena, on the host and with
   the disk tier (its files under --disk-dir, 12 bytes a parameter; the depth is capped by the
   free disk there). The depth is predicted
   from each run's bytes per layer at a small depth, then confirmed by training it (a watchdog
   ends a run whose resident memory passes the limit, so the machine never swaps or kills).

    python benchmarks/scale.py                    # ~85M parameters, 2 steps; 0.1B..8B compiles
    python benchmarks/scale.py --layers 24 --width 1024 --heads 16 --batch-size 2 \
        --seq-len 128 --device-memory 1GiB --json scale.json   # the issue's 311M GPT
    python benchmarks/scale.py --largest --compile-sizes "" --runs "" --batch-size 2 \
        --seq-len 128 --reserve 3.04   # part 3 within 20.5 GiB of a 23.5 GiB machine (~1 h)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import torch
from gpt_setup import add_gpt_args, make_gpt

import fxstar
from fxstar.passes.chunk_layout import ChunkLayoutError

RUNS = ("eager", "fxstar fp32", "fxstar fp32 meta+safetensors", "fxstar bf16",
        "fxstar bf16 meta+safetensors")  # fmt: skip
# part 3: eager against fxstar's smallest form, on the host and with the disk tier
LARGEST = ("eager", "fxstar bf16 meta+init", "fxstar bf16 meta+init disk")
DISK_BYTES_PER_PARAM = 12  # the disk tier's fp32 master and two fp32 moments
DISK_STATE = "fxstar-scale-state"  # under --disk-dir; removed after each run, killed or not
LARGEST_WIDTH, LARGEST_ARENA = 2048, "2GiB"


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss() -> int:
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def one_run(run: str, args: argparse.Namespace, weights: str) -> dict:
    """In a child process: build, compile, train `args.steps` steps; the peaks. fxstar's rows
    count from after a warm-up compile of a one-layer GPT: torch.export's first use imports
    and caches a fixed amount, reported apart (`fixed_bytes`), which is not per parameter."""
    start_rss = rss()
    if run != "eager":
        warm_up(args)
    base = rss()
    if "meta" in run:
        with torch.device("meta"):
            model, idx, targets = make_gpt(args)
        idx, targets = make_gpt_inputs(args)
    else:
        model, idx, targets = make_gpt(args)
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    start = time.perf_counter()
    saved = SavedBytes({p.untyped_storage().data_ptr() for p in model.parameters()})
    if run == "eager":
        engine, compile_peak = model, peak_rss()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    else:
        precision = "bf16" if "bf16" in run else "fp32"
        disk = os.path.join(args.disk_dir, DISK_STATE) if "disk" in run else None
        plan = fxstar.Plan(device_memory=args.device_memory, precision=precision,
                           optimizer={"lr": 1e-4}, host_memory=args.host_memory,
                           disk=disk)  # fmt: skip
        source = "init" if "init" in run else weights if "meta" in run else None
        try:
            engine = fxstar.compile(model, plan, (idx, targets), weights=source)
        # part 3: it does not fit, said at compile: the host budget, or the arena (the compute
        # tier: it holds the activations too, which grow with the depth)
        except (fxstar.HostMemoryError, ChunkLayoutError) as error:
            return {"run": run, "params": params, "refused": str(error)}
        compile_peak = peak_rss()
    compile_seconds = time.perf_counter() - start
    for step in range(args.steps):
        if run == "eager" and step == 0:  # fxstar's tracer counts the same (chunks left out)
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                loss = engine(idx, targets)
        else:
            loss = engine(idx, targets)
        loss.backward()
        if run == "eager":
            optimizer.step()
            optimizer.zero_grad()
        else:
            engine.step()
            engine.zero_grad()
    arena = engine.chunks.arena.held_bytes() if run != "eager" else 0
    activations = saved.peak if run == "eager" else engine.chunks.tracer.peak_nonmodel
    return {
        "run": run, "params": params, "baseline_rss": base, "fixed_bytes": base - start_rss,
        "compile_peak": compile_peak,
        "peak": peak_rss(), "arena_bytes": arena, "activation_bytes": activations,
        "compile_seconds": compile_seconds, "loss": loss.item(),
    }  # fmt: skip


class SavedBytes:
    """Bytes of the distinct storages autograd saves in one forward, parameters left out."""

    def __init__(self, parameters: set[int]):
        self.parameters, self.seen, self.peak = parameters, set(), 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.parameters and ptr not in self.seen and t.device.type != "meta":
            self.seen.add(ptr)
            self.peak += storage.nbytes()
        return t


# width and depth: one depth, so the graph has the same nodes at every size
COMPILE_SIZES = {"0.1B": (1024, 8), "0.5B": (2304, 8), "2B": (4608, 8), "8B": (9216, 8)}


def meta_gpt(args: argparse.Namespace, width: int, layers: int):
    """A GPT built on the meta device (no storage)."""
    from fxstar.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq_len, n_layer=layers,
                    n_head=max(width // 128, 1), n_embd=width, dropout=0.0)  # fmt: skip
    with torch.device("meta"):
        return GPT(cfg)


def compiled(model, args: argparse.Namespace):
    """Capture and every pass of the chunk plan, no chunk homes."""
    from fxstar.capture import capture
    from fxstar.passes import PassManager, passes_for

    plan = fxstar.Plan(device_memory="auto")
    inputs = make_gpt_inputs(args)
    return PassManager(passes_for(plan)).run(capture(model, inputs, plan=plan))


def warm_up(args: argparse.Namespace) -> None:
    """torch's first export imports and caches a few hundred MiB, once per process."""
    compiled(meta_gpt(args, 128, 1), args)


def compile_only(size: str, args: argparse.Namespace) -> dict:
    """In a child process: capture a meta-built GPT of `size` and run the chunk plan's passes."""
    warm_up(args)
    model = meta_gpt(args, *COMPILE_SIZES[size])
    base, start = peak_rss(), time.perf_counter()
    program = compiled(model, args)
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
    parser.add_argument("--largest", action="store_true", help="part 3 (about half an hour)")
    parser.add_argument("--reserve", type=float, default=2.0,
                        help="GiB of host memory part 3 leaves to the system")  # fmt: skip
    parser.add_argument("--host-memory", help="plan.host_memory of fxstar's rows")
    parser.add_argument("--disk-dir", default=tempfile.gettempdir(),
                        help="where part 3's disk-tier run keeps its files")  # fmt: skip
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
    child_argv = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--largest"]
    big = largest(args, child_argv) if args.largest else []
    if rows:
        print(f"GPT {args.layers} layers, width {args.width}, {rows[0]['params'] / 1e6:.1f}M "
              f"parameters, batch {args.batch_size} x {args.seq_len}, {args.steps} steps; "
              f"device_memory {args.device_memory} (the arena is on the host here)")  # fmt: skip
        print(f"{'run':<30} {'B/param':>8} {'arena':>6} {'activ.':>6} {'model state':>11} "
              f"{'target':>6} {'compile':>8} {'compile s':>9}")  # fmt: skip
        for r in rows:
            n, base = r["params"], r["baseline_rss"]
            r["bytes_per_param"] = (r["peak"] - base) / n
            r["model_state_bytes_per_param"] = (
                r["peak"] - base - r["arena_bytes"] - r["activation_bytes"]
            ) / n
            r["compile_bytes_per_param"] = (r["compile_peak"] - base) / n
            r["target"] = None if r["run"] == "eager" else 14 if "bf16" in r["run"] else 16
            print(f"{r['run']:<30} {r['bytes_per_param']:>8.1f} {r['arena_bytes'] / n:>6.1f} "
                  f"{r['activation_bytes'] / n:>6.1f} {r['model_state_bytes_per_param']:>11.1f} "
                  f"{r['target'] or '':>6} {r['compile_bytes_per_param']:>8.1f} "
                  f"{r['compile_seconds']:>9.1f}")  # fmt: skip
        fixed = max(r["fixed_bytes"] for r in rows)
        print(
            f"B/param: (peak RSS - RSS after imports) / parameters (fxstar's after a warm-up "
            f"compile too: {fixed / 2**20:.0f} MiB, once per process); arena: the compute tier's "
            "(on the host here); activ.: saved for backward at their peak; model state: "
            "B/param less both; compile: B/param at the end of compile"
        )
    print()
    print(f"{'meta GPT':<8} {'params':>8} {'compile s':>9} {'peak growth':>12} {'chunks':>7}")
    for c in compiles:
        print(f"{c['size']:<8} {c['params'] / 1e9:>7.2f}B {c['seconds']:>9.2f} "
              f"{c['peak_growth'] / 2**20:>9.1f}MiB {c['chunks']:>7}")  # fmt: skip
    if compiles:
        growth = max(c["seconds"] for c in compiles) / min(c["seconds"] for c in compiles)
        print(f"compile time, largest over smallest: {growth:.2f}x (target: within 2x)")
    if big:
        print()
        print(f"largest GPT of width {LARGEST_WIDTH} training 2 steps within "
              f"{big[0]['limit'] / 2**30:.1f} GiB of host memory (batch {args.batch_size} x "
              f"{args.seq_len}; fxstar's arena {LARGEST_ARENA})")  # fmt: skip
        print(f"{'run':<24} {'layers':>6} {'params':>8} {'peak RSS':>9} {'MiB/layer':>9}")
        for r in big:
            bound = "  (the free disk's cap)" if r.get("disk_cap_layers") == r["layers"] else ""
            print(f"{r['run']:<24} {r['layers']:>6} {r['params'] / 1e9:>7.2f}B "
                  f"{r['peak'] / 2**30:>7.2f}GiB {r['bytes_per_layer'] / 2**20:>9.0f}"
                  f"{bound}")  # fmt: skip
        print(
            f"fxstar over eager, parameters: {big[1]['params'] / big[0]['params']:.2f}x "
            "(target: at least 1.1x); with the disk tier "
            f"{big[2]['params'] / big[0]['params']:.2f}x (target: at least 3x)"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump({"args": vars(args), "rows": rows, "compiles": compiles, "largest": big},
                      file, indent=2)  # fmt: skip
    return 0


def child(what: str, argv: list[str] | None, weights: str, *extra: str,
          rss_limit: int | None = None) -> dict | None:  # fmt: skip
    """Run one row in a process of its own (its peak RSS is the row's). With `rss_limit`, a
    watchdog ends the process when its resident memory passes the limit (or the machine's
    available memory runs low): None then."""
    command = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]),
               "--child", what, "--weights", weights, *extra]  # fmt: skip
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(command, stdout=out, stderr=err, text=True)
        over = False
        while process.poll() is None:
            if rss_limit is not None and (
                _status_bytes(process.pid, "VmRSS") > rss_limit or _available() < 2**29
            ):
                process.kill()
                over = True
            time.sleep(0.05)
        out.seek(0)
        err.seek(0)
        if over or (rss_limit is not None and process.returncode == -9):
            return None
        if process.returncode != 0:
            raise SystemExit(f"{what} failed:\n{err.read()[-3000:]}")
        row = json.loads(out.read().strip().splitlines()[-1])
        if "refused" in row:
            print(f"  {what}: refused at compile: {row['refused'].splitlines()[0][:160]}",
                  flush=True)  # fmt: skip
            return None
        return row


def _status_bytes(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as file:
            for line in file:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except FileNotFoundError:
        pass
    return 0


def _available() -> int:
    with open("/proc/meminfo") as file:
        for line in file:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def largest(args: argparse.Namespace, argv: list[str]) -> list[dict]:
    """Part 3: per run, the deepest width-2048 GPT that trains within the memory limit."""
    with open("/proc/meminfo") as file:
        total = int(file.readline().split()[1]) * 1024
    limit = total - int(args.reserve * 2**30)
    shape = [
        "--width",
        str(LARGEST_WIDTH),
        "--heads",
        str(LARGEST_WIDTH // 128),
        "--batch-size",
        str(args.batch_size),
        "--seq-len",
        str(args.seq_len),
        "--device-memory",
        LARGEST_ARENA,
        "--steps",
        "2",
        "--host-memory",
        str(limit),
    ]  # fxstar refuses at compile what would not fit
    results = []
    for run in LARGEST:

        def at(layers: int, limit: int | None = limit, run: str = run) -> dict | None:
            try:
                row = child(run, [*argv, *shape, "--layers", str(layers)], "", rss_limit=limit)
            finally:  # a run the watchdog ended leaves its disk tier's files
                shutil.rmtree(os.path.join(args.disk_dir, DISK_STATE), ignore_errors=True)
            print(f"  {run}: {layers} layers -> "
                  + ("does not fit" if row is None else f"peak {row['peak'] / 2**30:.2f} GiB"),
                  flush=True)  # fmt: skip
            return row

        small, larger = at(2, None), at(4, None)
        per_layer = (larger["peak"] - small["peak"]) / 2
        depth = int((limit - small["peak"]) / per_layer) + 2
        cap = None
        if "disk" in run:  # the disk holds 12 bytes a parameter: it may bind before memory
            layer_params = (larger["params"] - small["params"]) / 2
            free = shutil.disk_usage(args.disk_dir).free - 2**30
            cap = int(free / DISK_BYTES_PER_PARAM / layer_params)
            depth = min(depth, cap)
            print(f"  {run}: {free / 2**30:.0f} GiB free under {args.disk_dir} hold "
                  f"{cap} layers' disk-tier state", flush=True)  # fmt: skip
        best = deepest(at, depth, cap)
        results.append(best | {"run": run, "limit": limit, "bytes_per_layer": per_layer,
                               "disk_cap_layers": cap})  # fmt: skip
    return results


def deepest(at, depth: int, cap: int | None, floor: int = 4) -> dict:
    """The deepest run that fits (`at(layers)`: its row, None when it does not fit), from a
    predicted `depth`: away from it in doubling steps (up to `cap`, down to `floor`) until
    one run fits and one does not, then halving between them. A small depth predicts a disk
    run's memory poorly (most of its state is on the disk), and each run of a multi-billion
    model takes minutes: few runs, none twice."""
    rows: dict[int, dict | None] = {}

    def fits_at(layers: int) -> bool:
        rows[layers] = at(layers)
        return rows[layers] is not None

    step = 1
    if fits_at(depth):
        fits, fails = depth, None
        while fails is None and (cap is None or fits < cap):
            layers = fits + step if cap is None else min(fits + step, cap)
            if fits_at(layers):
                fits, step = layers, 2 * step
            else:
                fails = layers
    else:
        fits, fails = None, depth
        while fits is None:
            layers = max(fails - step, floor)
            if fits_at(layers):
                fits = layers
            elif layers == floor:
                raise RuntimeError(f"no depth from {floor} layers up fits")
            else:
                fails, step = layers, 2 * step
    while fails is not None and fails - fits > 1:
        layers = (fits + fails) // 2
        if fits_at(layers):
            fits = layers
        else:
            fails = layers
    return rows[fits] | {"layers": fits}


if __name__ == "__main__":
    sys.exit(main())
