"""Per-rank random streams for tensor parallelism (Megatron's RNG tracker), for graph nodes.

Why: every rank's default generator holds the same state (the same seed, the same draws), which
is right where the ranks compute the same tensor (replicated activations) and wrong where each
rank holds different data: a dropout over heads split across ranks would drop the same
positions of rank 0's heads and rank 1's, so the run is not statistically a serial one. Here:

- inside a region split by heads or features (`rank_dropout`, `rank_attention`) the op draws
  from this rank's own stream: the default generator's state is swapped for the tracker's
  while it runs (any op, on CPU or CUDA, as Megatron's `fork`);
- on a sequence-parallel token block (`seq_dropout`) every rank draws every token's mask
  from the shared stream and keeps its block: the same masks as without sequence
  parallelism, at the price of drawing N times the block's numbers;
- everywhere else ops draw from the default generator unchanged: the same on every rank.

A tracker belongs to an engine's process group and is held by it (`RankGroup.stream`, which the
graph holds: no registry), its seed is rank 0's initial seed plus 2718 plus the rank
(Megatron's offset), and its state is saved with checkpoints (`fxstar/saving/rng.py`) and
replayed when a checkpointed region recomputes (`fxstar/runtime/recompute.py`), so a resume
is bit for bit and recomputed masks match.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from fxstar.runtime.rank_group import RankGroup, guard, process_group, process_group_for
from fxstar.runtime.rank_stream import RankStream
from fxstar.runtime.tp_ops import full_shape, own_tokens

__all__ = [
    "RankStream",
    "fork_all",
    "new_stream",
    "new_stream_needed",
    "rank_attention",
    "rank_dropout",
    "replaying",
    "seq_dropout",
    "snapshot",
    "stream",
    "streams_of",
]

SEED_OFFSET = 2718  # Megatron's model-parallel seed offset


def new_stream(group: RankGroup) -> RankStream:
    """The tracker of `group`, made once and held by it (collective: rank 0's initial seed is
    sent to every rank, so ranks seeded differently still get streams that differ only by
    rank)."""
    if group.stream is not None:
        return group.stream
    seed = torch.tensor([torch.initial_seed() % 2**62], dtype=torch.int64)
    pg = process_group_for(group, seed)
    with guard("broadcast of the RNG tracker's seed", group):
        dist.broadcast(seed, group=pg, group_src=0)
    group.stream = RankStream(int(seed.item()) + SEED_OFFSET + dist.get_rank(pg))
    return group.stream


def new_stream_needed(group: RankGroup) -> bool:
    """True until `new_stream(group)` ran: the same on every rank, so they call it together."""
    return group.stream is None


def stream(group: RankGroup | None) -> RankStream:
    """The tracker of the group a graph node names."""
    if group is None or group.stream is None:
        raise RuntimeError(
            "no RNG tracker for this graph's process group: compile the model again (the "
            "tensor_parallel pass makes it)"
        )
    return group.stream


def streams_of(module: torch.nn.Module) -> list[RankStream]:
    """The trackers of the process groups `module` (a graph, a region) holds."""
    return [m.stream for m in module.modules() if isinstance(m, RankGroup) and m.stream]


@contextlib.contextmanager
def fork_all(module: torch.nn.Module | None = None) -> Iterator[None]:
    """Every generator a run of `module` draws from (the default ones, CUDA's where it is
    initialized, and the rank streams of its groups) is as it was after the block: a run
    that measures or checks the graph leaves the training run's masks unchanged."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    streams = streams_of(module) if module is not None else []
    with torch.random.fork_rng(devices=devices), replaying(snapshot(streams)):
        yield


def snapshot(streams: list[RankStream]) -> list[tuple[RankStream, dict[str, Any]]]:
    """The trackers' states now (a checkpointed region's forward starts here)."""
    return [(s, s.state_dict()) for s in streams]


@contextlib.contextmanager
def replaying(states: list[tuple[RankStream, dict[str, Any]]]) -> Iterator[None]:
    """Run the block from the trackers' `states` (a region's recompute), then put them back
    where they were, so the streams go on as after the forward."""
    now = snapshot([s for s, _ in states])
    for s, state in states:
        s.load_state_dict(state)
    try:
        yield
    finally:
        for s, state in now:
            s.load_state_dict(state)


def rank_dropout(x: torch.Tensor, p: float, train: bool, *, group: RankGroup | None = None):
    """aten.dropout on a tensor split across ranks: this rank's own mask."""
    with stream(group).fork(x.device):
        return torch.ops.aten.dropout.default(x, p, train)


def rank_attention(*args: Any, group: RankGroup | None = None, **kwargs: Any) -> torch.Tensor:
    """aten.scaled_dot_product_attention (with dropout) over heads split across ranks."""
    with stream(group).fork(args[0].device):
        return torch.ops.aten.scaled_dot_product_attention.default(*args, **kwargs)


def seq_dropout(x: torch.Tensor, p: float, train: bool, *, group: RankGroup | None = None):
    """aten.dropout on this rank's token block (sequence parallel) with every token's mask
    from the shared stream: every rank draws it, each keeps its block. The mask is the one
    aten.dropout draws on the whole tensor (bernoulli_(1 - p) noise scaled by 1/(1 - p)), so
    the masks are those of a run without sequence parallelism."""
    if not train or p == 0:
        return x
    if p == 1:
        return x * 0
    pg = process_group(group)
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    noise = x.new_empty(full_shape(x.shape, world)).bernoulli_(1 - p).div_(1 - p)
    return x * own_tokens(noise, world, rank)
