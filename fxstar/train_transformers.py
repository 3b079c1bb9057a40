"""The job behind `fxstar train --model-config DIR`: a transformers causal language model built
from a local config directory (fresh weights; nothing is downloaded), trained on a local text.

The tokenizer comes from a local directory, or is a byte-level BPE trained on the text itself
(fxstar.integrations.local_text). The text's token ids are cut into blocks of `seq_len`; the
last tenth is held out, and a batch is `batch_size` blocks drawn at random (labels are the
inputs: the model shifts them). It trains through `fxstar.compile` as the reference GPT's job
does (fxstar/train.py: the progress bar, the log, the engine's report) and ends with the loss
on held-out blocks beside a uniform guess's.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from fxstar.errors import UsageError
from fxstar.plan import Plan
from fxstar.train import TrainResult, compile_engine, finish, load_text, run_steps

TRAINED_VOCAB = 1024  # tokens of a BPE trained on the text (at most the config's vocabulary)
BYTES = 256  # a byte-level BPE's alphabet: the fewest tokens one can have, besides its special
EVAL_BATCHES = 4


@dataclass
class TransformersRun:
    model_config: str  # a directory holding a transformers config.json
    data: str | None = None  # a text file; None: the text that ships with fxstar
    tokenizer: str | None = None  # a tokenizer directory; None: trained on the text
    steps: int = 200
    batch_size: int = 8
    seq_len: int = 64
    seed: int = 0
    log_every: int = 10
    timeline: str | None = None  # write the memory timeline PNG here (chunk engine only)


class TokenData:
    """A text's token ids in blocks of `seq_len`; the last tenth held out for evaluation."""

    def __init__(self, ids: list[int], seq_len: int, seed: int):
        from fxstar.integrations.local_text import TokenBlocks

        blocks = len(ids) // seq_len
        if blocks < 2:
            raise UsageError(
                f"--data: the text makes {len(ids)} tokens, too few for --seq-len {seq_len} "
                f"(needs at least {2 * seq_len}: a block to train on, one held out)"
            )
        split = min(blocks - 1, max(1, int(blocks * 0.9))) * seq_len
        self.train = TokenBlocks(ids[:split], seq_len)
        self.held_out = TokenBlocks(ids[split:], seq_len)
        self.generator = torch.Generator().manual_seed(seed)

    def batch(self, batch_size: int, held_out: bool = False) -> dict[str, torch.Tensor]:
        blocks = self.held_out if held_out else self.train
        picks = torch.randint(0, len(blocks), (batch_size,), generator=self.generator)
        ids = torch.stack([blocks[int(i)]["input_ids"] for i in picks])
        return {"input_ids": ids, "labels": ids.clone()}


def train_transformers(run: TransformersRun, plan: Plan, *, progress: bool = True) -> TrainResult:
    """Build the config's model, train it `run.steps` steps on the text and evaluate it."""
    from transformers import AutoModelForCausalLM

    config = _config(run.model_config)
    text = load_text(run.data)
    tokenizer = _tokenizer(run.tokenizer, text, config.vocab_size)
    ids = tokenizer(text)["input_ids"]
    too_large = max(ids, default=0)
    if too_large >= config.vocab_size:
        raise UsageError(
            f"--tokenizer {run.tokenizer}: it gives token {too_large}, beyond the model's "
            f"vocabulary of {config.vocab_size} (config.json's vocab_size)"
        )
    data = TokenData(ids, run.seq_len, run.seed)
    torch.manual_seed(run.seed)
    try:
        model = AutoModelForCausalLM.from_config(config)
    except ValueError as error:  # no causal language model for this config
        raise UsageError(f"--model-config {run.model_config}: {error}") from None
    n_params = sum(p.numel() for p in model.parameters())
    source = "trained on the text" if run.tokenizer is None else f"from {run.tokenizer}"
    print(f"{type(model).__name__}: {n_params / 1e6:.2f}M parameters; tokenizer {source} "
          f"({len(tokenizer)} tokens): {len(ids):,} tokens of text; batch {run.batch_size} x "
          f"{run.seq_len} tokens")  # fmt: skip
    result = TrainResult()
    first = data.batch(run.batch_size)
    engine = compile_engine(model, plan, (), first, result)

    def batch(step: int) -> tuple[tuple, dict[str, Any]]:
        return (), first if step == 0 else data.batch(run.batch_size)

    tokens = run.batch_size * run.seq_len
    elapsed = run_steps(engine, batch, run.steps, run.log_every, progress, result, tokens)
    result.tokens_per_second = result.steps_per_second * tokens
    engine.eval()
    with torch.no_grad():
        held_out = [engine(**data.batch(run.batch_size, held_out=True)).loss.item()
                    for _ in range(EVAL_BATCHES)]  # fmt: skip
    engine.train()
    result.eval_loss = sum(held_out) / len(held_out)
    uniform = math.log(len(tokenizer))
    print(f"trained {run.steps} steps in {elapsed:.1f}s ({result.tokens_per_second:,.0f} "
          f"tokens/s); train loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}, held-out "
          f"loss {result.eval_loss:.3f} (uniform guess: {uniform:.3f})")  # fmt: skip
    finish(engine, result, run.timeline)
    return result


def _config(directory: str) -> Any:
    """The transformers config of `directory` (its config.json), or a UsageError."""
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise UsageError(f"--model-config {directory}: no config.json there")
    try:
        return AutoConfig.from_pretrained(directory)
    except (OSError, ValueError) as error:
        raise UsageError(f"--model-config {directory}: {error}") from None


def _tokenizer(directory: str | None, text: str, vocab_size: int) -> Any:
    """The tokenizer of `directory`, or a byte-level BPE trained on `text` within the model's
    vocabulary."""
    if directory is not None:
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(directory)
        except (OSError, ValueError) as error:
            raise UsageError(f"--tokenizer {directory}: {error}") from None
    if vocab_size <= BYTES:
        raise UsageError(
            f"the model's vocabulary has {vocab_size} tokens, too few for a tokenizer trained on "
            f"the text (a byte-level BPE needs {BYTES + 1}); give --tokenizer DIR"
        )
    from fxstar.integrations.local_text import train_tokenizer

    return train_tokenizer(text, vocab_size=min(vocab_size, TRAINED_VOCAB))
