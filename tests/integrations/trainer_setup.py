"""A Llama and a GPT-2 from small configs, transformers' defaults otherwise (use_cache, GPT-2's
dropout and tied head), and fxstar's small text cut into 16-token blocks by a tokenizer
trained on it: nothing is downloaded. (Not a conftest.py: tests import the top one as
`conftest`.)"""

from __future__ import annotations

import functools
from importlib import resources

import torch
import transformers

from fxstar.integrations.local_text import TokenBlocks, train_tokenizer

BLOCK = 16


@functools.cache
def text() -> str:
    return resources.files("fxstar.data").joinpath("tiny.txt").read_text(encoding="utf-8")


@functools.cache
def tokenizer():
    return train_tokenizer(text(), 320)


@functools.cache
def blocks() -> TokenBlocks:
    return TokenBlocks(tokenizer()(text())["input_ids"], BLOCK)


def make_model(family: str) -> torch.nn.Module:
    """The family's model ('llama' or 'gpt2'), seeded alike each call."""
    vocab = len(tokenizer())
    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=vocab, n_positions=64, n_embd=32, n_layer=2,
                                         n_head=4)  # fmt: skip
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)
