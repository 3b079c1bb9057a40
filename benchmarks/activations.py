"""Activation passes on the benchmark GPT, as ratios to the plain compiled engine in one run.

GPT: vocabulary 8192, d=512, 12 layers, sequence 256, batch 4 (fp32, dropout 0). Rows: none,
checkpoint='blocks', + offload_activations, + cpu_embedding, + tiled_linear 2x2,
checkpoint='auto' at a budget of half the plain peak, and torch.compile's min-cut partitioner
at `activation_memory_budget=0.5` where inductor runs on this CPU.

Columns: peak activation bytes on the compute tier (every tensor allocated during one
forward+backward and alive at once, parameter gradients excluded; host-tier copies are not
compute tier), saved-for-backward bytes at the end of forward (saved_tensors_hooks, one count
per storage, parameters excluded) and of the blocks alone, step time (median forward+backward),
and the largest non-embedding weight (what a chunk must at least hold; the minimal feasible
device_memory needs the chunk engine). Targets: checkpoint cuts block activations >= 4x for
<= 1.4x step time; auto lands within 10% of its budget.

    python benchmarks/activations.py
    python benchmarks/activations.py --layers 4 --steps 2 --json activations.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch

import fxstar
from fxstar.models.gpt import GPT, GPTConfig
from fxstar.sizes import format_size
from fxstar.testing.live_bytes import step_peak

TARGET_BLOCK_CUT, TARGET_STEP, TARGET_AUTO = 4.0, 1.4, 0.10


@dataclass
class Row:
    name: str
    peak_bytes: int | None = None
    saved_bytes: int | None = None
    block_saved_bytes: int | None = None
    step_ms: float | None = None
    step_ratio: float | None = None
    largest_weight: int | None = None
    min_device_memory: int | None = None
    note: str = ""


def make(args: argparse.Namespace) -> tuple[GPT, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq_len, n_layer=args.layers,
                    n_head=args.heads, n_embd=args.width, dropout=0.0)  # fmt: skip
    idx = torch.randint(0, cfg.vocab_size, (args.batch_size, cfg.block_size))
    targets = torch.randint(0, cfg.vocab_size, (args.batch_size, cfg.block_size))
    return GPT(cfg), (idx, targets)


def step(fn, model, inputs) -> None:
    model.zero_grad(set_to_none=True)
    fn(*inputs).backward()


def peak_bytes(fn, model, inputs) -> int:
    model.zero_grad(set_to_none=True)
    return step_peak(fn, _trained(fn, model), inputs)


def _trained(fn, model):
    return list(fn.parameters()) if isinstance(fn, fxstar.Engine) else list(model.parameters())


def saved_bytes(fn, model, inputs) -> tuple[int, dict[str, int]]:
    """Saved-for-backward bytes at the end of forward, in total and per block ('h.3')."""
    params = {p.untyped_storage().data_ptr() for p in _trained(fn, model)}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn(*inputs)
    del loss
    return sum(seen.values()), {}


def block_saved(engine: fxstar.Engine) -> int:
    """Saved bytes of the blocks in the rewritten graph's run (shape_memory re-run on it)."""
    from fxstar.passes.shape_memory import ShapeMemory

    program = engine.program
    keep = program.decisions.shape_memory
    ShapeMemory()(program)
    report = program.decisions.shape_memory
    if keep is not None:
        program.decisions.shape_memory = keep
    return sum(m.saved_bytes for b, m in report.blocks.items() if b.startswith("h."))


def largest_weight(engine: fxstar.Engine) -> int:
    return max(
        p.numel * p.dtype.itemsize
        for p in engine.program.params
        if len(p.shape) == 2 and "wte" not in p.name and "wpe" not in p.name
    )


def min_device_memory(plan: fxstar.Plan, args) -> int:
    """The smallest budget the chunk passes accept for this plan, roughly: activations and
    temporaries at their peak plus two chunks of the largest parameter left in the chunks."""
    from fxstar.passes.chunk_layout import nonmodel_peak

    model, inputs = make(args)  # a fresh model: the chunk engine takes its parameters over
    roomy = plan.replace(device_memory="1000%", passes=[*plan.passes, "shape_memory"])
    program = fxstar.compile(model, roomy, example_inputs=inputs).program
    largest = max(p.nbytes for p in program.params if not p.host_resident)
    return nonmodel_peak(program) + 2 * largest


def timed_rounds(runs: list[tuple[Row, object]], model, inputs, steps: int) -> None:
    """Step times, one step of every row per round, so a busy machine slows all alike; the
    step time is the median, the ratio the median of same-round ratios to the first row."""
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(steps):
        for k, (_, fn) in enumerate(runs):
            start = time.perf_counter()
            step(fn, model, inputs)
            times[k].append(time.perf_counter() - start)
    for (row, _), ts in zip(runs, times):
        row.step_ms = statistics.median(ts) * 1e3
        row.step_ratio = statistics.median(t / b for t, b in zip(ts, times[0]))


