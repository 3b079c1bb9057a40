"""Tensor-parallel collectives and linears that graph nodes call, each with its own backward.

Why our own autograd.Functions: the right backward of a collective depends on what reads its
result. An all-gather before a column linear is sharded downstream, so its backward is a
reduce-scatter; an all-gather before a replicated op (the LM head) needs only the rank's own
slice back. torch's functional collectives pick one (and double gradients in the other case);
here the tensor-parallel pass chooses per site.

Layout: activations are [..., seq, hidden] (transformers' [batch, seq, hidden]); sequence
parallelism shards dim -2. A gathered activation is kept rank-major, [N, ..., seq/N, hidden],
which is what `all_gather_into_tensor` writes without a copy; matmuls run on it directly and
only the output is reordered to [..., seq, out].

The column and row linears follow nanotron's (PR #208, #172): sync or async communication,
and keep or recompute the gathered input. Recompute saves only the rank's shard for backward
and re-gathers it into one reusable buffer (any device), overlapped with grad_input.
`mem_saving=True` swaps the collectives for PatrickStar's: N broadcasts for an all-gather and
N reduces through one scratch buffer for a reduce-scatter.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "Collectives",
    "all_gather_seq",
    "all_reduce_forward",
    "column_linear",
    "gather_from_seq",
    "gather_shards",
    "grad_all_reduce",
    "reduce_scatter_seq",
    "row_linear",
    "scatter_to_seq",
]

SEQ_DIM = -2

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor; both take the
# concatenated (dim 0) form.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# -- collectives ----------------------------------------------------------------------------------


class _Works:
    """Pending collectives behind one `wait()`."""

    def __init__(self, works: list[Any] = ()):
        self.works = [w for w in works if w is not None]

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []


class _BufferPool:
    """One flat buffer per (purpose, dtype, device), grown on demand and handed out as views.

    Recompute mode gathers into the "gather" buffer in forward and again in backward, one
    linear at a time; mem_saving_comm reduces through the "scratch" buffer."""

    def __init__(self) -> None:
        self._flat: dict[tuple, torch.Tensor] = {}

    def get(self, purpose: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        key = (purpose, like.dtype, like.device)
        numel = 1
        for s in shape:
            numel *= s
        flat = self._flat.get(key)
        if flat is None or flat.numel() < numel:
            flat = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._flat[key] = flat
        return flat[:numel].view(shape)

    def clear(self) -> None:
        self._flat.clear()


BUFFERS = _BufferPool()


class Collectives:
    """The collectives the TP ops use, over the default process group.

    `mem_saving`: all-gather as N broadcasts, reduce-scatter as N reduces through one scratch
    buffer (gloo's `reduce` overwrites its input on non-root ranks, so never reduce in place).
    Those reduces run one after another, so they are not overlapped even when asked to be.
    """

    def __init__(self, mem_saving: bool = False):
        self.mem_saving = mem_saving
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()

    def all_gather(self, out: torch.Tensor, x: torch.Tensor, async_op: bool = False) -> _Works:
        """out[r] = rank r's x; out is [N, *x.shape]."""
        if not self.mem_saving:
            work = _all_gather_single(out.flatten(0, 1), x.contiguous(), async_op=async_op)
            return _Works([work])
        out[self.rank].copy_(x)
        works = [dist.broadcast(out[src], src, async_op=async_op) for src in range(self.world)]
        return _Works(works)

    def reduce_scatter(self, out: torch.Tensor, x: torch.Tensor, async_op: bool = False) -> _Works:
        """out = sum over ranks of their x[rank]; x is [N, *out.shape]."""
        if not self.mem_saving:
            work = _reduce_scatter_single(out, x.contiguous().flatten(0, 1), async_op=async_op)
            return _Works([work])
        scratch = BUFFERS.get("scratch", tuple(out.shape), out)
        for dst in range(self.world):
            scratch.copy_(x[dst])
            dist.reduce(scratch, dst)
            if dst == self.rank:
                out.copy_(scratch)
        return _Works()

    def all_reduce(self, x: torch.Tensor, async_op: bool = False) -> _Works:
        return _Works([dist.all_reduce(x, async_op=async_op)])


def _split_seq(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """[..., S, ...] -> [N, ..., S/N, ...] (rank-major, contiguous)."""
    return torch.stack(x.chunk(n, dim)).contiguous()


def _join_seq(stacked: torch.Tensor, dim: int) -> torch.Tensor:
    """[N, ..., S/N, ...] -> [..., S, ...] (a copy with its own storage)."""
    return torch.cat(stacked.unbind(0), dim)


def _gather(x: torch.Tensor, dim: int, comm: Collectives) -> torch.Tensor:
    out = x.new_empty((comm.world, *x.shape))
    comm.all_gather(out, x).wait()
    return _join_seq(out, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, comm: Collectives) -> torch.Tensor:
    stacked = _split_seq(x, comm.world, dim)
    out = x.new_empty(stacked.shape[1:])
    comm.reduce_scatter(out, stacked).wait()
    return out


def gather_shards(x: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's `x` (same shape on all), in rank order: consolidating parameter shards."""
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x.contiguous())
    return out


# -- the boundary functions (Megatron's f and g, and their sequence-parallel cousins) -------------


class _GradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mem_saving):
        ctx.mem_saving = mem_saving
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        Collectives(ctx.mem_saving).all_reduce(grad).wait()
        return grad, None


class _AllReduceForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mem_saving):
        out = x.clone()
        Collectives(mem_saving).all_reduce(out).wait()
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, mem_saving):
        comm = Collectives(mem_saving)
        ctx.dim, ctx.mem_saving = dim, mem_saving
        return x.chunk(comm.world, dim)[comm.rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad.contiguous(), ctx.dim, Collectives(ctx.mem_saving)), None, None


