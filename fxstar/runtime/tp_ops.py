"""Tensor-parallel collectives and linears that graph nodes call, each with its own backward.

Why our own autograd.Functions: the right backward of a collective depends on what reads its
result. An all-gather before a column linear is sharded downstream, so its backward is a
reduce-scatter; an all-gather before a replicated op (the LM head) needs only the rank's own
slice back. torch's functional collectives pick one (and double gradients in the other case);
here the tensor-parallel pass chooses per site.

Layout: activations are [..., seq, hidden] (transformers' [batch, seq, hidden]). Sequence
parallelism gives rank r the r-th of N equal blocks of the flattened tokens [batch * seq]
(for batch 1, its slice of the sequence), shaped [..., seq/N, hidden]. Why tokens rather than
each sequence's slice: a rank's block is then contiguous in the full activation, so
`all_gather_into_tensor` writes the full [..., seq, hidden] in place and
`reduce_scatter_tensor` reads it in place; slicing dim -2 of a batch would need a stack/cat
copy of activation size around every collective. The sequence-parallel region only holds
token-wise work (norms, residual adds, dropout: tp_sharding checks), to which which tokens a
rank holds makes no difference; `own_tokens` is the one place that knows the blocks.

The column and row linears follow nanotron's (PR #208, #172): sync or async communication,
and keep or recompute the gathered input. Recompute saves only the rank's shard for backward
and re-gathers it into one reusable buffer (any device), overlapped with grad_input.
`mem_saving=True` swaps the collectives for PatrickStar's: N broadcasts for an all-gather and
N reduces through one scratch buffer for a reduce-scatter. In the sequence-parallel linears
it goes further: the gathered input (column) and the gathered gradient (row) never exist;
each rank's block is broadcast into one block-sized buffer and used at once, and each
partial sum is made one block at a time and reduced to its rank, so a linear's
communication buffers are two blocks, not an N-block gather.

Process groups: an engine runs its collectives on a group of its own, a `RankGroup` the graph
holds (`runtime/rank_group.py`: its timeout makes a stopped peer a `CollectiveError`, not a
hang); graph nodes pass it as `group=` (a `get_attr` of the graph). `group=None` is torch's
default group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from fxstar.runtime.buffer_pool import BufferPool
from fxstar.runtime.device import device_for
from fxstar.runtime.rank_group import RankGroup, guard, process_group, process_group_for

__all__ = [
    "Collectives",
    "all_gather_seq",
    "all_reduce_forward",
    "column_linear",
    "full_shape",
    "gather_from_seq",
    "gather_shards",
    "grad_all_reduce",
    "own_tokens",
    "reduce_scatter_seq",
    "row_linear",
    "scatter_to_seq",
]

SEQ_DIM = -2


# -- collectives ----------------------------------------------------------------------------------


class _Works:
    """Pending collectives behind one `wait()`, which names them if they fail."""

    def __init__(self, works: list[Any] = (), what: str = "", group: RankGroup | None = None):
        self.works = [w for w in works if w is not None]
        self.what, self.group = what, group

    def wait(self) -> None:
        with guard(self.what, self.group, wait=True):
            for work in self.works:
                work.wait()
        self.works = []


class Collectives:
    """The collectives the TP ops use, over `group` (a `RankGroup`; None = torch's default
    group, with buffers of its own). `rank` and `world` are the group's (a row of a 2-D mesh
    is not every rank); rooted collectives name their root by its group rank (group_src).

    `op` and `phase` name the caller in errors ('all_gather in column_linear backward').
    `mem_saving`: all-gather as N broadcasts, reduce-scatter as N reduces through one scratch
    buffer (gloo's `reduce` overwrites its input on non-root ranks, so never reduce in place).
    Those reduces run one after another, so they are not overlapped even when asked to be.
    """

    def __init__(
        self, mem_saving: bool = False, group: RankGroup | None = None, op: str = "",
        phase: str = "forward",
    ):  # fmt: skip
        self.mem_saving = mem_saving
        self.group, self.op, self.phase = group, op, phase
        self.pg = process_group(group)
        self.buffers = group.buffers if group is not None else BufferPool()
        self.rank = dist.get_rank(self.pg)
        self.world = dist.get_world_size(self.pg)

    def pg_for(self, tensor: torch.Tensor) -> Any:
        """The group a collective on `tensor` runs on (a host tensor under NCCL: the gloo
        group beside the group, rank_group.process_group_for)."""
        return process_group_for(self.group, tensor)

    def in_backward(self) -> Collectives:
        """The same collectives, named as the caller's backward in errors."""
        other = Collectives(self.mem_saving, self.group, self.op, "backward")
        other.buffers = self.buffers  # recompute re-gathers into the forward's buffer
        return other

    def _issue(self, name: str, issue: Callable[[], list[Any]]) -> _Works:
        what = f"{name} in {self.op} {self.phase}" if self.op else name
        with guard(what, self.group):
            return _Works(issue(), what, self.group)

    def _issue_into(self, name: str, dst: torch.Tensor, async_op: bool,
                    issue: Callable[[torch.Tensor], list[Any]]) -> _Works:  # fmt: skip
        """As _issue, for collectives that write `dst`: issued asynchronously through the
        device's `collective`, so what reads `dst` before the wait reads garbage (poison on
        the simulated device) as it would on a card."""
        if not async_op:
            return self._issue(name, lambda: issue(dst))
        device = device_for(dst.device)
        return self._issue(name, lambda: device.collective(dst, issue))

    def all_gather(self, out: torch.Tensor, x: torch.Tensor, async_op: bool = False) -> _Works:
        """out (contiguous, N times x's elements) = every rank's x, concatenated in rank
        order: [N, *x.shape], or the full activation of N token blocks."""
        pg = self.pg_for(out)
        own = x.contiguous().view(-1)
        if not self.mem_saving:
            return self._issue_into("all_gather", out, async_op, lambda dst: [
                dist.all_gather_single(dst.view(-1), own, group=pg, async_op=async_op)
            ])  # fmt: skip
        out.view(self.world, -1)[self.rank].copy_(own)
        return self._issue_into("all_gather (as broadcasts)", out, async_op, lambda dst: [
            dist.broadcast(dst.view(self.world, -1)[src], group=pg, async_op=async_op,
                           group_src=src)
            for src in range(self.world)
        ])  # fmt: skip

    def reduce_scatter(self, out: torch.Tensor, x: torch.Tensor, async_op: bool = False) -> _Works:
        """out = sum over ranks of their rank-th block of x (x contiguous, N times out's
        elements: [N, *out.shape], or the full activation of N token blocks)."""
        pg = self.pg_for(out)
        parts = x.view(self.world, -1)
        if not self.mem_saving:
            return self._issue_into("reduce_scatter", out, async_op, lambda dst: [
                dist.reduce_scatter_single(dst.view(-1), parts.view(-1), group=pg,
                                           async_op=async_op)
            ])  # fmt: skip

        def reduces() -> list[Any]:
            scratch = self.buffers.get("scratch", (out.numel(),), out)
            for dst in range(self.world):
                scratch.copy_(parts[dst])
                dist.reduce(scratch, group=pg, group_dst=dst)
                if dst == self.rank:
                    out.view(-1).copy_(scratch)
            return []

        return self._issue("reduce_scatter (as reduces)", reduces)

    def broadcast(self, x: torch.Tensor, src: int) -> None:
        """x becomes rank `src`'s x (a group rank), in place."""
        pg = self.pg_for(x)
        self._issue("broadcast", lambda: [dist.broadcast(x, group=pg, group_src=src)]).wait()

    def reduce(self, x: torch.Tensor, dst: int) -> None:
        """Rank `dst`'s x becomes the sum of every rank's (gloo overwrites the others')."""
        pg = self.pg_for(x)
        self._issue("reduce", lambda: [dist.reduce(x, group=pg, group_dst=dst)]).wait()

    def all_reduce(
        self, x: torch.Tensor, async_op: bool = False, op: Any = dist.ReduceOp.SUM
    ) -> _Works:
        pg = self.pg_for(x)
        return self._issue_into("all_reduce", x, async_op, lambda dst: [
            dist.all_reduce(dst, op=op, group=pg, async_op=async_op)
        ])  # fmt: skip


def full_shape(local: torch.Size | tuple[int, ...], n: int) -> tuple[int, ...]:
    """The shape of the N token blocks together: dim -2 (the sequence) times N."""
    shape = list(local)
    shape[SEQ_DIM] *= n
    return tuple(shape)


def _local_shape(full: torch.Size | tuple[int, ...], n: int) -> tuple[int, ...]:
    """The shape of one of N token blocks: dim -2 divided by N."""
    shape = list(full)
    shape[SEQ_DIM] //= n
    return tuple(shape)


def own_tokens(full: torch.Tensor, n: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s block of the flattened tokens of `full` ([..., seq, hidden], any strides,
    broadcast ones included), shaped [..., seq/N, hidden]: a view when `full` is contiguous."""
    local = _local_shape(full.shape, n)
    tokens = full.shape[:-1].numel()
    block = slice(rank * tokens // n, (rank + 1) * tokens // n)
    if full.is_contiguous():
        return full.view(tokens, full.shape[-1])[block].view(local)
    index = torch.arange(block.start, block.stop, device=full.device)
    return full[torch.unravel_index(index, full.shape[:-1])].view(local)


def _gather(x: torch.Tensor, comm: Collectives) -> torch.Tensor:
    out = x.new_empty(full_shape(x.shape, comm.world))
    comm.all_gather(out, x).wait()
    return out


def _reduce_scatter(x: torch.Tensor, comm: Collectives) -> torch.Tensor:
    out = x.new_empty(_local_shape(x.shape, comm.world))
    comm.reduce_scatter(out, x.contiguous()).wait()
    return out


def gather_shards(x: torch.Tensor, group: RankGroup | None = None) -> list[torch.Tensor]:
    """Every rank's `x` (same shape on all), in rank order: consolidating parameter shards."""
    comm = Collectives(group=group)
    out = [torch.empty_like(x) for _ in range(comm.world)]
    with guard("all_gather of a parameter's shards (state_dict)", group):
        dist.all_gather(out, x.contiguous(), group=comm.pg_for(x))
    return out


# -- the boundary functions (Megatron's f and g, and their sequence-parallel cousins) -------------
# Each takes the Collectives of its call (mode and group) and uses them again in backward.


class _GradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        ctx.comm.in_backward().all_reduce(grad).wait()
        return grad, None


class _AllReduceForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        out = x.clone()
        comm.all_reduce(out).wait()
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shape, comm):
        ctx.comm, ctx.shape = comm, x.shape
        # a copy of the block only (own_tokens' view of a contiguous tensor is copied), so
        # the replicated tensor can be freed
        block = own_tokens(x.expand(shape), comm.world, comm.rank)
        shared = block.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        return block.clone() if shared else block

    @staticmethod
    def backward(ctx, grad):
        full = _gather(grad.contiguous(), ctx.comm.in_backward())
        return full.sum_to_size(ctx.shape), None, None


class _GatherFromSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _gather(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return own_tokens(grad, ctx.comm.world, ctx.comm.rank), None


class _AllGatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _gather(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.comm.in_backward()), None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _reduce_scatter(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad.contiguous(), ctx.comm.in_backward()), None


def grad_all_reduce(x: torch.Tensor, *, mem_saving: bool = False, group: RankGroup | None = None):
    """Identity forward, all-reduce backward (Megatron's f): a replicated tensor read by
    rank-local work (a column linear's input; a norm weight on a sequence shard). `group` is
    a `RankGroup` (None: the default group), as for every function here."""
    return _GradAllReduce.apply(x, Collectives(mem_saving, group, "grad_all_reduce"))


def all_reduce_forward(
    x: torch.Tensor, *, mem_saving: bool = False, group: RankGroup | None = None
):
    """All-reduce forward, identity backward (Megatron's g)."""
    return _AllReduceForward.apply(x, Collectives(mem_saving, group, "all_reduce_forward"))


def scatter_to_seq(
    x: torch.Tensor,
    shape: tuple[int, ...] | None = None,
    *,
    mem_saving: bool = False,
    group: RankGroup | None = None,
):
    """A replicated tensor -> this rank's token block; backward all-gathers the blocks. `shape`
    is the tokens' shape x broadcasts to (a [seq, hidden] position embedding added to
    [batch, seq, hidden]): the block is cut from x expanded to it. Default: x's own shape."""
    shape = tuple(x.shape) if shape is None else tuple(shape)
    return _ScatterToSeq.apply(x, shape, Collectives(mem_saving, group, "scatter_to_seq"))


def gather_from_seq(x: torch.Tensor, *, mem_saving: bool = False, group: RankGroup | None = None):
    """Token blocks -> the full tensor for replicated work; backward keeps the own block
    (every rank holds the same gradient of a replicated result)."""
    return _GatherFromSeq.apply(x, Collectives(mem_saving, group, "gather_from_seq"))


def all_gather_seq(x: torch.Tensor, *, mem_saving: bool = False, group: RankGroup | None = None):
    """Token blocks -> the full tensor for sharded work; backward reduce-scatters (it is 2x
    wrong when what reads the result is replicated: use gather_from_seq there)."""
    return _AllGatherSeq.apply(x, Collectives(mem_saving, group, "all_gather_seq"))


def reduce_scatter_seq(
    x: torch.Tensor, *, mem_saving: bool = False, group: RankGroup | None = None
):
    """Partial sums -> this rank's summed token block; backward all-gathers."""
    return _ReduceScatterSeq.apply(x, Collectives(mem_saving, group, "reduce_scatter_seq"))


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
    token block: all-gather (in place: the blocks are the full input's rows), linear;
    backward reduce-scatters grad_input, again in place."""

    @staticmethod
    def forward(ctx, x, weight, bias, sp, async_comm, recompute, comm, transposed):
        ctx.opts = (sp, async_comm, recompute, comm, transposed)
        ctx.has_bias = bias is not None
        if not sp:
            ctx.save_for_backward(x, weight)
            return _matmul(x, weight, bias, transposed)
        n, rank = comm.world, comm.rank
        x = x.contiguous()
        shape = full_shape(x.shape, n)
        if comm.mem_saving:  # block by block: the gathered input never exists
            ctx.save_for_backward(x, weight)
            out_features = weight.shape[1] if transposed else weight.shape[0]
            y = x.new_empty((*shape[:-1], out_features))
            outs = _blocks(y, n)
            for src, block in _each_block(x, comm):
                _matmul(block.view(-1, x.shape[-1]), weight, bias, transposed, out=outs[src])
            return y
        gathered = comm.buffers.get("gather", shape, x) if recompute else x.new_empty(shape)
        if async_comm:  # own rows while the gather runs, then the rest
            work = comm.all_gather(gathered, x, async_op=True)
            out_features = weight.shape[1] if transposed else weight.shape[0]
            y = x.new_empty((*shape[:-1], out_features))
            blocks, inputs = _blocks(y, n), _blocks(gathered, n)
            _matmul(x.view(inputs[rank].shape), weight, bias, transposed, out=blocks[rank])
            work.wait()
            for r in range(n):
                if r != rank:
                    _matmul(inputs[r], weight, bias, transposed, out=blocks[r])
        else:
            comm.all_gather(gathered, x).wait()
            y = _matmul(gathered, weight, bias, transposed)
        ctx.save_for_backward(x if recompute else gathered, weight)
        return y

    @staticmethod
    def backward(ctx, grad):
        sp, async_comm, recompute, comm, transposed = ctx.opts
        saved, weight = ctx.saved_tensors
        comm = comm.in_backward()
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
        grad = grad.contiguous()
        if comm.mem_saving:
            return (*_column_backward_blocks(saved, w, grad, comm, transposed, ctx.has_bias),
                    None, None, None, None, None)  # fmt: skip
        if recompute:  # re-gather while grad_input is computed
            gathered = comm.buffers.get("gather", full_shape(saved.shape, n), saved)
            gathering = comm.all_gather(gathered, saved, async_op=async_comm)
        else:
            gathered, gathering = saved, _Works()
        gx_full = torch.matmul(grad, w.t())  # [..., S, in]: N token blocks, rank-major
        gx = gx_full.new_empty(_local_shape(gx_full.shape, n))
        scattering = comm.reduce_scatter(gx, gx_full, async_op=async_comm)
        gathering.wait()
        gy2d = grad.view(-1, w.shape[1])
        gw = _grad_weight(gathered.view(-1, w.shape[0]), gy2d, transposed)
        gb = gy2d.sum(0) if ctx.has_bias else None
        scattering.wait()
        return gx, gw, gb, None, None, None, None, None


def _blocks(full: torch.Tensor, n: int) -> list[torch.Tensor]:
    """The N token blocks of a contiguous full activation, as [tokens/N, features] views."""
    return list(full.view(-1, full.shape[-1]).chunk(n))


def _each_block(x: torch.Tensor, comm: Collectives) -> Iterator[tuple[int, torch.Tensor]]:
    """(src, rank src's x) for every rank in turn: its own x, else a broadcast into one
    block-sized buffer (reused: each block is done with before the next arrives).
    PatrickStar's memory-saving all-gather, which never holds N blocks at once."""
    room = comm.buffers.get("block", tuple(x.shape), x)
    for src in range(comm.world):
        block = x if src == comm.rank else room  # the root sends its own x
        comm.broadcast(block, src)
        yield src, block


def _reduce_each_block(
    factors: Callable[[int], tuple[torch.Tensor, torch.Tensor]], shape: tuple[int, ...],
    like: torch.Tensor, comm: Collectives,
) -> torch.Tensor:  # fmt: skip
    """Rank r gets the sum over ranks of the product `factors(r)` (of `shape`), each made in
    turn in one buffer and reduced to its rank: a reduce-scatter that never holds N blocks."""
    room = comm.buffers.get("partial", shape, like)
    mine = like.new_empty(shape)
    for dst in range(comm.world):
        part = mine if dst == comm.rank else room  # the root's sum lands in its input
        torch.matmul(*factors(dst), out=part.view(-1, shape[-1]))
        comm.reduce(part, dst)
    return mine


def _column_backward_blocks(x, w, grad, comm, transposed, has_bias):
    """Column linear's backward under sequence parallel and mem_saving: grad_weight summed
    over every rank's block of the input (broadcast one at a time), grad_input reduced to
    each block's rank one block at a time. Two block-sized buffers, never N."""
    gys = _blocks(grad, comm.world)
    gw = None
    for src, block in _each_block(x, comm):
        part = _grad_weight(block.view(-1, w.shape[0]), gys[src], transposed)
        gw = part if gw is None else gw.add_(part)
    gx = _reduce_each_block(lambda dst: (gys[dst], w.t()), tuple(x.shape), x, comm)
    gb = grad.view(-1, w.shape[1]).sum(0) if has_bias else None
    return gx, gw, gb


class _RowLinear(torch.autograd.Function):
    """Row-parallel linear: the weight holds this rank's input features; the input is sharded
    along its features, the partial outputs are summed (all-reduce, or reduce-scatter to
    token blocks, in place). The bias is added once, after the sum; under sequence parallel
    each rank sees only its block's bias gradient, so that gradient is all-reduced."""

    @staticmethod
    def forward(ctx, x, weight, bias, sp, async_comm, comm, transposed):
        ctx.opts = (sp, async_comm, comm, transposed)
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        if sp and comm.mem_saving:  # each block's partial sum made and reduced in turn
            n, w = comm.world, _wt(weight, transposed)
            xs = _blocks(x.contiguous(), n)
            shape = (*_local_shape(x.shape, n)[:-1], w.shape[1])
            y = _reduce_each_block(lambda dst: (xs[dst], w), shape, x, comm)
            return y if bias is None else y + bias
        y = _matmul(x, weight, None, transposed)
        if not sp:
            comm.all_reduce(y).wait()
        else:
            y = _reduce_scatter(y, comm)
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, grad):
        sp, async_comm, comm, transposed = ctx.opts
        x, weight = ctx.saved_tensors
        w = _wt(weight, transposed)  # [in, out]
        comm = comm.in_backward()
        grad = grad.contiguous()
        if not sp:
            gx = torch.matmul(grad, w.t())
            gw = _grad_weight(x.reshape(-1, w.shape[0]), grad.reshape(-1, w.shape[1]), transposed)
            gb = grad.reshape(-1, w.shape[1]).sum(0) if ctx.has_bias else None
            return gx, gw, gb, None, None, None, None
        n, rank = comm.world, comm.rank
        if comm.mem_saving:  # every rank's grad block in turn: grad_input rows, grad_weight
            gx = x.new_empty((*full_shape(grad.shape, n)[:-1], w.shape[0]))
            outs, xs, gw = _blocks(gx, n), _blocks(x.contiguous(), n), None
            for src, block in _each_block(grad, comm):
                block = block.view(-1, w.shape[1])
                torch.matmul(block, w.t(), out=outs[src])
                part = _grad_weight(xs[src], block, transposed)
                gw = part if gw is None else gw.add_(part)
            gb = None
            if ctx.has_bias:
                gb = grad.reshape(-1, w.shape[1]).sum(0)
                comm.all_reduce(gb).wait()
            return gx.view(x.shape), gw, gb, None, None, None, None
        shape = full_shape(grad.shape, n)
        gy = grad.new_empty(shape)
        gathering = comm.all_gather(gy, grad, async_op=async_comm)
        gx = grad.new_empty((*shape[:-1], w.shape[0]))
        grads, outs = _blocks(gy, n), _blocks(gx, n)
        torch.matmul(grad.view(grads[rank].shape), w.t(), out=outs[rank])  # own rows first
        gathering.wait()
        for r in range(n):
            if r != rank:
                torch.matmul(grads[r], w.t(), out=outs[r])
        reducing = _Works()
        gb = None
        if ctx.has_bias:
            gb = grad.reshape(-1, w.shape[1]).sum(0)
            reducing = comm.all_reduce(gb, async_op=async_comm)
        gw = _grad_weight(x.reshape(-1, w.shape[0]), gy.view(-1, w.shape[1]), transposed)
        reducing.wait()
        return gx, gw, gb, None, None, None, None


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
    group: RankGroup | None = None,
) -> torch.Tensor:
    """x @ W_r^T + b_r for this rank's output features W_r (transposed: W_r is [in, out], the
    Conv1D layout). With sequence_parallel, x is this rank's token block [..., S/N, in] and
    the result covers every token [..., S, out/N]. `group`: a `RankGroup`."""
    comm = Collectives(mem_saving, group, "column_linear")
    return _ColumnLinear.apply(
        x, weight, bias, sequence_parallel, async_comm, recompute, comm, transposed
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
    group: RankGroup | None = None,
) -> torch.Tensor:
    """sum over ranks of x_r @ W_r^T, plus b once. x holds this rank's input features. With
    sequence_parallel the result is this rank's token block [..., S/N, out]."""
    comm = Collectives(mem_saving, group, "row_linear")
    return _RowLinear.apply(x, weight, bias, sequence_parallel, async_comm, comm, transposed)
