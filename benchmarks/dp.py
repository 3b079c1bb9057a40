"""Data parallelism over chunk groups against torch FSDP2 (`fully_shard`), on spawned ranks.

One table, every row measured in the same run on the same global batch (each of N ranks takes
1/N of it) and the same GPT:

- `serial`: fxstar in one process on the whole batch (the baseline of the time column);
- `fxstar dp`: N ranks, chunks in groups of N, each rank's Adam state on its own chunks only,
  gradients reduce-scattered to the owners and updates all-gathered;
- `fxstar dp mem_saving_comm`: the same through N reduces and N broadcasts in place;
- `fsdp2`: torch's `fully_shard` on every block and the root, torch AdamW.

Columns: step time (median of the timed steps, the slowest rank's), tokens/s over all ranks and
its ratio to serial; model-state bytes per rank (fxstar: the chunk homes, gradient buffers and
moments the engine allocated for its rank, `ChunkLayout.host_bytes`; FSDP2: its local shards of
parameters, gradients and the two moments); the largest communication buffer and the bytes a
rank handed to collectives per step (its tensors' sizes, not what the ring moved). On a
2-core CPU the ranks share the cores, so tokens/s does not scale with N here: the ratios say
what the communication and bookkeeping cost, the bytes are exact.

    python benchmarks/dp.py
    python benchmarks/dp.py --worlds 2,4 --layers 4 --width 256 --json dp.json
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


@dataclass
class Row:
    run: str
    world: int
    step_ms: float
    tokens_per_s: float
    tokens_ratio: float
    state_bytes_per_rank: int
    comm_buffer_bytes: int
    sent_bytes_per_step: int


def _model(args: argparse.Namespace) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=args.vocab, block_size=args.seq_len, n_layer=args.layers,
                         n_head=args.heads, n_embd=args.width, dropout=0.0))  # fmt: skip


def _batches(args: argparse.Namespace, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    shape = (rows, args.seq_len)
    return [(torch.randint(0, args.vocab, shape, generator=g),
             torch.randint(0, args.vocab, shape, generator=g))
            for _ in range(args.warmup + args.steps)]  # fmt: skip


def _timed(args: argparse.Namespace, step, batches) -> float:
    """Median seconds of the timed steps (after the warm-up ones)."""
    times = []
    for i, batch in enumerate(batches):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        step(*batch)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _fxstar(rank: int, world: int, args: argparse.Namespace, mem_saving: bool) -> dict:
    model = _model(args)
    plan = fxstar.Plan(device_memory=args.device_memory, mem_saving_comm=mem_saving,
                       optimizer={"type": "adamw", "lr": 1e-3})  # fmt: skip
    per_rank = args.batch_size // world
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    batches = [(i[rows], t[rows]) for i, t in _batches(args, args.batch_size)]
    engine = fxstar.compile(model, plan, example_inputs=batches[0])

    def step(ids, targets):
        engine(ids, targets).backward()
        engine.step()

    seconds = _timed(args, step, batches)
    manager, groups = engine.chunks, engine.chunks.data_parallel
    state = manager.layout.host_bytes(masters=False, own_grads=True, moments=True,
                                      rank=rank if groups is not None else 0)  # fmt: skip
    steps = args.warmup + args.steps
    return {
        "seconds": seconds, "state": state,
        "buffer": groups.peak_buffer_bytes if groups is not None else 0,
        "sent": groups.bytes_sent // steps if groups is not None else 0,
    }  # fmt: skip


def _fsdp2(rank: int, world: int, args: argparse.Namespace) -> dict:
    from torch.distributed.fsdp import fully_shard

    model = _model(args)
    for block in model.h:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    per_rank = args.batch_size // world
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    batches = [(i[rows], t[rows]) for i, t in _batches(args, args.batch_size)]

    def step(ids, targets):
        model(ids, targets).backward()
        optimizer.step()
        optimizer.zero_grad()

    seconds = _timed(args, step, batches)
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    return {"seconds": seconds, "state": local * 4, "buffer": 0, "sent": 0}  # p, grad, 2 moments


def _worker(rank: int, world: int, args: argparse.Namespace) -> dict:
    return {
        "fxstar dp": _fxstar(rank, world, args, mem_saving=False),
        "fxstar dp mem_saving_comm": _fxstar(rank, world, args, mem_saving=True),
        "fsdp2": _fsdp2(rank, world, args),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="2", help="comma-separated world sizes")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8, help="global: split over ranks")
    parser.add_argument("--device-memory", default="auto")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()

    torch.set_num_threads(1)  # as each spawned rank runs
    serial = _fxstar(0, 1, args, mem_saving=False)
    tokens = args.batch_size * args.seq_len
    rows = [Row("serial", 1, serial["seconds"] * 1e3, tokens / serial["seconds"], 1.0,
                serial["state"], 0, 0)]  # fmt: skip
    for world in (int(w) for w in args.worlds.split(",")):
        if args.batch_size % world:
            raise SystemExit(f"--batch-size {args.batch_size} does not split over {world} ranks")
        results = spawn(_worker, world, args)
        for run in results[0]:
            seconds = max(r[run]["seconds"] for r in results)  # the slowest rank sets the pace
            rows.append(Row(
                run, world, seconds * 1e3, tokens / seconds, serial["seconds"] / seconds,
                max(r[run]["state"] for r in results), max(r[run]["buffer"] for r in results),
                max(r[run]["sent"] for r in results),
            ))  # fmt: skip
    header = (f"{'run':<28}{'world':>6}{'step ms':>10}{'tokens/s':>11}{'vs serial':>10}"
              f"{'state/rank':>13}{'comm buffer':>13}{'comm/step':>12}")  # fmt: skip
    print(header)
    for r in rows:
        print(f"{r.run:<28}{r.world:>6}{r.step_ms:>10.1f}{r.tokens_per_s:>11,.0f}"
              f"{r.tokens_ratio:>9.2f}x{r.state_bytes_per_rank:>13,}{r.comm_buffer_bytes:>13,}"
              f"{r.sent_bytes_per_step:>12,}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": [asdict(r) for r in rows]}, f, indent=2)


if __name__ == "__main__":
    main()