class _GatherFromSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, mem_saving):
        ctx.dim, ctx.mem_saving = dim, mem_saving
        return _gather(x, dim, Collectives(mem_saving))

    @staticmethod
    def backward(ctx, grad):
        comm = Collectives(ctx.mem_saving)
        return grad.chunk(comm.world, ctx.dim)[comm.rank].contiguous(), None, None


class _AllGatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, mem_saving):
        ctx.dim, ctx.mem_saving = dim, mem_saving
        return _gather(x, dim, Collectives(mem_saving))

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, Collectives(ctx.mem_saving)), None, None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, mem_saving):
        ctx.dim, ctx.mem_saving = dim, mem_saving
        return _reduce_scatter(x, dim, Collectives(mem_saving))

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad.contiguous(), ctx.dim, Collectives(ctx.mem_saving)), None, None


def grad_all_reduce(x: torch.Tensor, *, mem_saving: bool = False) -> torch.Tensor:
    """Identity forward, all-reduce backward (Megatron's f): a replicated tensor read by
    rank-local work (a column linear's input; a norm weight on a sequence shard)."""
    return _GradAllReduce.apply(x, mem_saving)


def all_reduce_forward(x: torch.Tensor, *, mem_saving: bool = False) -> torch.Tensor:
    """All-reduce forward, identity backward (Megatron's g)."""
    return _AllReduceForward.apply(x, mem_saving)


def scatter_to_seq(x: torch.Tensor, dim: int = SEQ_DIM, *, mem_saving: bool = False):
    """A replicated tensor -> this rank's sequence slice; backward all-gathers the slices."""
    return _ScatterToSeq.apply(x, dim, mem_saving)


def gather_from_seq(x: torch.Tensor, dim: int = SEQ_DIM, *, mem_saving: bool = False):
    """Sequence slices -> the full tensor for replicated work; backward keeps the own slice
    (every rank holds the same gradient of a replicated result)."""
    return _GatherFromSeq.apply(x, dim, mem_saving)


