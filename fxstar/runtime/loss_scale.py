"""Loss scaling for fp16: keep small gradients representable, back off on overflow.

Dynamic scaling as in DeepSpeed and PatrickStar: start at 2**initial_scale_power; an overflow
(a non-finite gradient anywhere) skips the step and, once `hysteresis` overflows have been
seen, halves the scale (never below min_loss_scale); `loss_scale_window` clean steps in a row
double it. A fixed `loss_scale` > 0 disables the dynamics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class LossScaler:
    scale: float = 2.0**16
    dynamic: bool = True
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    clean_steps: int = 0
    overflows_left: int = field(default=2)
    skipped_steps: int = 0

    @classmethod
    def from_config(cls, config: Any) -> LossScaler:
        if config.loss_scale > 0:
            return cls(scale=float(config.loss_scale), dynamic=False)
        return cls(
            scale=2.0**config.initial_scale_power, window=config.loss_scale_window,
            hysteresis=config.hysteresis, overflows_left=config.hysteresis,
            min_scale=config.min_loss_scale,
        )  # fmt: skip

    def update(self, overflow: bool) -> None:
        """After each step's global check: True when a gradient was inf or nan."""
        if overflow:
            self.skipped_steps += 1
            self.clean_steps = 0
            if not self.dynamic:
                return
            self.overflows_left -= 1
            if self.overflows_left <= 0:
                self.scale = max(self.scale / 2, self.min_scale)
                self.overflows_left = self.hysteresis
            return
        self.clean_steps += 1
        if self.dynamic and self.clean_steps % self.window == 0:
            self.scale *= 2
            self.overflows_left = self.hysteresis

    def state_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient flowing back by the scale, so a plain
    `loss.backward()` produces scaled gradients while the loss the user sees is unscaled."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def scale_gradients(loss: torch.Tensor, scale: float) -> torch.Tensor:
    return _ScaleGrad.apply(loss, scale) if scale != 1.0 else loss
