"""res_check: the same steps data parallel and in one process, loss by loss (PatrickStar's
`res_check`).

Called on every rank of a torch.distributed run: each rank trains a model from `make_model`
on its slice of each global batch (dim 0 split into N equal parts) through the plan, and the
losses of the ranks are averaged per step; then rank 0 trains another model from `make_model`
on the whole batches in this one process (`data_parallel=False`), and the two columns are
compared. Data parallelism changes only the order in which gradients are summed, so the
difference stays at rounding level (fp32) unless something is wrong; dropout draws differ per
rank by design, so models under check should have none. `fxstar train --res-check` runs it
on the reference GPT (dropout off) under torchrun.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from fxstar.errors import UsageError
from fxstar.plan import Plan

__all__ = ["ResCheck", "res_check"]

Batch = Sequence[torch.Tensor]


@dataclass
class ResCheck:
    world: int
    distributed: list[float]  # the ranks' mean loss per step
    serial: list[float] | None  # the one-process loss per step (rank 0; None on the others)

    def _pairs(self) -> list[tuple[float, float]]:
        if self.serial is None:
            raise ValueError("the serial run is rank 0's: read the comparison there")
        return list(zip(self.distributed, self.serial, strict=True))

    @property
    def largest_difference(self) -> float:
        return max((abs(a - b) for a, b in self._pairs()), default=0.0)

    @property
    def largest_relative(self) -> float:
        return max((abs(a - b) / max(abs(b), 1e-12) for a, b in self._pairs()), default=0.0)

    def table(self) -> str:
        lines = [f"res_check: {self.world} ranks data parallel vs one process",
                 f"{'step':>6}{'distributed':>16}{'serial':>16}{'difference':>14}"]  # fmt: skip
        for i, (a, b) in enumerate(self._pairs()):
            lines.append(f"{i:>6}{a:>16.8f}{b:>16.8f}{a - b:>14.3e}")
        lines.append(f"largest difference {self.largest_difference:.3e} "
                     f"({self.largest_relative:.3e} relative)")  # fmt: skip
        return "\n".join(lines)


def _slice(batch: Batch, rank: int, world: int) -> tuple[torch.Tensor, ...]:
    rows = batch[0].shape[0]
    if rows % world:
        raise UsageError(f"res_check: a batch of {rows} does not split over {world} ranks")
    part = rows // world
    return tuple(t[rank * part : (rank + 1) * part] for t in batch)


def _losses(model: nn.Module, plan: Plan, batches: Sequence[Batch]) -> list[float]:
    from fxstar.engine import compile  # the engine imports the passes, which import this

    engine = compile(model, plan, example_inputs=tuple(batches[0]))
    losses = []
    for batch in batches:
        loss = engine(*batch)
        loss.backward()
        engine.step()
        losses.append(loss.item())
    engine.close()
    return losses


def res_check(make_model: Callable[[], nn.Module], plan: Plan,
              batches: Sequence[Batch]) -> ResCheck:  # fmt: skip
    """Train `batches` (global batches of tensors, the model's positional inputs) data
    parallel on every rank and, on rank 0, in one process; the per-step losses of both."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        raise UsageError("res_check compares a data-parallel run with a serial one: launch it "
                         "on 2 or more ranks (torchrun --nproc-per-node N ...)")  # fmt: skip
    if plan.tensor_parallel is not None and plan.tensor_parallel.size > 1:
        raise UsageError(
            "res_check compares data parallelism alone with one process; its serial side "
            "cannot run a tensor-parallel plan: drop tensor_parallel"
        )
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = [_slice(b, rank, world) for b in batches]
    losses = torch.tensor(_losses(make_model(), plan, mine), dtype=torch.float64)
    dist.all_reduce(losses)
    distributed = (losses / world).tolist()
    serial = None
    if rank == 0:
        serial = _losses(make_model(), plan.replace(data_parallel=False), batches)
    dist.barrier()  # the others wait for rank 0's serial run, so none tears the group down
    return ResCheck(world, distributed, serial)
