"""Compile cost and run-time overhead of fxstar on the reference GPT, against torch in the same run.

1. Depth: capture and the chunk plan's passes (device_memory='auto', scale.py's `compiled`) of
   meta-built GPTs of 10, 40 and 80 layers, one compile of each depth per round so a busy
   machine slows all alike: torch.export's time, fxstar's capture bookkeeping, the passes,
   and per round the passes over export (target <= 0.5x) and each depth's total over the
   previous depth's (target: at most 1.1x the depth ratio, 2.2x from 40 to 80 layers). In
   CPU seconds of the process by default (--clock wall for the wall clock): on a shared
   machine the wall clock times the neighbours too.
2. Rewrites and step: for 6, 12 and 24 layers of a host GPT, the time fxstar adds to
   `torch.export` with the analysis, checkpointing and tiling rewrites (target <= 0.5x), and
   the forward+backward step time of the compiled engine against eager PyTorch (<= 1.03x).

    python benchmarks/compile.py
    python benchmarks/compile.py --depths 10,40,80 --rounds 3 --layers "" --json compile.json
    python benchmarks/compile.py --depths "" --layers 6
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch
from scale import make_gpt_inputs, meta_gpt, warm_up

import fxstar
from fxstar.models.gpt import GPT, GPTConfig

TARGET_PASS_RATIO, TARGET_STEP_RATIO = 0.5, 1.03
TARGET_GROWTH = 1.1  # a depth's compile over the previous depth's, per unit of depth ratio


@dataclass
class DepthRow:
    layers: int
    parameters: int
    graph_nodes: int
    chunks: int
    export_s: float  # medians over rounds
    capture_s: float  # capture beyond its torch.export
    passes_s: float
    total_s: float
    pass_ratio: tuple[float, float, float]  # passes / export: min, median, max over rounds
    growth: tuple[float, float, float] | None  # total / the previous depth's total, per round


def spread(values: list[float]) -> tuple[float, float, float]:
    return min(values), statistics.median(values), max(values)


# CPU seconds of this process by default: compile is single-threaded Python, and on a shared
# machine the wall clock measures the neighbours as much as the code
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


@contextlib.contextmanager
def timed_export(clock, spent: list[float]):
    """torch.export.export timed on `clock` (Program.timings has the wall clock only)."""
    export = torch.export.export

    def timed(*args, **kwargs):
        start = clock()
        try:
            return export(*args, **kwargs)
        finally:
            spent.append(clock() - start)

    torch.export.export = timed
    try:
        yield
    finally:
        torch.export.export = export


def one_compile(layers: int, args: argparse.Namespace) -> tuple[dict, dict]:
    """scale.py's `compiled` (capture, then the passes of Plan(device_memory='auto')) of a
    meta GPT, its halves timed apart; (seconds, facts)."""
    from fxstar.capture import capture
    from fxstar.passes import PassManager, passes_for

    clock, spent = CLOCKS[args.clock], []
    model = meta_gpt(args, args.width, layers)
    plan = fxstar.Plan(device_memory="auto")
    inputs = make_gpt_inputs(args)
    gc.collect()
    with timed_export(clock, spent):
        start = clock()
        program = capture(model, inputs, plan=plan)
        gc.collect()  # the capture's garbage, counted as its own, not left to the passes
        captured = clock()
        program = PassManager(passes_for(plan)).run(program)
        end = clock()
    seconds = {"export": spent[0], "capture": captured - start - spent[0],
               "passes": end - captured, "total": end - start}  # fmt: skip
    facts = {"parameters": sum(p.numel() for p in set(model.parameters())),
             "graph_nodes": len(program.graph_module.graph.nodes),
             "chunks": len(program.decisions.chunk_layout.chunks)}  # fmt: skip
    return seconds, facts


def depth_rows(args: argparse.Namespace) -> list[DepthRow]:
    """Rounds of one compile per depth; the ratios are taken within a round."""
    depths = [int(x) for x in args.depths.split(",")]
    warm_up(args)
    runs: dict[int, list[dict]] = {d: [] for d in depths}
    facts = {}
    for _ in range(args.rounds):
        for layers in depths:
            seconds, facts[layers] = one_compile(layers, args)
            runs[layers].append(seconds)
    rows = []
    for k, layers in enumerate(depths):
        rs = runs[layers]
        growth = None
        if k > 0:
            before = runs[depths[k - 1]]
            growth = spread([r["total"] / b["total"] for r, b in zip(rs, before)])
        rows.append(DepthRow(
            layers, **facts[layers],
            export_s=statistics.median(r["export"] for r in rs),
            capture_s=statistics.median(r["capture"] for r in rs),
            passes_s=statistics.median(r["passes"] for r in rs),
            total_s=statistics.median(r["total"] for r in rs),
            pass_ratio=spread([r["passes"] / r["export"] for r in rs]), growth=growth,
        ))  # fmt: skip
    return rows


def print_depths(rows: list[DepthRow], args: argparse.Namespace) -> list[str]:
    print(f"1. meta GPT, width {args.width}, batch {args.batch_size} x {args.seq_len}, "
          "device_memory='auto': capture and the chunk plan's passes, "
          f"{args.rounds} rounds, {args.clock} seconds")  # fmt: skip
    columns = ("layers", "params", "nodes", "chunks", "export s", "capture s", "passes s",
               "total s", "passes/export", "total/previous")  # fmt: skip
    widths = (6, 8, 6, 6, 9, 9, 8, 8, 20, 20)
    header = " ".join(f"{c:>{w}}" for c, w in zip(columns, widths))
    print(header)
    print("-" * len(header))

    def three(v):
        return "" if v is None else f"{v[0]:.2f}/{v[1]:.2f}/{v[2]:.2f}x"

    for r in rows:
        cells = (f"{r.layers}", f"{r.parameters / 1e6:.1f}M", f"{r.graph_nodes}", f"{r.chunks}",
                 f"{r.export_s:.2f}", f"{r.capture_s:.2f}", f"{r.passes_s:.2f}",
                 f"{r.total_s:.2f}", three(r.pass_ratio), three(r.growth))  # fmt: skip
        print(" ".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
    print("export s: torch.export inside the capture; capture s: the capture's bookkeeping")
    print("beyond it (and collecting its garbage); passes s: every pass; seconds are medians,")
    print("ratios min/median/max of same-round ratios. Targets: passes <= 0.5x export; a")
    print(f"depth's total at most {TARGET_GROWTH}x the depth ratio times the previous depth's.")
    verdicts = []
    for k, r in enumerate(rows):
        ok = r.pass_ratio[1] <= TARGET_PASS_RATIO
        text = f"{r.layers} layers: passes {r.pass_ratio[1]:.2f}x export"
        if r.growth is not None:
            limit = TARGET_GROWTH * r.layers / rows[k - 1].layers
            ok = ok and r.growth[1] <= limit
            text += f", {r.growth[1]:.2f}x {rows[k - 1].layers} layers' time (<= {limit:.2f}x)"
        verdicts.append(f"{'PASS' if ok else 'MISS'} {text}")
        print(verdicts[-1])
    return verdicts


@dataclass
class Row:
    layers: int
    parameters: int
    graph_nodes: int
    first_compile_s: float
    export_s: float
    fxstar_extra_s: float
    pass_ratio: float
    eager_step_ms: float
    engine_step_ms: float
    step_ratio: float


def make(layers: int, args: argparse.Namespace) -> tuple[GPT, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq_len, n_layer=layers,
                    n_head=args.heads, n_embd=args.width, dropout=0.0)  # fmt: skip
    idx = torch.randint(0, cfg.vocab_size, (args.batch_size, cfg.block_size))
    targets = torch.randint(0, cfg.vocab_size, (args.batch_size, cfg.block_size))
    return GPT(cfg), (idx, targets)


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def step(fn, model, inputs) -> None:
    """Forward and backward from empty gradients, so both sides allocate them alike."""
    model.zero_grad(set_to_none=True)
    fn(*inputs).backward()


# The built-in passes that run together on one process: the analysis, checkpointing and
# tiling rewrites. (The chunk passes do not combine with checkpoint yet, and tensor parallel
# needs a process group; benchmarks/chunks.py and tp.py time those.)
PASSES = {"passes": ["shape_memory"], "checkpoint": "blocks",
          "tiled_linear": {"in_splits": 2, "out_splits": 2}}  # fmt: skip


def bench(layers: int, args: argparse.Namespace) -> Row:
    model, inputs = make(layers, args)
    plan = fxstar.Plan(**PASSES)
    start = time.perf_counter()
    fxstar.compile(model, plan, example_inputs=inputs)  # the first in a process warms torch up
    first = time.perf_counter() - start
    export_times, extra = [], []
    engine = None
    for _ in range(args.repeats):
        # The export inside fxstar.compile is timed there (Program.timings), so the ratio
        # compares the two parts of one compile, not two runs that drift apart.
        start = time.perf_counter()
        engine = fxstar.compile(model, plan, example_inputs=inputs)
        total = time.perf_counter() - start
        export_times.append(engine.program.timings["export"])
        extra.append(total - export_times[-1])

    engine = fxstar.compile(model, fxstar.Plan(), example_inputs=inputs)  # the step: no rewrites
    for _ in range(2):  # warm-up
        step(model, model, inputs)
        step(engine, model, inputs)
    eager, compiled = [], []
    for _ in range(args.steps):
        eager.append(seconds(lambda: step(model, model, inputs)))  # noqa: B023
        compiled.append(seconds(lambda: step(engine, model, inputs)))  # noqa: B023
    ratios = [c / e for c, e in zip(compiled, eager)]
    return Row(
        layers=layers,
        parameters=sum(p.numel() for p in model.parameters()),
        graph_nodes=len(engine.program.graph_module.graph.nodes),  # the plain capture
        first_compile_s=first,
        export_s=statistics.median(export_times),
        fxstar_extra_s=statistics.median(extra),
        pass_ratio=statistics.median(e / x for e, x in zip(extra, export_times)),
        eager_step_ms=statistics.median(eager) * 1e3,
        engine_step_ms=statistics.median(compiled) * 1e3,
        step_ratio=statistics.median(ratios),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", default="10,40,80",
                        help="part 1's layer counts ('' to skip)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3, help="part 1's compiles per depth")
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="cpu",
                        help="part 1's seconds: the process's CPU time, or wall")  # fmt: skip
    parser.add_argument("--layers", default="6,12,24", help="part 2's layer counts ('' to skip)")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="compiles per size")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per size")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)

    depths, verdicts = [], []
    if args.depths:
        depths = depth_rows(args)
        verdicts += print_depths(depths, args)
    rows = []
    if args.layers:
        if depths:
            print()
        rows, more = step_rows(args)
        verdicts += more
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "compile", "depths": [asdict(r) for r in depths],
                       "rows": [asdict(r) for r in rows], "targets": verdicts,
                       "config": vars(args)}, f, indent=2)  # fmt: skip
    return 0


def step_rows(args: argparse.Namespace) -> tuple[list[Row], list[str]]:
    names = fxstar.compile(make(1, args)[0], fxstar.Plan(**PASSES)).pass_manager.names
    print(f"2. host GPT, passes: {', '.join(names)}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    columns = ("layers", "params", "nodes", "first s", "export s", "fxstar s", "ratio",
               "eager ms", "engine ms", "ratio")  # fmt: skip
    widths = (6, 8, 6, 8, 9, 9, 6, 9, 10, 6)
    header = " ".join(f"{c:>{w}}" for c, w in zip(columns, widths))
    print(header)
    print("-" * len(header))
    rows = []
    for layers in (int(x) for x in args.layers.split(",")):
        r = bench(layers, args)
        rows.append(r)
        cells = (f"{r.layers}", f"{r.parameters / 1e6:.1f}M", f"{r.graph_nodes}",
                 f"{r.first_compile_s:.2f}", f"{r.export_s:.2f}", f"{r.fxstar_extra_s:.2f}",
                 f"{r.pass_ratio:.2f}x", f"{r.eager_step_ms:.1f}", f"{r.engine_step_ms:.1f}",
                 f"{r.step_ratio:.3f}x")  # fmt: skip
        print(" ".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
    print("fxstar s: compile time beyond its torch.export (capture bookkeeping, graph printing,")
    print("passes); export s: the torch.export call inside the same compile. Ratios are")
    print("medians of same-round ratios; first s: the first compile of the size, torch warming")
    print("up included. Targets: passes <= 0.5x export, step <= 1.03x eager.")
    verdicts = []
    for r in rows:
        ok = r.pass_ratio <= TARGET_PASS_RATIO and r.step_ratio <= TARGET_STEP_RATIO
        verdicts.append(f"{'PASS' if ok else 'MISS'} {r.layers} layers: passes {r.pass_ratio:.2f}x "
                        f"export, step {r.step_ratio:.3f}x eager")  # fmt: skip
        print(verdicts[-1])
    return rows, verdicts


if __name__ == "__main__":
    raise SystemExit(main())
