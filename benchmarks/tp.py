"""Tensor-parallel linears: sync/async communication x keep/recompute the gathered input.

The table of nanotron PR #208 (theirs: tp4 Llama-8B on A100, async+recompute -16% memory,
+3% tokens/s), measured in one run: the reference GPT under sequence parallelism on N spawned
ranks (gloo on CPU by default), tokens/s of a forward+backward step and the peak bytes saved
for backward (saved-tensor hooks; parameters not counted), each against sync-keep. Modes are
timed in interleaved rounds, their order rotated each round, and the median kept. On a 2-core
CPU the two ranks share the cores and the all-gathers are cheap next to the matmuls, so the
time column moves by a few percent and with the machine's load; the memory column is exact.

    python benchmarks/tp.py
    python benchmarks/tp.py --world-size 2 --layers 4 --width 256 --json tp.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

import fxstar
from fxstar.dist_launch import spawn
from fxstar.models.gpt import GPT, GPTConfig

MODES = [("sync", "keep"), ("sync", "recompute"), ("async", "keep"), ("async", "recompute")]


@dataclass
class Row:
    communication: str
    gathered_input: str
    step_ms: float
    tokens_per_s: float
    tokens_ratio: float
    saved_bytes: int
    saved_ratio: float


def _engine(args: argparse.Namespace, world: int, mode: tuple[str, str]):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq_len, n_layer=args.layers,
                    n_head=args.heads, n_embd=args.width, dropout=0.0)  # fmt: skip
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (args.batch_size, cfg.block_size))
    targets = torch.randint(0, cfg.vocab_size, (args.batch_size, cfg.block_size))
    plan = fxstar.Plan(tensor_parallel={
        "size": world, "sequence_parallel": True, "async_communication": mode[0] == "async",
        "recompute_allgather": mode[1] == "recompute",
    }, mem_saving_comm=args.mem_saving_comm)  # fmt: skip
    return fxstar.compile(model, plan, (idx, targets)), (idx, targets)


def _saved_bytes(engine, inputs) -> int:
    """Bytes saved for backward at the end of forward (their peak), parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in engine.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = engine(*inputs)
    loss.backward()
    engine.zero_grad()
    return sum(saved.values())


def _step(engine, inputs) -> float:
    dist.barrier()
    start = time.perf_counter()
    engine(*inputs).backward()
    engine.zero_grad()
    dist.barrier()
    return time.perf_counter() - start


def _worker(rank: int, world: int, args: argparse.Namespace) -> dict | None:
    engines = {mode: _engine(args, world, mode) for mode in MODES}
    saved = {mode: _saved_bytes(*engines[mode]) for mode in MODES}
    for mode in MODES:  # warm up
        _step(*engines[mode])
    times: dict[tuple, list[float]] = {mode: [] for mode in MODES}
    for r in range(args.rounds):
        for mode in MODES[r % len(MODES) :] + MODES[: r % len(MODES)]:  # rotate: no position bias
            times[mode].append(min(_step(*engines[mode]) for _ in range(args.steps)))
    if rank != 0:
        return None
    return {"saved": saved, "step_s": {m: statistics.median(t) for m, t in times.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="steps per round (min kept)")
    parser.add_argument("--mem-saving-comm", action="store_true")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)

    result = spawn(_worker, args.world_size, args, backend=args.backend, threads=args.threads)[0]
    tokens = args.batch_size * args.seq_len
    base = ("sync", "keep")
    rows = []
    for mode in MODES:
        step = result["step_s"][mode]
        rows.append(Row(
            communication=mode[0], gathered_input=mode[1], step_ms=step * 1e3,
            tokens_per_s=tokens / step, tokens_ratio=result["step_s"][base] / step,
            saved_bytes=result["saved"][mode],
            saved_ratio=result["saved"][mode] / result["saved"][base],
        ))  # fmt: skip
    print(f"tp{args.world_size} ({args.backend}, {args.threads} thread/rank), sequence parallel, "
          f"GPT {args.layers}x{args.width}, batch {args.batch_size} x seq {args.seq_len}; "
          f"torch {torch.__version__}")  # fmt: skip
    header = f"{'comm':>6} {'input':>10} {'step ms':>9} {'tokens/s':>9} {'vs base':>8} " + (
        f"{'saved MiB':>10} {'vs base':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r.communication:>6} {r.gathered_input:>10} {r.step_ms:>9.1f} "
              f"{r.tokens_per_s:>9.0f} {r.tokens_ratio - 1:>+8.1%} "
              f"{r.saved_bytes / 2**20:>10.2f} {r.saved_ratio - 1:>+8.1%}")  # fmt: skip
    print("vs base: against sync-keep in the same run (tokens/s up is better, saved bytes down")
    print("is better). nanotron #208, tp4 Llama-8B on A100: async+recompute +3% tokens/s, -16%")
    print("memory.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "tp", "args": vars(args), "rows": [asdict(r) for r in rows]},
                      f, indent=2)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