def all_gather_seq(x: torch.Tensor, dim: int = SEQ_DIM, *, mem_saving: bool = False):
    """Sequence slices -> the full tensor for sharded work; backward reduce-scatters (it is
    2x wrong when what reads the result is replicated: use gather_from_seq there)."""
    return _AllGatherSeq.apply(x, dim, mem_saving)


def reduce_scatter_seq(x: torch.Tensor, dim: int = SEQ_DIM, *, mem_saving: bool = False):
    """Partial sums -> this rank's summed sequence slice; backward all-gathers."""
    return _ReduceScatterSeq.apply(x, dim, mem_saving)


# -- linears --------------------------------------------------------------------------------------


def _wt(weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """The [in, out] matrix: nn.Linear stores [out, in], GPT-2's Conv1D [in, out]."""
    return weight if transposed else weight.t()


def _matmul(x, weight, bias, transposed, out=None):
    y = torch.matmul(x, _wt(weight, transposed), out=out)
    if bias is None:
        return y
    return y.add_(bias) if out is not None else y + bias


def _grad_weight(x2d, gy2d, transposed):
    gw = gy2d.t() @ x2d  # [out, in]
    return gw.t() if transposed else gw


class _ColumnLinear(torch.autograd.Function):
    """Column-parallel linear: the weight holds this rank's output features.

    Without sequence parallel the input is replicated: identity forward, grad_input
    all-reduced (async: overlapped with grad_weight). With it, the input is this rank's
    sequence slice: all-gather, linear; backward reduce-scatters grad_input."""

    @staticmethod
    def forward(ctx, x, weight, bias, sp, async_comm, recompute, mem_saving, transposed):
        ctx.opts = (sp, async_comm, recompute, mem_saving, transposed)
        ctx.has_bias = bias is not None
        if not sp:
            ctx.save_for_backward(x, weight)
            return _matmul(x, weight, bias, transposed)
        comm = Collectives(mem_saving)
        n, rank = comm.world, comm.rank
        x = x.contiguous()
        shape = (n, *x.shape)
        gathered = BUFFERS.get("gather", shape, x) if recompute else x.new_empty(shape)
        if async_comm:  # own rows while the gather runs, then the rest
            work = comm.all_gather(gathered, x, async_op=True)
            out_features = weight.shape[1] if transposed else weight.shape[0]
            y = x.new_empty((n, *x.shape[:-1], out_features))
            _matmul(x, weight, bias, transposed, out=y[rank])
            work.wait()
            for r in range(n):
                if r != rank:
                    _matmul(gathered[r], weight, bias, transposed, out=y[r])
        else:
            comm.all_gather(gathered, x).wait()
            y = _matmul(gathered, weight, bias, transposed)
        ctx.save_for_backward(x if recompute else gathered, weight)
        return _join_seq(y, SEQ_DIM)

    @staticmethod
    def backward(ctx, grad):
        sp, async_comm, recompute, mem_saving, transposed = ctx.opts
        saved, weight = ctx.saved_tensors
        comm = Collectives(mem_saving)
        w = _wt(weight, transposed)  # [in, out]
        if not sp:
            gx = torch.matmul(grad, w.t())
            pending = comm.all_reduce(gx, async_op=async_comm)
            gw = _grad_weight(saved.reshape(-1, w.shape[0]), grad.reshape(-1, w.shape[1]),
                              transposed)  # fmt: skip
            gb = grad.reshape(-1, w.shape[1]).sum(0) if ctx.has_bias else None
            pending.wait()
            return gx, gw, gb, None, None, None, None, None
        n = comm.world
        gy = _split_seq(grad, n, SEQ_DIM)  # [N, ..., S/N, out], rank-major like `gathered`
        if recompute:  # re-gather while grad_input is computed
            gathered = BUFFERS.get("gather", (n, *saved.shape), saved)
            gathering = comm.all_gather(gathered, saved, async_op=async_comm)
        else:
            gathered, gathering = saved, _Works()
        gx_full = torch.matmul(gy, w.t())  # [N, ..., S/N, in]
        gx = gx_full.new_empty(gx_full.shape[1:])
        scattering = comm.reduce_scatter(gx, gx_full, async_op=async_comm)
        gathering.wait()
        gy2d = gy.reshape(-1, w.shape[1])
        gw = _grad_weight(gathered.reshape(-1, w.shape[0]), gy2d, transposed)
        gb = gy2d.sum(0) if ctx.has_bias else None
        scattering.wait()
        return gx, gw, gb, None, None, None, None, None


class _RowLinear(torch.autograd.Function):
    """Row-parallel linear: the weight holds this rank's input features; the input is sharded
    along its features, the partial outputs are summed (all-reduce, or reduce-scatter to
    sequence slices). The bias is added once, after the sum; under sequence parallel each
    rank sees only its slice's bias gradient, so that gradient is all-reduced."""

    @staticmethod
    def forward(ctx, x, weight, bias, sp, async_comm, mem_saving, transposed):
        ctx.opts = (sp, async_comm, mem_saving, transposed)
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        comm = Collectives(mem_saving)
        if not sp:
            y = _matmul(x, weight, None, transposed)
            comm.all_reduce(y).wait()
        else:
            partial = torch.matmul(_split_seq(x, comm.world, SEQ_DIM), _wt(weight, transposed))
            y = partial.new_empty(partial.shape[1:])
            comm.reduce_scatter(y, partial).wait()
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, grad):
        sp, async_comm, mem_saving, transposed = ctx.opts
        x, weight = ctx.saved_tensors
        w = _wt(weight, transposed)  # [in, out]
        comm = Collectives(mem_saving)
        grad = grad.contiguous()
        if not sp:
            gx = torch.matmul(grad, w.t())
            gw = _grad_weight(x.reshape(-1, w.shape[0]), grad.reshape(-1, w.shape[1]), transposed)
            gb = grad.reshape(-1, w.shape[1]).sum(0) if ctx.has_bias else None
            return gx, gw, gb, None, None, None, None
        n, rank = comm.world, comm.rank
        gy = grad.new_empty((n, *grad.shape))
        gathering = comm.all_gather(gy, grad, async_op=async_comm)
        gx = grad.new_empty((n, *grad.shape[:-1], w.shape[0]))
        torch.matmul(grad, w.t(), out=gx[rank])  # own rows first: exact for this rank (#172)
        gathering.wait()
        for r in range(n):
            if r != rank:
                torch.matmul(gy[r], w.t(), out=gx[r])
        reducing = _Works()
        gb = None
        if ctx.has_bias:
            gb = grad.reshape(-1, w.shape[1]).sum(0)
            reducing = comm.all_reduce(gb, async_op=async_comm)
        xs = _split_seq(x, n, SEQ_DIM)
        gw = _grad_weight(xs.reshape(-1, w.shape[0]), gy.reshape(-1, w.shape[1]), transposed)
        reducing.wait()
        return _join_seq(gx, SEQ_DIM), gw, gb, None, None, None, None


def column_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    sequence_parallel: bool = False,
    async_comm: bool = False,
    recompute: bool = False,
    mem_saving: bool = False,
    transposed: bool = False,
) -> torch.Tensor:
    """x @ W_r^T + b_r for this rank's output features W_r (transposed: W_r is [in, out], the
    Conv1D layout). With sequence_parallel, x is this rank's sequence slice [..., S/N, in]
    and the result covers the whole sequence [..., S, out/N]."""
    return _ColumnLinear.apply(
        x, weight, bias, sequence_parallel, async_comm, recompute, mem_saving, transposed
    )


def row_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    sequence_parallel: bool = False,
    async_comm: bool = False,
    mem_saving: bool = False,
    transposed: bool = False,
) -> torch.Tensor:
    """sum over ranks of x_r @ W_r^T, plus b once. x holds this rank's input features. With
    sequence_parallel the result is this rank's sequence slice [..., S/N, out]."""
    return _RowLinear.apply(x, weight, bias, sequence_parallel, async_comm, mem_saving, transposed)
