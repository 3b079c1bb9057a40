"""The Trainer's optimizer, standing for the engine's update.

The Trainer calls `optimizer.step()` once a window of micro-batches has run forward and
backward, then `model.zero_grad()`. Under fxstar the update is `engine.step()`: it averages,
clips, steps HybridAdam (or a torch optimizer) and zeroes the gradients, once every
`plan.optimizer.accumulation_steps` calls. Here the Trainer decides where a window ends (the
last window of an epoch may be shorter), so `step` moves the engine's micro-step count to the
end of its window and steps: every Trainer step is exactly one engine update, and the
engine's count stays `accumulation_steps` times the Trainer's `global_step`, which its
checkpoints save. The micro-batches in between call nothing: their gradients sum in the
engine's buffers.

Learning-rate schedulers are made over `engine.optimizer` itself (its `param_groups` are the
ones the update reads), not over this object.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from fxstar.runtime.optim import HybridAdam

if TYPE_CHECKING:
    from fxstar.engine import Engine

__all__ = ["EngineOptimizer"]


class EngineOptimizer:
    """`step()` is one engine update; `grad_norm` the norm it clipped by (None if skipped)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.grad_norm: float | None = None
        if isinstance(engine.optimizer, HybridAdam):
            # HybridAdam measures the norm in its update's first read of the gradients
            engine.optimizer.track_grad_norm = True

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.engine.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.engine.optimizer.state

    def step(self, closure: Any = None) -> bool:
        """The engine's update of the gradients summed since the last; False when fp16's loss
        scaler skipped it for an overflow."""
        if closure is not None:
            raise ValueError("the engine's update takes no closure")
        engine, optimizer = self.engine, self.engine.optimizer
        measured = isinstance(optimizer, HybridAdam)
        # a torch optimizer clips without telling the norm: read it before the update
        norm = None if measured else _norm(engine.gradients().values())
        accumulation = engine.plan.optimizer.accumulation_steps
        engine.step_count = (engine.step_count // accumulation + 1) * accumulation - 1
        stepped = engine.step()
        if measured:
            norm = optimizer.last_grad_norm
        self.grad_norm = norm if stepped else None
        return stepped

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad(set_to_none)


def _norm(grads: Any) -> float:
    present = [g for g in grads if g is not None]
    return float(torch.nn.utils.get_total_norm(present)) if present else 0.0
