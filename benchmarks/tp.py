"""Tensor-parallel linears: sync/async communication x keep/recompute the gathered input.

The table of nanotron PR #208 (theirs: tp4 Llama-8B on A100, async+recompute -16% memory,
+3% tokens/s), measured in one run: the reference GPT under sequence parallelism on N spawned
ranks (gloo on CPU by default), tokens/s of a forward+backward step and the peak bytes saved
for backward (saved-tensor hooks; parameters not counted), each against sync-keep. Modes are
timed in interleaved rounds, their order rotated each round, and the median kept. On a 2-core
CPU the two ranks share the cores and the all-gathers are cheap next to the matmuls, so the
time column moves by a few percent and with the machine's load; the memory column is exact,
and so is the copied column (bytes written by copy ops outside the collectives in a step).

The second table: vocab-parallel embedding/head/cross-entropy on and off (a 'replicate' rule
on the head) for a GPT with a 32K vocabulary, at each of `--vocab-worlds`: tokens/s and the
peak bytes saved for backward, whose largest part without it is the logits (and their
softmax) of the whole vocabulary on every rank.

    python benchmarks/tp.py
    python benchmarks/tp.py --world-size 2 --layers 4 --width 256 --json tp.json
    python benchmarks/tp.py --rounds 0 --vocab-worlds 2,4   # the vocabulary table only
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
from fxstar.testing.copy_bytes import CopyBytes

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
    copied_bytes: int  # written by cat/stack/clone/copy_ in a step, outside the collectives


def _engine(args: argparse.Namespace, world: int, mode: tuple[str, str], vocab: int = 0,
            vocab_parallel: bool = True):  # fmt: skip
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=vocab or args.vocab, block_size=args.seq_len,
                    n_layer=args.layers, n_head=args.heads, n_embd=args.width,
                    dropout=0.0)  # fmt: skip
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (args.batch_size, cfg.block_size))
    targets = torch.randint(0, cfg.vocab_size, (args.batch_size, cfg.block_size))
    plan = fxstar.Plan(tensor_parallel={
        "size": world, "sequence_parallel": True, "async_communication": mode[0] == "async",
        "recompute_allgather": mode[1] == "recompute",
        "rules": {} if vocab_parallel else {"head": "replicate"},
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


def _copied_bytes(engine, inputs) -> int:
    """Bytes the step writes with copy ops outside the collectives (fxstar.copy_bytes): what
    layout changes around the collectives would cost; the model's own copies count too."""
    with CopyBytes() as log:
        engine(*inputs).backward()
    engine.zero_grad()
    return sum(nbytes for _, nbytes in log.copies)


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
    copied = {mode: _copied_bytes(*engines[mode]) for mode in MODES}
    for mode in MODES:  # warm up
        _step(*engines[mode])
    times: dict[tuple, list[float]] = {mode: [] for mode in MODES}
    for r in range(args.rounds):
        for mode in MODES[r % len(MODES) :] + MODES[: r % len(MODES)]:  # rotate: no position bias
            times[mode].append(min(_step(*engines[mode]) for _ in range(args.steps)))
    if rank != 0:
        return None
    step_s = {m: statistics.median(t) for m, t in times.items()}
    return {"saved": saved, "copied": copied, "step_s": step_s}


VOCAB_MODES = (True, False)  # vocab-parallel on, off


def _vocab_worker(rank: int, world: int, args: argparse.Namespace) -> dict | None:
    mode = ("sync", "keep")
    engines = {on: _engine(args, world, mode, args.big_vocab, on) for on in VOCAB_MODES}
    saved = {on: _saved_bytes(*engines[on]) for on in VOCAB_MODES}
    for on in VOCAB_MODES:
        _step(*engines[on])
    times: dict[bool, list[float]] = {on: [] for on in VOCAB_MODES}
    for r in range(args.vocab_rounds):
        for on in VOCAB_MODES if r % 2 == 0 else VOCAB_MODES[::-1]:
            times[on].append(min(_step(*engines[on]) for _ in range(args.steps)))
    if rank != 0:
        return None
    return {"saved": saved, "step_s": {on: statistics.median(t) for on, t in times.items()}}


