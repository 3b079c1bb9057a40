"""Train the reference GPT through fxstar for a few steps.

The model itself is `fxstar.models.gpt` (so `fxstar train` works from an installed package);
this example shows the three lines a training loop needs.

    python examples/gpt.py
"""

from __future__ import annotations

import torch

import fxstar
from fxstar.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig", "main"]


def main() -> None:
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (4, cfg.block_size))
    targets = torch.randint(0, cfg.vocab_size, (4, cfg.block_size))
    engine = fxstar.compile(model, fxstar.Plan(), example_inputs=(idx, targets))
    for step in range(5):
        loss = engine(idx, targets)
        loss.backward()
        engine.step()
        print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
