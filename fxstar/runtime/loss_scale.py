"""Loss scaling for fp16: keep small gradients representable, back off on overflow.

Dynamic scaling as in DeepSpeed and PatrickStar: start at 2**initial_scale_power; an overflow
(a non-finite gradient anywhere) skips the step and, once `hysteresis` overflows have been
seen, halves the scale (never below min_loss_scale); `loss_scale_window` clean steps in a row
double it. A fixed `loss_scale` > 0 disables the dynamics.

Skipping is silent by design, so a run whose every step overflows (a NaN loss, too high an lr)
would otherwise train nothing without a word: `warn_after` skips in a row warn once per streak.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from fxstar.errors import CheckpointError


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
    warn_after: int = 10  # consecutive skips that warn; 0 = never
    skip_streak: int = 0

    @classmethod
    def from_config(cls, config: Any) -> LossScaler:
        if config.loss_scale > 0:
            return cls(scale=float(config.loss_scale), dynamic=False,
                       warn_after=config.warn_after_skips)  # fmt: skip
        return cls(
            scale=2.0**config.initial_scale_power, window=config.loss_scale_window,
            hysteresis=config.hysteresis, overflows_left=config.hysteresis,
            min_scale=config.min_loss_scale, warn_after=config.warn_after_skips,
        )  # fmt: skip

    def update(self, overflow: bool) -> None:
        """After each step's global check: True when a gradient was inf or nan."""
        if overflow:
            self.skipped_steps += 1
            self.clean_steps = 0
            self.skip_streak += 1
            if self.skip_streak == self.warn_after:
                self._warn()
            if not self.dynamic:
                return
            self.overflows_left -= 1
            if self.overflows_left <= 0:
                self.scale = max(self.scale / 2, self.min_scale)
                self.overflows_left = self.hysteresis
            return
        self.clean_steps += 1
        self.skip_streak = 0
        if self.dynamic and self.clean_steps % self.window == 0:
            self.scale *= 2
            self.overflows_left = self.hysteresis

    def _warn(self) -> None:
        floor = f" (min_loss_scale {self.min_scale:g})" if self.dynamic else " (fixed)"
        warnings.warn(
            f"fp16: the last {self.skip_streak} optimizer steps were all skipped because a "
            f"gradient was inf or nan; the loss scale is {self.scale:g}{floor}. If the loss "
            "itself is inf/nan, or the scale sits at its floor, scaling cannot fix it: check "
            "the inputs and the lr, or train in bf16 (loss_scale.warn_after_skips sets when "
            "this warns)",
            RuntimeWarning,
            stacklevel=3,
        )

    def state_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Only the scaler's own fields: a damaged or edited checkpoint must not set arbitrary
        attributes."""
        known = [f.name for f in fields(self)]
        unknown = sorted(set(state) - set(known))
        if unknown:
            raise CheckpointError(
                f"loss scaler state has unknown fields {', '.join(map(repr, unknown))} (a "
                f"LossScaler has {', '.join(known)}): the checkpoint's training.json was edited "
                "or damaged; restore it from a copy, or save the checkpoint again"
            )
        for key, value in state.items():
            setattr(self, key, value)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient flowing back by the scale, so a plain
    `loss.backward()` produces scaled gradients while the loss the user sees is unscaled. The
    loss comes out as a copy, not a view: callers may change it in place (the Hugging Face
    Trainer multiplies it by the number of processes), which autograd refuses on a custom
    Function's view."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return loss.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def scale_gradients(loss: torch.Tensor, scale: float) -> torch.Tensor:
    return _ScaleGrad.apply(loss, scale) if scale != 1.0 else loss
