"""The model's gradient norm and overflow, where each rank holds part of the gradients.

Clipping and fp16's overflow check decide from every gradient of the model, and every rank
must decide alike. Under tensor parallelism a rank holds shards of the split parameters and
whole copies of the replicated ones (norms, row linears' biases, embeddings left whole);
under data parallelism HybridAdam sees the rank's own chunks only. The model's sum of
squares is the shards' summed over the tensor-parallel group plus the replicated ones
counted once, each first summed over the data-parallel ranks (whose own chunks partition the
model); an overflow on any rank is everyone's. A rank that summed its own shards alone would
clip by (and skip on) a norm of its own, and the replicated weights would drift apart.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from fxstar.runtime import rank_group

__all__ = ["GradNorm", "clip_coefficient"]

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s guard against a zero norm


class GradNorm:
    """Turns a rank's partial sums of squares into the model's, on every rank alike."""

    def __init__(
        self,
        tensor_parallel: rank_group.RankGroup | None = None,
        sharded: Iterable[torch.Tensor] = (),
        data_parallel: rank_group.RankGroup | None = None,
    ):
        self.tensor_parallel = tensor_parallel
        # the parameters split across the tensor-parallel ranks (the engine's own tensors)
        self.sharded = {id(p) for p in sharded}
        self.data_parallel = data_parallel  # set when each rank sums its own chunks only

    def split(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> tuple[list, list]:
        """The gradients (of (parameter, gradient) pairs) of shards, and of the rest."""
        shards, replicated = [], []
        for param, grad in pairs:
            (shards if id(param) in self.sharded else replicated).append(grad)
        return shards, replicated

    def decide(self, shard_sq: float, replicated_sq: float, finite: bool) -> tuple[float, bool]:
        """The model's sum of squares and whether every gradient of every rank is finite."""
        stats = torch.tensor([shard_sq, replicated_sq, 0.0 if finite else 1.0],
                             dtype=torch.float64)  # fmt: skip
        if self.data_parallel is not None:  # the ranks' own chunks partition the model
            with rank_group.guard("summing the gradient norm and overflow (data parallel)",
                          self.data_parallel):  # fmt: skip
                dist.all_reduce(
                    stats, group=rank_group.process_group_for(self.data_parallel, stats)
                )
        if self.tensor_parallel is not None:
            partial = stats[[0, 2]].clone()  # the replicated part is the same on every rank
            with rank_group.guard("summing the gradient norm and overflow (tensor parallel)",
                          self.tensor_parallel):  # fmt: skip
                dist.all_reduce(
                    partial, group=rank_group.process_group_for(self.tensor_parallel, partial)
                )
            stats[0], stats[2] = partial[0], partial[1]
        total = float(stats[0] + stats[1])
        return total, bool(stats[2] == 0) and math.isfinite(total)

    @torch.no_grad()
    def clip_(self, params: Iterable[torch.Tensor], max_norm: float) -> None:
        """Clip the gradients of `params` in place by the model's norm, as
        torch.nn.utils.clip_grad_norm_ does: for a torch optimizer, whose every rank holds
        whole (averaged) gradients of its parameters."""
        params = [p for p in params if p.grad is not None]
        if not params:
            return
        shards, replicated = self.split((p, p.grad) for p in params)
        total, _ = self.decide(_sum_of_squares(shards), _sum_of_squares(replicated), True)
        coefficient = clip_coefficient(max_norm, torch.tensor(total**0.5))
        # torch's arithmetic: one multiply per device and dtype by the float32 coefficient
        by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for p in params:
            by_kind.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
        for (device, _), grads in by_kind.items():
            torch._foreach_mul_(grads, coefficient.to(device))


def clip_coefficient(max_norm: float, norm: float | torch.Tensor) -> float | torch.Tensor:
    """What clipping to `max_norm` multiplies every gradient by, from the model's gradient
    norm: min(1, max_norm / (norm + 1e-6)), torch's clip_grad_norm_ rule, in the arithmetic
    `norm` comes in. HybridAdam fuses a float one into its step's gradient scale; a torch
    optimizer's gradients are multiplied by a tensor one (GradNorm.clip_), as torch does."""
    coefficient = max_norm / (norm + CLIP_EPS)
    if isinstance(coefficient, torch.Tensor):
        return torch.clamp(coefficient, max=1.0)
    return min(1.0, coefficient)


def _sum_of_squares(grads: list[torch.Tensor]) -> float:
    """The gradients' sum of squares, each in float64."""
    return sum(float(torch.linalg.vector_norm(g, dtype=torch.float64) ** 2) for g in grads)
