"""The plan's optimizer over an engine's parameters, and one optimizer update.

Adam and AdamW over chunks are HybridAdam (runtime/optim.py), which averages the replicas'
gradients, decides the clip and the fp16 overflow from the model's norm and unscales inside
its one fused step; any other optimizer is torch's, stepped after the same averaging and
clipping done here. Both clip by `runtime/grad_norm.py`'s rule and norm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from fxstar import placement
from fxstar.params import ParameterStore
from fxstar.plan import PlanError
from fxstar.runtime.grad_norm import GradNorm
from fxstar.runtime.optim import HybridAdam

if TYPE_CHECKING:
    from fxstar.engine import Engine

__all__ = ["describe_optimizer", "make_optimizer", "update"]


def make_optimizer(engine: Engine) -> torch.optim.Optimizer:
    """The plan's optimizer over `engine.parameters()`: HybridAdam for Adam/AdamW over chunks,
    else torch's (which cannot update bf16/fp16 chunks)."""
    plan, chunks = engine.plan, engine.chunks
    opt = plan.optimizer
    groups = param_groups(engine.store, opt)
    if chunks is not None and opt.type in ("adam", "adamw"):
        return HybridAdam(
            chunks.step_chunks, groups, lr=opt.lr, betas=opt.betas, eps=opt.eps,
            adamw=opt.type == "adamw", clip_grad_norm=opt.clip_grad_norm,
            scaler=engine.scaler,
            # without a device_memory the budget is made up: no margin to plan from
            hybrid=plan.hybrid_adam and plan.device_memory is not None,
            margin_use_ratio=plan.margin_use_ratio,
            norm=model_grad_norm(engine, own_chunks=True),
            accumulation_steps=opt.accumulation_steps,
            host_budget=placement.HostBudget(plan, engine.program),
            data_parallel=chunks.data_parallel, state_dtype=opt.state_dtype,
            disk=chunks.disk, state_guard=engine.state_guard,
            **({"disk_piece": plan.disk.piece} if plan.disk is not None else {}),
        )  # fmt: skip
    if chunks is not None and chunks.low_precision:
        raise PlanError(
            f"optimizer.type: {opt.type!r} cannot update bf16/fp16 chunks; "
            "use 'adam' or 'adamw' (HybridAdam), or precision 'fp32'"
        )
    return _torch_optimizer(groups, opt)


def update(engine: Engine, optimizer: torch.optim.Optimizer) -> bool:
    """One update of every parameter with a gradient; False when fp16's overflow skipped it.

    Why this order (torch optimizers; HybridAdam fuses the same into its step): every rank
    averages the replicas' gradients first, so every rank clips by the same whole gradients,
    and the optimizer steps on what clipping left."""
    if isinstance(optimizer, HybridAdam):
        return optimizer.step()
    params = list(engine.parameters())
    groups = engine.chunks.data_parallel if engine.chunks is not None else None
    if groups is not None:  # every rank steps every parameter: all get the average
        groups.average([p.grad for p in params if p.grad is not None])
    clip = engine.plan.optimizer.clip_grad_norm
    if clip is not None:
        model_grad_norm(engine, own_chunks=False).clip_(params, clip)
    with engine.state_guard.writing("the optimizer step"):
        return optimizer.step() is not False


def model_grad_norm(engine: Engine, *, own_chunks: bool) -> GradNorm:
    """How this rank's partial sums of squares make the model's (runtime/grad_norm.py): the
    shards tensor parallelism split are summed over its ranks; with `own_chunks` (HybridAdam
    under data parallelism) every sum over the data-parallel ranks too."""
    sharded = set()
    for program in engine.programs.values():
        if program.decisions.tp_sharding is not None:
            sharded |= program.decisions.tp_sharding.params
    tensors = engine.store.tensors()
    groups = engine.chunks.data_parallel if engine.chunks is not None else None
    return GradNorm(engine.topology.tensor_group,
                    [tensors[n] for n in sharded if n in tensors],
                    groups.group if own_chunks and groups is not None else None)  # fmt: skip


def param_groups(store: ParameterStore, opt: Any) -> list[dict[str, Any]]:
    """no_decay parameters in a group of their own; name patterns match the model's names
    (a tile matches what it was cut from)."""
    decay, no_decay = [], []
    for name, p in store.named_parameters():
        if p.requires_grad:
            (decay if opt.decays(store.origin(name)) else no_decay).append(p)
    return [
        {"params": ps, "weight_decay": wd}
        for ps, wd in ((decay, opt.weight_decay), (no_decay, 0.0))
        if ps
    ]


def _torch_optimizer(groups: list[dict[str, Any]], opt: Any) -> torch.optim.Optimizer:
    if opt.type == "adamw":
        return torch.optim.AdamW(groups, lr=opt.lr, betas=opt.betas, eps=opt.eps)
    if opt.type == "adam":
        return torch.optim.Adam(groups, lr=opt.lr, betas=opt.betas, eps=opt.eps)
    if opt.type == "sgd":
        return torch.optim.SGD(groups, lr=opt.lr, momentum=opt.betas[0])
    raise ValueError(f"unknown optimizer type {opt.type!r}")


def describe_optimizer(plan: Any, store: ParameterStore) -> str:
    """What the optimizer does, and where that differs from torch.optim's defaults (a user
    porting a torch loop expects those)."""
    opt = plan.optimizer
    groups = param_groups(store, opt)
    decayed = sum(len(g["params"]) for g in groups if g["weight_decay"])
    exempt = sum(len(g["params"]) for g in groups) - decayed
    line = (
        f"optimizer: {opt.type} lr={opt.lr:g} betas={tuple(opt.betas)} eps={opt.eps:g} "
        f"weight_decay={opt.weight_decay:g}"
    )
    if opt.weight_decay:
        line += f" on {decayed} tensors, none on {exempt} matching no_decay {list(opt.no_decay)}"
    torch_decay = {"adamw": 0.01, "adam": 0.0, "sgd": 0.0}[opt.type]
    if opt.type != "sgd" and opt.weight_decay != torch_decay:
        line += (
            f" (torch.optim.{'AdamW' if opt.type == 'adamw' else 'Adam'}'s default is "
            f"weight_decay={torch_decay:g} on every tensor)"
        )
    return line
