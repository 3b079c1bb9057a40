"""Tensor-parallel collectives and linears against single-process math, on spawned gloo ranks.

Each world size is one spawn (spawning costs seconds); the workers check everything and
return what the parent asserts on.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F

from fxstar.dist_launch import spawn
from fxstar.runtime import tp_ops
from fxstar.testing.copy_bytes import CopyBytes

B, S, H, OUT = 2, 8, 12, 16
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _full(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, H, generator=g)
    w = torch.randn(OUT, H, generator=g)
    b = torch.randn(OUT, generator=g)
    gy = torch.randn(B, S, OUT, generator=g)
    return x, w, b, gy


def _reference(x, w, b, gy):
    x, w, b = (t.clone().requires_grad_() for t in (x, w, b))
    y = F.linear(x, w, b)
    (y * gy).sum().backward()
    return y.detach(), x.grad, w.grad, b.grad


def _leaf(t):
    return t.detach().clone().contiguous().requires_grad_()


def _block(t, rank, n):
    """This rank's sequence-parallel token block of a full [B, S, ...] tensor."""
    return tp_ops.own_tokens(t, n, rank)


def _check_column(rank, n, sp, async_comm, recompute, mem_saving, transposed):
    x, w, b, gy = _full()
    y_ref, gx_ref, gw_ref, gb_ref = _reference(x, w, b, gy)
    out_slice = slice(rank * OUT // n, (rank + 1) * OUT // n)
    x_in = _leaf(_block(x, rank, n) if sp else x)
    w_r = w[out_slice]
    w_in = _leaf(w_r.t() if transposed else w_r)
    b_in = _leaf(b[out_slice])
    y = tp_ops.column_linear(
        x_in, w_in, b_in, sequence_parallel=sp, async_comm=async_comm, recompute=recompute,
        mem_saving=mem_saving, transposed=transposed,
    )  # fmt: skip
    (y * gy[..., out_slice]).sum().backward()
    torch.testing.assert_close(y, y_ref[..., out_slice], **TOL)
    torch.testing.assert_close(x_in.grad, _block(gx_ref, rank, n) if sp else gx_ref, **TOL)
    gw = w_in.grad.t() if transposed else w_in.grad
    torch.testing.assert_close(gw, gw_ref[out_slice], **TOL)
    torch.testing.assert_close(b_in.grad, gb_ref[out_slice], **TOL)


def _check_row(rank, n, sp, async_comm, mem_saving, transposed):
    # y = x @ w^T with x [B,S,OUT] sharded on features, w [H, OUT] sharded on columns
    x, w, b, gy = _full(1)
    x, w, b, gy = gy, w.t().contiguous(), b[:H], x  # reuse shapes: in=OUT, out=H
    y_ref, gx_ref, gw_ref, gb_ref = _reference(x, w, b, gy)
    in_slice = slice(rank * OUT // n, (rank + 1) * OUT // n)
    x_in = _leaf(x[..., in_slice])
    w_r = w[:, in_slice]
    w_in = _leaf(w_r.t() if transposed else w_r)
    b_in = _leaf(b)
    y = tp_ops.row_linear(x_in, w_in, b_in, sequence_parallel=sp, async_comm=async_comm,
                      mem_saving=mem_saving, transposed=transposed)  # fmt: skip
    # the replicated loss is counted once: each rank backpropagates its own part of it
    g = _block(gy, rank, n) if sp else gy
    (y * g).sum().backward()
    torch.testing.assert_close(y, _block(y_ref, rank, n) if sp else y_ref, **TOL)
    torch.testing.assert_close(x_in.grad, gx_ref[..., in_slice], **TOL)
    gw = w_in.grad.t() if transposed else w_in.grad
    torch.testing.assert_close(gw, gw_ref[:, in_slice], **TOL)
    torch.testing.assert_close(b_in.grad, gb_ref, **TOL)


def _check_boundaries(rank, n, mem_saving):
    x, _, _, _ = _full(2)
    # scatter (backward all-gathers) then gather (backward keeps the own slice): identity
    xr = _leaf(x)
    local = tp_ops.scatter_to_seq(xr, mem_saving=mem_saving)
    torch.testing.assert_close(local, _block(x, rank, n))
    full = tp_ops.gather_from_seq(local * 2, mem_saving=mem_saving)
    torch.testing.assert_close(full, x * 2)
    full.sum().backward()
    torch.testing.assert_close(xr.grad, torch.full_like(x, 2.0))
    # all_gather_seq before replicated work doubles the gradient (why sites choose)
    xl = _leaf(_block(x, rank, n))
    tp_ops.all_gather_seq(xl, mem_saving=mem_saving).sum().backward()
    torch.testing.assert_close(xl.grad, torch.full_like(xl, float(n)))
    # reduce_scatter_seq sums partials; backward all-gathers
    xp = _leaf(x * (rank + 1))
    out = tp_ops.reduce_scatter_seq(xp, mem_saving=mem_saving)
    torch.testing.assert_close(out, _block(x * sum(range(1, n + 1)), rank, n), **TOL)
    out.sum().backward()
    torch.testing.assert_close(xp.grad, torch.ones_like(x))
    # a [S, H] tensor added to [B, S, H] tokens (a position embedding): the block is cut
    # from it broadcast; backward sums the batch's gradients
    pos = _leaf(x[0])
    local = tp_ops.scatter_to_seq(pos, (B, S, H), mem_saving=mem_saving)
    torch.testing.assert_close(local, _block(x[0].expand(B, S, H), rank, n))
    tp_ops.gather_from_seq(local, mem_saving=mem_saving).sum().backward()
    torch.testing.assert_close(pos.grad, torch.full_like(pos, float(B)))
    # f and g
    p = _leaf(torch.ones(3))
    (tp_ops.grad_all_reduce(p, mem_saving=mem_saving) * (rank + 1)).sum().backward()
    torch.testing.assert_close(p.grad, torch.full((3,), float(sum(range(1, n + 1)))))
    q = _leaf(torch.full((3,), float(rank)))
    r = tp_ops.all_reduce_forward(q, mem_saving=mem_saving)
    torch.testing.assert_close(r, torch.full((3,), float(sum(range(n)))))
    r.sum().backward()
    torch.testing.assert_close(q.grad, torch.ones(3))


def _saved_bytes(rank, n, recompute):
    x, w, b, _ = _full()
    x_in, w_in = _leaf(_block(x, rank, n)), _leaf(w[: OUT // n])
    params = {w_in.untyped_storage().data_ptr()}
    saved = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = tp_ops.column_linear(x_in, w_in, None, sequence_parallel=True, recompute=recompute)
    y.sum().backward()
    return sum(saved.values())


def _layout_copies(rank, n):
    """Copies the sequence-parallel linears and boundaries make, forward and backward, per
    mode (sync/async x keep/recompute): none, the blocks are the full tensors' rows."""
    x, w, b, gy = _full()
    copies = {}
    for async_comm, recompute in itertools.product((False, True), repeat=2):
        x_in, w_in, b_in = _leaf(_block(x, rank, n)), _leaf(w[: OUT // n]), _leaf(b[: OUT // n])
        w_row = _leaf(w[: OUT // n].t())  # [H, OUT/N]: the row linear's input features
        grad_out = gy[..., :H].contiguous()
        with CopyBytes() as log:
            y = tp_ops.column_linear(x_in, w_in, b_in, sequence_parallel=True,
                                 async_comm=async_comm, recompute=recompute)  # fmt: skip
            z = tp_ops.row_linear(y, w_row, None, sequence_parallel=True, async_comm=async_comm)
            out = tp_ops.gather_from_seq(z)
            torch.autograd.grad(out, (x_in, w_in, b_in, w_row), grad_out)
        copies[(async_comm, recompute)] = log.copies
    return copies


def _worker(rank, n, full):
    torch.manual_seed(0)
    if full:
        for sp, async_comm, recompute in itertools.product((False, True), repeat=3):
            _check_column(rank, n, sp, async_comm, recompute, False, False)
        _check_column(rank, n, True, True, True, False, True)  # Conv1D layout
        _check_column(rank, n, True, False, False, True, False)  # mem_saving_comm
        for sp, async_comm in itertools.product((False, True), repeat=2):
            _check_row(rank, n, sp, async_comm, False, False)
        _check_row(rank, n, True, True, False, True)
        _check_row(rank, n, True, False, True, False)
    _check_column(rank, n, True, True, True, True, False)
    _check_row(rank, n, True, True, True, False)
    for mem_saving in (False, True) if full else (False,):
        _check_boundaries(rank, n, mem_saving)
    return {"keep": _saved_bytes(rank, n, False), "recompute": _saved_bytes(rank, n, True),
            "copies": _layout_copies(rank, n)}  # fmt: skip


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_collectives_and_linears_match_single_process(world_size):
    results = spawn(_worker, world_size, world_size == 2)
    gathered = B * S * H * 4  # bytes of the gathered input
    for r in results:
        assert r["keep"] - r["recompute"] == gathered * (world_size - 1) // world_size
        assert r["recompute"] == gathered // world_size  # only the own shard is saved
        # no stack/cat around the collectives: gathers and scatters work in place
        assert r["copies"] == dict.fromkeys(r["copies"], []), r["copies"]
