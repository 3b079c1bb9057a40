"""Vocab-parallel embedding, logits gather and cross-entropy (Megatron's), for graph nodes.

Each rank holds rows [rank * V/N, (rank + 1) * V/N) of the vocabulary's matrix (the embedding
and the LM head, tied or not). Why: for a large vocabulary the head's logits are the largest
activation of a step, and replicated they cost every rank the full [tokens, V]. Here:

- the embedding looks up the ids in its own rows, zeroes the others' and sums the ranks' rows
  with one all-reduce, or, read on sequence-parallel token blocks, one reduce-scatter that
  also cuts this rank's block (backward: each rank's rows get the gradient where their ids
  were);
- the head is an ordinary column-parallel linear (`tp_ops.column_linear`): logits [.., V/N];
- the cross-entropy reads the sharded logits: the max, the target's logit and the sum of the
  exponentials are all-reduced (three [tokens] vectors), so full logits never exist. Backward
  needs no collective: each rank's logit gradient is its softmax slice minus its part of the
  one-hot target. It is recomputed from the logits and each row's log-sum-exp, row block by
  row block, rather than kept: bf16 logits never have an fp32 softmax saved beside them.

The first rank's rows start at 0: a rank's offset is `rank * local rows`, read at run time,
so the graph is the same on every rank (the ranks compare graphs at compile).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fxstar.runtime.rank_group import RankGroup
from fxstar.runtime.tp_ops import Collectives, _AllReduceForward, _ReduceScatterSeq

__all__ = ["gather_from_vocab", "vocab_cross_entropy", "vocab_embedding"]

_REDUCTIONS = ("none", "mean", "sum")  # aten's enum: 0, 1, 2


def _rows(comm: Collectives, local: int) -> tuple[int, int]:
    start = comm.rank * local
    return start, start + local


def vocab_embedding(
    weight: torch.Tensor,
    ids: torch.Tensor,
    padding_idx: int = -1,
    *,
    sequence_parallel: bool = False,
    mem_saving: bool = False,
    group: RankGroup | None = None,
) -> torch.Tensor:
    """aten.embedding on this rank's rows of the vocabulary, summed over ranks (the argument
    order is aten's). An id outside the rows looks up row 0 and is zeroed; `padding_idx`
    (the full vocabulary's) keeps its meaning on the rank that holds it. With
    `sequence_parallel` the sum is a reduce-scatter: this rank gets its token block only."""
    comm = Collectives(mem_saving, group, "vocab_embedding")
    start, end = _rows(comm, weight.shape[0])
    outside = (ids < start) | (ids >= end)
    local = (ids - start).masked_fill(outside, 0)
    pad = padding_idx - start if start <= padding_idx < end else -1
    rows = torch.nn.functional.embedding(local, weight, padding_idx=pad if pad >= 0 else None)
    rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
    if sequence_parallel:
        return _ReduceScatterSeq.apply(rows, comm)
    return _AllReduceForward.apply(rows, comm)


BLOCK_ELEMENTS = 1 << 22  # logits per row block computed in fp32 at once (16 MiB)


def _row_blocks(rows: int, width: int) -> list[slice]:
    step = max(1, BLOCK_ELEMENTS // max(width, 1))
    return [slice(i, min(i + step, rows)) for i in range(0, rows, step)]


class _VocabCrossEntropy(torch.autograd.Function):
    """Megatron's vocab-parallel cross-entropy, computed in fp32 (or wider) row block by
    row block. Backward recomputes the softmax slice from the logits and each row's
    log-sum-exp instead of keeping it: what stays saved is the logits shard in their own
    dtype (bf16: half an fp32 softmax), and no fp32 tensor larger than a block exists."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, reduction, comm):
        start, end = _rows(comm, logits.shape[-1])
        wide = torch.promote_types(logits.dtype, torch.float32)  # bf16/fp16: in fp32
        top = logits.amax(-1).to(wide)
        comm.all_reduce(top, op=dist.ReduceOp.MAX).wait()
        valid = target != ignore_index
        mine = (target >= start) & (target < end) & valid
        local = (target - start).masked_fill(~mine, 0)
        picked = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).to(wide) - top
        picked = picked.masked_fill(~mine, 0.0)
        total = top.new_empty(top.shape)
        for rows in _row_blocks(*logits.shape):
            torch.sum(torch.exp(logits[rows].to(wide) - top[rows, None]), -1, out=total[rows])
        both = torch.stack([picked, total])  # one all-reduce for both vectors
        comm.all_reduce(both).wait()
        picked, total = both[0], both[1]
        loss = (total.log() - picked).masked_fill(~valid, 0.0)
        log_sum_exp = top + total.log()
        count = valid.sum()
        ctx.save_for_backward(logits, log_sum_exp, local, mine, valid, count)
        ctx.reduction = reduction
        if reduction == "mean":
            loss = loss.sum() / count
        elif reduction == "sum":
            loss = loss.sum()
        return loss.to(logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        logits, log_sum_exp, local, mine, valid, count = ctx.saved_tensors
        wide = log_sum_exp.dtype
        grad = grad.to(wide)
        if ctx.reduction == "none":
            scale = grad * valid
        else:
            scale = (grad / count if ctx.reduction == "mean" else grad) * valid
        out = torch.empty_like(logits)
        same = logits.dtype == wide  # then each block is computed in its place in `out`
        for rows in _row_blocks(*logits.shape):
            g = torch.sub(logits[rows].to(wide), log_sum_exp[rows, None],
                          out=out[rows] if same else None).exp_()  # the softmax  # fmt: skip
            g[torch.arange(g.shape[0], device=g.device), local[rows]] -= mine[rows].to(wide)
            g.mul_(scale[rows, None])
            if not same:
                out[rows] = g
        return out, None, None, None, None


def vocab_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: None = None,
    reduction: int = 1,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    *,
    mem_saving: bool = False,
    group: RankGroup | None = None,
) -> torch.Tensor:
    """aten.cross_entropy_loss (its argument order) on logits [tokens, V/N] holding this
    rank's classes; the same value on every rank. Class weights and label smoothing are not
    supported (tp_sharding keeps such a head whole)."""
    if weight is not None or label_smoothing:
        raise NotImplementedError("vocab_cross_entropy: class weights or label smoothing")
    if logits.dim() != 2 or target.dim() != 1:
        raise ValueError(
            f"vocab_cross_entropy takes logits [tokens, classes] and targets [tokens], got "
            f"{list(logits.shape)} and {list(target.shape)}"
        )
    comm = Collectives(mem_saving, group, "vocab_cross_entropy")
    return _VocabCrossEntropy.apply(logits, target, ignore_index, _REDUCTIONS[reduction], comm)


class _GatherFromVocab(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        out = x.new_empty((comm.world, *x.shape))
        comm.all_gather(out, x.contiguous()).wait()
        return torch.cat(out.unbind(0), -1)

    @staticmethod
    def backward(ctx, grad):
        comm = ctx.comm
        return grad.chunk(comm.world, -1)[comm.rank].contiguous(), None


def gather_from_vocab(
    x: torch.Tensor, *, mem_saving: bool = False, group: RankGroup | None = None
) -> torch.Tensor:
    """Vocab-sharded logits -> the full logits, for a model that returns them (what reads
    them is replicated, so backward keeps this rank's slice of the gradient)."""
    return _GatherFromVocab.apply(x, Collectives(mem_saving, group, "gather_from_vocab"))
