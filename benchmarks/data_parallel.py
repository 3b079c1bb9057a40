"""Data parallelism over chunk groups against torch FSDP2 (`fully_shard`), on spawned ranks.

One table, every row measured in the same run on the same global batch (each of N ranks takes
1/N of it) and the same GPT:

- `serial`: fxstar in one process on the whole batch (the baseline of the time column);
- `fxstar sharded`: N ranks, payloads sharded (ZeRO-3, `data_parallel_shard='params'`, the
  default with Adam): a rank holds its own chunks' homes, fetches the others from their owner
  by a broadcast at each load, and reduce-scatters each group's gradients during backward;
- `fxstar sharded mem_saving_comm`: the same, gradients reduced one chunk at a time (no
  group-sized buffer);
- `fxstar replicated`: every rank holds every payload and steps its own chunks
  (`data_parallel_shard='optimizer'`, ZeRO-Offload's layout);
- `fsdp2`: torch's `fully_shard` on every block and the root, torch AdamW.

Columns: step time (median of the timed steps, the slowest rank's), tokens/s over all ranks and
its ratio to serial, and the step time against FSDP2's at the same world; model-state bytes per
rank (fxstar: the chunk homes, gradient buffers and moments its rank allocated,
`ChunkLayout.host_bytes`; FSDP2: its local shards of parameters, gradients and the two
moments) and its ratio to the issue's target, the serial state / N plus one chunk group's
payload; the largest communication buffer (sharded: the most gradient staging held at once)
and the bytes a rank handed to or received from collectives per step, in parameter bytes
(ZeRO-3's schedule implies 3x: a gather in forward, one in backward, a reduce-scatter; fewer
where a fetched chunk stays resident). On a 2-core CPU the ranks share the cores, so tokens/s
does not scale with N here: the ratios say what the communication and bookkeeping cost, the
bytes are exact. FSDP2's communication column is what its schedule implies (3x), not measured.
`vs plan`: the measured bytes over what the layout and the access plan imply
(`planned_comm_bytes`, computed apart from the runtime's counters); the target is within 5%.

    python benchmarks/data_parallel.py
    python benchmarks/data_parallel.py --worlds 2,4 --layers 4 --width 256 --json dp.json
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
    time_vs_fsdp2: float | None
    state_bytes_per_rank: int
    state_vs_target: float | None  # state / (serial state / N + one group's payload)
    comm_buffer_bytes: int
    comm_bytes_per_step: int
    comm_vs_params: float  # comm bytes per step / parameter bytes
    comm_vs_plan: float | None  # comm bytes per step / what the access plan implies


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


def planned_comm_bytes(engine: fxstar.Engine) -> int:
    """The bytes a rank hands to or takes from collectives in one training step, from the
    layout and the access plan alone (not the runtime's counters).

    Sharded: every load is an all-gather of a chunk's whole group (with mem_saving_comm, a
    broadcast of the chunk's payload); the loads are what a Belady cache of the plan's share
    at each access makes (benchmarks/chunks.py's simulator; a group with a trainable chunk
    changes at each step, so its first access misses; a frozen one stays). The chunks kept
    on the compute tier are left out: their owners broadcast them once after the step. Each
    unit of gradients (a group, or a chunk with mem_saving_comm) is reduced once.

    Replicated: each group's gradients reduce-scattered (its N chunks) and its updated fp32
    parameters all-gathered (one chunk a rank); with mem_saving_comm, one reduce and one
    broadcast per chunk. Both: the gradients of parameters outside the chunks averaged. A
    torch optimizer steps every parameter on every rank: all gradients averaged."""
    from chunks import belady_bytes

    from fxstar.runtime.optim import HybridAdam

    manager = engine.chunks
    groups, layout = manager.data_parallel, manager.layout
    itemsize = layout.dtype.itemsize
    trainable = [c for c in layout.chunks if c.trainable]
    in_chunks = {id(p) for p in manager.stable.values()}
    grads = [p for p in engine.parameters() if p.requires_grad]
    if not isinstance(engine.optimizer, HybridAdam):  # every rank steps all: all averaged
        return sum(p.numel() * p.element_size() for p in grads)
    loose = sum(p.numel() * p.element_size() for p in grads if id(p) not in in_chunks)
    if groups.sharded:
        plan, unit = manager.residency.plan, manager.residency.load_unit
        kept = {c.id for c in manager.chunks if c.kept}
        block = unit * layout.chunk_bytes  # what one load takes on the compute tier
        capacity = [manager.share(t) // block for t in range(len(plan))]
        # a load is a broadcast of one chunk's used bytes, or an all-gather of a whole group
        weight = {c.id // unit: c.used * itemsize if unit == 1 else block for c in layout.chunks}
        steps = [t for t, c in enumerate(plan.chunks) if c not in kept]
        changed = {c.id // unit for c in trainable}  # a group changes with any member
        loads = belady_bytes([plan.chunks[t] // unit for t in steps],
                             [capacity[t] for t in steps], weight,
                             [g for g in weight if g not in changed],
                             [{c // unit for c in plan.in_use[t]} for t in steps])  # fmt: skip
        per_unit = 1 if groups.mem_saving else groups.size
        units = {c.id // per_unit for c in trainable}
        kept_bytes = sum(c.used * itemsize for c in layout.chunks if c.id in kept)
        return loads + kept_bytes + len(units) * per_unit * layout.chunk_bytes + loose
    rooms = [[c for c in g if c.trainable] for g in groups.groups(layout.chunks)]
    rooms = [g for g in rooms if g]
    if groups.mem_saving:
        return sum(c.used * (itemsize + 4) for g in rooms for c in g) + loose
    return len(rooms) * layout.chunk_size * (groups.size * itemsize + 4) + loose


def _fxstar(rank: int, world: int, args: argparse.Namespace, shard: str, mem_saving: bool
            ) -> dict:  # fmt: skip
    model = _model(args)
    plan = fxstar.Plan(device_memory=args.device_memory, mem_saving_comm=mem_saving,
                       prefetch=args.prefetch,
                       data_parallel_shard=shard,
                       optimizer={"type": "adamw", "lr": 1e-3})  # fmt: skip
    per_rank = args.batch_size // world
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    batches = [(i[rows], t[rows]) for i, t in _batches(args, args.batch_size)]
    engine = fxstar.compile(model, plan, example_inputs=batches[0])
    groups = engine.chunks.data_parallel
    sent = [0]

    def step(ids, targets):
        engine(ids, targets).backward()
        engine.step()
        if groups is not None:
            sent.append(groups.bytes_sent + groups.bytes_fetched)

    seconds = _timed(args, step, batches)
    layout = engine.chunks.layout
    state = layout.host_bytes(masters=False, own_grads=True, moments=True,
                              rank=rank if groups is not None else 0,
                              sharded=groups is not None and groups.sharded)  # fmt: skip
    per_step = [b - a for a, b in zip(sent, sent[1:], strict=False)][args.warmup :]
    return {
        "seconds": seconds, "state": state, "params": layout.param_bytes,
        "group": layout.ranks * layout.chunk_bytes,
        "buffer": max(groups.peak_buffer_bytes, groups.peak_staging_bytes)
        if groups is not None else 0,
        "comm": int(statistics.median(per_step)) if groups is not None else 0,
        "planned": planned_comm_bytes(engine) if groups is not None else 0,
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
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    # p, grad, 2 moments; its schedule gathers in forward and backward and reduce-scatters
    return {"seconds": seconds, "state": local * 4, "buffer": 0, "comm": 3 * full,
            "params": full}  # fmt: skip


RUNS = {  # name: (data_parallel_shard, mem_saving_comm)
    "fxstar sharded": ("params", False),
    "fxstar sharded mem_saving_comm": ("params", True),
    "fxstar replicated": ("optimizer", False),
}


def _worker(rank: int, world: int, args: argparse.Namespace) -> dict:
    out = {run: _fxstar(rank, world, args, *how) for run, how in RUNS.items()}
    out["fsdp2"] = _fsdp2(rank, world, args)
    return out


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
    parser.add_argument("--prefetch", default="auto", choices=("auto", "on", "off"),
                        help="plan.prefetch of the fxstar runs")  # fmt: skip
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()

    torch.set_num_threads(1)  # as each spawned rank runs
    serial = _fxstar(0, 1, args, "auto", mem_saving=False)
    tokens = args.batch_size * args.seq_len
    rows = [Row("serial", 1, serial["seconds"] * 1e3, tokens / serial["seconds"], 1.0, None,
                serial["state"], None, 0, 0, 0.0, None)]  # fmt: skip
    for world in (int(w) for w in args.worlds.split(",")):
        if args.batch_size % world:
            raise SystemExit(f"--batch-size {args.batch_size} does not split over {world} ranks")
        results = spawn(_worker, world, args)
        fsdp2 = max(r["fsdp2"]["seconds"] for r in results)
        for run in results[0]:
            seconds = max(r[run]["seconds"] for r in results)  # the slowest rank sets the pace
            state = max(r[run]["state"] for r in results)
            first = results[0][run]
            target = serial["state"] / world + first.get("group", 0)
            comm = max(r[run]["comm"] for r in results)
            planned = max(r[run].get("planned", 0) for r in results)
            rows.append(Row(
                run, world, seconds * 1e3, tokens / seconds, serial["seconds"] / seconds,
                seconds / fsdp2, state, state / target if run != "fsdp2" else None,
                max(r[run]["buffer"] for r in results), comm, comm / first["params"],
                comm / planned if planned else None,
            ))  # fmt: skip
    header = (f"{'run':<32}{'world':>6}{'step ms':>9}{'tokens/s':>10}{'vs serial':>10}"
              f"{'vs fsdp2':>9}{'state/rank':>12}{'vs target':>10}{'comm buffer':>12}"
              f"{'comm/step':>12}{'x params':>9}{'vs plan':>8}")  # fmt: skip
    print(header)
    for r in rows:
        vs_fsdp2 = f"{r.time_vs_fsdp2:.2f}x" if r.time_vs_fsdp2 is not None else "-"
        vs_target = f"{r.state_vs_target:.2f}x" if r.state_vs_target is not None else "-"
        vs_plan = f"{r.comm_vs_plan:.3f}x" if r.comm_vs_plan is not None else "-"
        print(f"{r.run:<32}{r.world:>6}{r.step_ms:>9.1f}{r.tokens_per_s:>10,.0f}"
              f"{r.tokens_ratio:>9.2f}x{vs_fsdp2:>9}{r.state_bytes_per_rank:>12,}{vs_target:>10}"
              f"{r.comm_buffer_bytes:>12,}{r.comm_bytes_per_step:>12,}"
              f"{r.comm_vs_params:>8.2f}x"
              f"{vs_plan:>8}")  # fmt: skip
    off = [r for r in rows if r.comm_vs_plan is not None and abs(r.comm_vs_plan - 1) > 0.05]
    print(
        ("MISS" if off else "PASS") + ": bytes through collectives within 5% of what the "
        "access plan implies" + (f" (off: {', '.join(r.run for r in off)})" if off else "")
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": [asdict(r) for r in rows]}, f, indent=2)


if __name__ == "__main__":
    main()
