"""The C++ CPU Adam from Python: torch tensors in, thread count and defaults filled in.

The kernels read and write in one pass over memory; `grad_stats` is the read-only companion
pass that gives the global clip norm and the overflow decision before any update is written.

`num_threads`: None picks `default_threads`; below 1 is a ValueError; above `_C.max_threads()`
(4 per hardware thread) it is clamped, since OpenMP would start every thread asked for.
Hyperparameters that would give NaN parameters (non-finite, eps <= 0) are a ValueError.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fxstar import _C


class GradStats(NamedTuple):
    sum_sq: float  # sum of squares of the gradient, accumulated in double
    finite: bool  # every element finite (no inf, no nan)


ELEMENTS_PER_THREAD = 1 << 18  # below this a second thread costs more than it saves


def default_threads(numel: int | None = None) -> int:
    """As many threads as torch's intra-op pool, but one per 256K elements at most: waking an
    OpenMP team costs tens of microseconds, and on a busy machine a barrier can wait a whole
    scheduler slice for a descheduled thread."""
    threads = torch.get_num_threads()
    if numel is not None:
        threads = min(threads, max(1, numel // ELEMENTS_PER_THREAD))
    return threads


def _threads(num_threads: int | None, numel: int | None = None) -> int:
    # `is None`, not `or`: 0 is an error the kernel reports, not a request for the default
    return default_threads(numel) if num_threads is None else num_threads


def _plain(t: torch.Tensor | None) -> torch.Tensor | None:
    # DLPack refuses tensors that require grad; the kernels update storage, not autograd state.
    return t.detach() if t is not None and t.requires_grad else t


def adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adamw: bool = True,
    grad_scale: float = 1.0,
    out: torch.Tensor | None = None,
    num_threads: int | None = None,
    variant: str | None = None,
) -> None:
    """One Adam (or AdamW) update of fp32 `param` and of `exp_avg`, `exp_avg_sq` (both fp32,
    or both bf16: computed in fp32, stored rounded to nearest even) in place.

    `grad` may be fp32, bf16 or fp16; it is multiplied by `grad_scale` (1/loss_scale times the
    clip factor) before use. If `out` (bf16/fp16) is given, the updated parameter is also
    written there, rounded as `param.to(out.dtype)` would; `out` may be `grad` itself (a
    gradient in its parameters' room), which it then overwrites.
    """
    _run(
        _C.adam_step,
        param,
        grad,
        (exp_avg, exp_avg_sq),
        step=step,
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        adamw=adamw,
        grad_scale=grad_scale,
        out=out,
        num_threads=num_threads,
        variant=variant,
    )


def adam_step_8bit(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg_codes: torch.Tensor,
    exp_avg_absmax: torch.Tensor,
    exp_avg_sq_codes: torch.Tensor,
    exp_avg_sq_absmax: torch.Tensor,
    *,
    step: int,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adamw: bool = True,
    grad_scale: float = 1.0,
    out: torch.Tensor | None = None,
    num_threads: int | None = None,
    variant: str | None = None,
) -> None:
    """`adam_step` with both moments 8-bit blockwise-quantised: uint8 codes of `param`'s
    size and an fp32 absmax per `_C.QUANT_BLOCK` values, the blocks counted from `param`'s
    first element (runtime/moments.py lays them out)."""
    moments = (exp_avg_codes, exp_avg_absmax, exp_avg_sq_codes, exp_avg_sq_absmax)
    _run(
        _C.adam_step_8bit,
        param,
        grad,
        moments,
        step=step,
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        adamw=adamw,
        grad_scale=grad_scale,
        out=out,
        num_threads=num_threads,
        variant=variant,
    )


def _run(
    kernel,
    param,
    grad,
    moments,
    *,
    step,
    lr,
    betas,
    eps,
    weight_decay,
    adamw,
    grad_scale,
    out,
    num_threads,
    variant,
) -> None:
    """One call of a C++ Adam kernel: the arguments both formats take, in its names."""
    kernel(
        _plain(param),
        _plain(grad),
        *moments,
        lr=lr,
        beta1=betas[0],
        beta2=betas[1],
        eps=eps,
        weight_decay=weight_decay,
        step=step,
        adamw=adamw,
        grad_scale=grad_scale,
        out=_plain(out),
        num_threads=_threads(num_threads, param.numel()),
        variant=variant or "",
    )


def grad_stats(
    grad: torch.Tensor, *, num_threads: int | None = None, variant: str | None = None
) -> GradStats:
    """Sum of squares and finiteness of a gradient buffer, in one read."""
    threads = _threads(num_threads, grad.numel() // 4)  # a read-only pass
    sum_sq, finite = _C.grad_stats(_plain(grad), num_threads=threads, variant=variant or "")
    return GradStats(sum_sq, finite)


def adam_traffic(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    num_threads: int | None = None,
    variant: str | None = None,
) -> None:
    """Adam's memory traffic (28 bytes per element) with trivial arithmetic: the roofline.

    It overwrites its arguments; use scratch buffers.
    """
    _C.adam_traffic(
        _plain(param),
        _plain(grad),
        exp_avg,
        exp_avg_sq,
        num_threads=_threads(num_threads),
        variant=variant or "",
    )


def available_variants() -> list[str]:
    """Instruction-set variants of the kernels this CPU can run, best first."""
    return list(_C.available_variants())


def selected_variant() -> str:
    """The variant used when none is named: the best available, or the one the environment
    variable FXSTAR_CPU_VARIANT names. A name there that is not a variant this CPU runs is a
    ValueError listing those it does, here and at every kernel call that uses the default."""
    return _C.selected_variant()