@dataclass
class VocabRow:
    world: int
    vocab_parallel: bool
    step_ms: float
    tokens_per_s: float
    saved_bytes: int
    logits_bytes: int  # one rank's logits, fp32


def _vocab_table(args: argparse.Namespace) -> list[VocabRow]:
    rows = []
    tokens = args.batch_size * args.seq_len
    for world in args.vocab_worlds:
        result = spawn(_vocab_worker, world, args, backend=args.backend, threads=args.threads)[0]
        for on in VOCAB_MODES:
            step = result["step_s"][on]
            logits = tokens * args.big_vocab * 4 // (world if on else 1)
            rows.append(VocabRow(world, on, step * 1e3, tokens / step, result["saved"][on],
                                 logits))  # fmt: skip
    print(f"\nvocab-parallel, GPT {args.layers}x{args.width} vocab {args.big_vocab}, batch "
          f"{args.batch_size} x seq {args.seq_len}, sequence parallel, sync-keep")  # fmt: skip
    header = (f"{'world':>5} {'vocab-par':>9} {'step ms':>9} {'tokens/s':>9} {'saved MiB':>10} "
              f"{'logits MiB':>10} {'saved vs off':>12}")  # fmt: skip
    print(header)
    print("-" * len(header))
    for r in rows:
        off = next(o for o in rows if o.world == r.world and not o.vocab_parallel)
        saved_vs_off = r.saved_bytes / off.saved_bytes - 1
        print(f"{r.world:>5} {'on' if r.vocab_parallel else 'off':>9} {r.step_ms:>9.1f} "
              f"{r.tokens_per_s:>9.0f} {r.saved_bytes / 2**20:>10.2f} "
              f"{r.logits_bytes / 2**20:>10.2f} {saved_vs_off:>+12.1%}")  # fmt: skip
    return rows


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
    parser.add_argument("--big-vocab", type=int, default=32768, help="the vocabulary table's")
    parser.add_argument(
        "--vocab-worlds",
        type=lambda v: [int(w) for w in v.split(",") if w],
        default=[2, 4],
        help="world sizes of the vocabulary table ('' skips)",
    )
    parser.add_argument("--vocab-rounds", type=int, default=3)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)

    rows = _modes_table(args) if args.rounds else []
    vocab_rows = _vocab_table(args) if args.vocab_worlds else []
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "tp", "args": vars(args), "rows": [asdict(r) for r in rows],
                       "vocab_rows": [asdict(r) for r in vocab_rows]}, f, indent=2)  # fmt: skip
    return 0


def _modes_table(args: argparse.Namespace) -> list[Row]:
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
            copied_bytes=result["copied"][mode],
        ))  # fmt: skip
    print(f"tp{args.world_size} ({args.backend}, {args.threads} thread/rank), sequence parallel, "
          f"GPT {args.layers}x{args.width}, batch {args.batch_size} x seq {args.seq_len}; "
          f"torch {torch.__version__}")  # fmt: skip
    header = f"{'comm':>6} {'input':>10} {'step ms':>9} {'tokens/s':>9} {'vs base':>8} " + (
        f"{'saved MiB':>10} {'vs base':>8} {'copied MiB':>11}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r.communication:>6} {r.gathered_input:>10} {r.step_ms:>9.1f} "
              f"{r.tokens_per_s:>9.0f} {r.tokens_ratio - 1:>+8.1%} "
              f"{r.saved_bytes / 2**20:>10.2f} {r.saved_ratio - 1:>+8.1%} "
              f"{r.copied_bytes / 2**20:>11.2f}")  # fmt: skip
    print("vs base: against sync-keep in the same run (tokens/s up is better, saved bytes down")
    print("is better). nanotron #208, tp4 Llama-8B on A100: async+recompute +3% tokens/s, -16%")
    print("memory. copied: bytes a step writes with cat/stack/clone/copy_ outside the")
    print("collectives, per rank (the model's own split/cat backward included).")
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
