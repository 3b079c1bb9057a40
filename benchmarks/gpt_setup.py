"""The benchmark GPT's command-line options and construction, shared by the benchmarks that
train the reference GPT (chunks.py, step.py, device_check.py)."""

from __future__ import annotations

import argparse

import torch

from fxstar.models.gpt import GPT, GPTConfig


def add_gpt_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)


def make_gpt(args: argparse.Namespace) -> tuple[GPT, torch.Tensor, torch.Tensor]:
    """The model (same weights every call: seeded) and one batch of (idx, targets)."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq_len, n_layer=args.layers,
                    n_head=args.heads, n_embd=args.width, dropout=0.0)  # fmt: skip
    idx = torch.randint(0, cfg.vocab_size, (args.batch_size, cfg.block_size))
    targets = torch.randint(0, cfg.vocab_size, (args.batch_size, cfg.block_size))
    return GPT(cfg), idx, targets
