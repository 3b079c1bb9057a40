"""RankGroup: one of an engine's process groups (tensor-parallel, data-parallel or the whole
mesh: fxstar/topology.py) as an object, with what belongs to it: its timeout, the step check
of its collectives, this rank's RNG stream (`rng_tracker`) and the buffers recompute mode
re-gathers into. A tensor-parallel graph holds its group (a `get_attr` submodule, as
`ops.ChunkRuntime` for chunks). Why an object and not a registry: a graph that holds its
runtime can be dumped, copied and run next to another engine's without either reaching the
other's state, and nothing outlives the engine in module globals.

Under a 2-D mesh (fxstar/mesh.py) a group spans only some ranks: a group rank is then not a
global rank, so rooted collectives name their root by its group rank (torch's `group_src`,
`group_dst`).

Backends without host tensors (NCCL): each group has a gloo group of the same ranks made
beside it (`host_pg`, torchtitan's CPU side group), and a collective on host tensors or pickled
objects runs there (`process_group_for`, `host_process_group`): the rank agreement, the step
check, plan CRCs, the gradient norm's sums and the host tier's chunk traffic. Under gloo both
are one group.

Failures: an engine's group is made with `plan.dist_timeout`, so a rank that stopped (crashed,
skipped a step, diverged) makes the others raise a `CollectiveError` naming the collective
instead of waiting out gloo's 30 minutes (`guard`). Before each collective `guard` checks that
every rank is at the same one (`runtime/step_check.py`): a rank out of step raises at once.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import nn

from fxstar.errors import CollectiveError
from fxstar.runtime.buffer_pool import BufferPool
from fxstar.runtime.step_check import StepCursor

if TYPE_CHECKING:
    from fxstar.runtime.rank_stream import RankStream

__all__ = [
    "RankGroup",
    "group_timeout",
    "guard",
    "new_group",
    "host_process_group",
    "process_group",
    "process_group_for",
    "release_group",
]

ATTR = "tp_group"  # a tensor-parallel graph's submodule holding its group (and its regions')


class RankGroup(nn.Module):
    """A process group (every rank, or this rank's row or column of a 2-D mesh) and what
    belongs to it; a graph's collectives, random ops and recomputed regions read it from the
    graph."""

    def __init__(
        self, pg: Any, timeout: float | None, ranks: list[int] | None = None,
        steps: StepCursor | None = None, host_pg: Any = None,
    ):  # fmt: skip
        super().__init__()
        self.pg = pg  # dist.ProcessGroup; None: torch's default group
        # the same ranks for host tensors and objects (gloo); None: `pg` takes them
        self.host_pg = host_pg
        self.timeout = timeout  # seconds; None: the default group's (torch's)
        self.ranks = ranks  # the global ranks in group-rank order; None: every rank
        self.stream: RankStream | None = None  # this rank's RNG stream, once made
        self.buffers = BufferPool()
        self.steps = steps  # where this rank is in the group's collectives (step_check)

    def __deepcopy__(self, memo: dict) -> RankGroup:
        return self  # a copied graph (a kept stage) runs on the same group

    def release(self) -> None:
        """Destroy the process group (its engine is closed or freed); twice is harmless."""
        pg, side = self.pg, self.host_pg if self.host_pg is not self.pg else None
        self.pg = self.host_pg = self.stream = None
        self.buffers.clear()
        self.steps = None
        if pg is None or not dist.is_initialized():
            return
        for each in (pg, side):
            if each is not None:
                with contextlib.suppress(ValueError, RuntimeError):  # gone with the default
                    dist.destroy_process_group(each)

    def extra_repr(self) -> str:
        where = "" if self.ranks is None else f"ranks={self.ranks}, "
        return where + (f"timeout={self.timeout:g}s" if self.timeout is not None
                        else "default group")  # fmt: skip


def new_group(timeout: float, partition: list[list[int]] | None = None) -> RankGroup:
    """A process group whose collectives give up after `timeout` seconds: over every rank, or
    with `partition` (lists of global ranks covering the world, as `MeshLayout.tp_groups`
    gives) over the part holding this rank. Collective: every rank calls it at the same point
    with the same partition (torch makes every group on every rank, members or not). Its
    collectives are checked to be in step (step_check), under a backend other than gloo on a
    gloo group of the same ranks made beside it."""
    delta = datetime.timedelta(seconds=timeout)
    gloo = dist.get_backend() == dist.Backend.GLOO

    def make(ranks: list[int] | None) -> tuple[Any, Any]:
        pg = dist.new_group(ranks=ranks, timeout=delta)
        return pg, pg if gloo else dist.new_group(ranks=ranks, timeout=delta, backend="gloo")

    try:
        if partition is None:
            (pg, side), ranks = make(None), None
        else:
            me, pg, side, ranks = dist.get_rank(), None, None, None
            for part in partition:
                made = make(list(part))
                if me in part:
                    (pg, side), ranks = made, list(part)
            if pg is None:
                raise ValueError(f"rank {me} is in no group of the partition {partition}")
    except RuntimeError as error:
        if not _lost_peer(error):
            raise
        raise CollectiveError(
            f"creating the engine's process group on rank {dist.get_rank()} of "
            f"{dist.get_world_size()} timed out after {timeout:g} s: another rank did not reach "
            "the same compile (it failed before, in capture or tp_sharding, or its plan has no "
            "tensor_parallel). Look for the first error in the other ranks' output; "
            f"plan.dist_timeout bounds the wait.\n  backend said: {error}"
        ) from error
    return RankGroup(pg, float(timeout), ranks, StepCursor(side), host_pg=side)


def release_group(group: RankGroup | None) -> None:
    """Destroy `group`'s process group; None is ignored."""
    if group is not None:
        group.release()


def process_group(group: RankGroup | None) -> Any:
    """The ProcessGroup behind `group`; None stays None (torch's default group)."""
    if group is None:
        return None
    if group.pg is None:
        raise CollectiveError(
            "this graph's process group was released: the engine that made it was closed or "
            "freed; compile the model again"
        )
    return group.pg


def host_process_group(group: RankGroup | None) -> Any:
    """The ProcessGroup for host tensors and pickled objects on `group`'s ranks: its gloo side
    group under NCCL, the group itself under gloo; None stays None (torch's default group)."""
    pg = process_group(group)
    return pg if group is None or group.host_pg is None else group.host_pg


def process_group_for(group: RankGroup | None, tensor: Any) -> Any:
    """The ProcessGroup a collective on `tensor` runs on: the host one for a host tensor."""
    if getattr(tensor, "device", None) is not None and tensor.device.type != "cpu":
        return process_group(group)
    return host_process_group(group)


def group_timeout(group: RankGroup | None) -> float | None:
    """Seconds the collectives of `group` wait; None for the default group (torch's)."""
    return None if group is None else group.timeout


# What gloo (torch 2.13) raises when a peer is gone: a plain RuntimeError saying "Timed out
# waiting 5000ms for recv operation to complete", "Connection closed by peer [...]" or, from the
# store while a group is made, "Wait timeout". Other RuntimeErrors (bad shapes) pass unchanged.
_LOST_PEER = ("timed out", "timeout", "connection", "closed by peer", "broken pipe")


def _lost_peer(error: BaseException) -> bool:
    if isinstance(error, dist.DistNetworkError):
        return True
    text = str(error).lower()
    return any(sign in text for sign in _LOST_PEER)


def _lost_peer_message(what: str, group: RankGroup | None, error: BaseException) -> str:
    rank = dist.get_rank() if dist.is_initialized() else "?"
    world = dist.get_world_size() if dist.is_initialized() else "?"
    timeout = group_timeout(group)
    text = str(error).strip()
    if "time" in text.lower():
        happened = f"timed out after {timeout:g} s" if timeout is not None else "timed out"
    else:
        happened = "lost its connection to another rank"
    where = "the engine's process group" if group is not None else "the default process group"
    limit = (
        f"plan.dist_timeout ({timeout:g} s) bounds the wait"
        if timeout is not None
        else "init_process_group(timeout=...) bounds the wait"
    )
    first = text.splitlines()[0] if text else type(error).__name__
    return (
        f"{what} on rank {rank} of {world} {happened} ({where}): another rank probably "
        "failed, stopped calling the engine (it raised and went on, or skipped a step), or "
        "diverged (a different plan, model or input). Look for the first error in the other "
        f"ranks' output; {limit}.\n  backend said: {first}"
    )


@contextlib.contextmanager
def guard(what: str, group: RankGroup | None = None, *, wait: bool = False) -> Iterator[None]:
    """Around the collectives `what` (a collective and its caller, the same text on every
    rank) on `group` (None: the default group): first every rank checks that the others are
    at the same collective of the same step (step_check; not for `wait`, a block that only
    waits for collectives issued before), then a timeout or a lost connection inside the
    block is re-raised as a CollectiveError about `what`."""
    try:
        if not wait and group is not None and group.steps is not None:
            group.steps.check(what)
        yield
    except CollectiveError:
        raise
    except RuntimeError as error:
        if not _lost_peer(error):
            raise
        raise CollectiveError(_lost_peer_message(what, group, error)) from error