def engine_row(name: str, plan: fxstar.Plan, model, inputs, args) -> tuple[Row, fxstar.Engine]:
    engine = fxstar.compile(model, plan, example_inputs=inputs)
    row = Row(name)
    step(engine, model, inputs)  # warm-up
    row.peak_bytes = peak_bytes(engine, model, inputs)
    row.saved_bytes, _ = saved_bytes(engine, model, inputs)
    row.block_saved_bytes = block_saved(engine)
    row.largest_weight = largest_weight(engine)
    row.min_device_memory = min_device_memory(plan, args)
    decision = engine.program.decisions.checkpoint_regions
    if decision is not None and decision.mode == "auto":
        row.note = decision.summary()
    offload = engine.program.decisions.offload_activations
    if offload is not None:
        offload.reset_stats()
        step(engine, model, inputs)
        row.note = offload.report()
    return row, engine


def compiled_row(model, inputs, args, budget: float) -> tuple[Row, object]:
    """torch.compile (inductor) with the min-cut partitioner's activation memory budget."""
    import torch._functorch.config as functorch_config

    row = Row(f"torch.compile budget={budget}")
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(
                functorch_config.patch(activation_memory_budget=budget)
            )  # fmt: skip
            torch._dynamo.reset()
            compiled = torch.compile(model)
            start = time.perf_counter()
            step(compiled, model, inputs)
            row.note = f"compiled in {time.perf_counter() - start:.0f}s"
            row.saved_bytes, _ = saved_bytes(compiled, model, inputs)
    except Exception as error:  # report why, keep the table
        row.note = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:120]}"
        compiled = None
    return row, compiled


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per row")
    parser.add_argument("--no-torch-compile", action="store_true")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    model, inputs = make(args)
    print(f"GPT vocab {args.vocab}, d={args.width}, {args.layers} layers, seq {args.seq_len}, "
          f"batch {args.batch_size}; torch {torch.__version__}, {torch.get_num_threads()} "
          "threads")  # fmt: skip

    runs = []
    plain = engine_row("none", fxstar.Plan(), model, inputs, args)
    runs.append(plain)
    ckpt = fxstar.Plan(checkpoint="blocks")
    runs.append(engine_row("checkpoint", ckpt, model, inputs, args))
    offload = ckpt.replace(offload_activations=True)
    runs.append(engine_row("checkpoint+offload", offload, model, inputs, args))
    embedding = offload.replace(cpu_embedding=True)
    runs.append(engine_row("+cpu_embedding", embedding, model, inputs, args))
    tiled = embedding.replace(tiled_linear={"in_splits": 2, "out_splits": 2})
    runs.append(engine_row("+tiled_linear 2x2", tiled, model, inputs, args))
    budget = plain[0].peak_bytes // 2
    auto = fxstar.Plan(checkpoint="auto", activation_memory=budget)
    runs.append(engine_row(f"auto @ {format_size(budget)}", auto, model, inputs, args))
    if not args.no_torch_compile:
        row, compiled = compiled_row(model, inputs, args, 0.5)
        runs.append((row, compiled) if compiled is not None else (row, None))
    timed_rounds([(r, fn) for r, fn in runs if fn is not None], model, inputs, args.steps)
    rows = [r for r, _ in runs]
    plain, auto_row = rows[0], rows[5]
    print("min budget: the smallest device_memory the chunk passes accept for the row's plan")
    print("(activations at their peak + two chunks of the largest parameter left in chunks);")
    print("this GPT ties its lm head to the embedding, so cpu_embedding moves only wpe.")

    def ratio(value, base):
        return "-" if value is None or not base else f"{value / base:.2f}x"

    header = (f"{'row':<26} {'peak act':>10} {'ratio':>6} {'saved':>10} {'ratio':>6} "
              f"{'blocks saved':>12} {'ratio':>6} {'step ms':>8} {'ratio':>6} "
              f"{'largest W':>10} {'min budget':>10}")  # fmt: skip
    print(header)
    print("-" * len(header))
    for r in rows:
        size = lambda v: "-" if v is None else format_size(v)  # noqa: E731
        print(f"{r.name:<26} {size(r.peak_bytes):>10} {ratio(r.peak_bytes, plain.peak_bytes):>6} "
              f"{size(r.saved_bytes):>10} {ratio(r.saved_bytes, plain.saved_bytes):>6} "
              f"{size(r.block_saved_bytes):>12} "
              f"{ratio(r.block_saved_bytes, plain.block_saved_bytes):>6} "
              f"{'-' if r.step_ms is None else f'{r.step_ms:.0f}':>8} "
              f"{'-' if r.step_ratio is None else f'{r.step_ratio:.2f}x':>6} "
              f"{size(r.largest_weight):>10} {size(r.min_device_memory):>10}")  # fmt: skip
        if r.note:
            print(f"  {r.note}")
    ck = rows[1]
    cut = plain.block_saved_bytes / max(ck.block_saved_bytes, 1)
    slow = ck.step_ratio
    miss = abs(auto_row.peak_bytes - budget) / budget
    print(f"{'PASS' if cut >= TARGET_BLOCK_CUT and slow <= TARGET_STEP else 'MISS'} checkpoint: "
          f"block activations {cut:.1f}x smaller, step {slow:.2f}x")  # fmt: skip
    got, want = format_size(auto_row.peak_bytes), format_size(budget)
    verdict = "PASS" if miss <= TARGET_AUTO else "MISS"
    print(f"{verdict} auto: peak {got} vs budget {want} ({miss:.0%} off)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump({"args": vars(args), "rows": [asdict(r) for r in rows]}, file, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
