"""A Llama and a GPT-2 from small configs, transformers' defaults otherwise (use_cache, GPT-2's
dropout and tied head), and fxstar's small text cut into 16-token blocks by a tokenizer
trained on it: nothing is downloaded."""

from __future__ import annotations

from importlib import resources

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

BLOCK = 16


@pytest.fixture(scope="session")
def text() -> str:
    return resources.files("fxstar.data").joinpath("tiny.txt").read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def tokenizer(text):
    from fxstar.integrations.local_text import train_tokenizer

    return train_tokenizer(text, 320)


@pytest.fixture(scope="session")
def blocks(tokenizer, text):
    from fxstar.integrations.local_text import TokenBlocks

    return TokenBlocks(tokenizer(text)["input_ids"], BLOCK)


@pytest.fixture(scope="session")
def make_model(tokenizer):
    """make_model(family): the family's model, seeded alike each call."""
    import transformers

    def make(family: str) -> torch.nn.Module:
        vocab = len(tokenizer)
        torch.manual_seed(0)
        if family == "gpt2":
            config = transformers.GPT2Config(vocab_size=vocab, n_positions=64, n_embd=32,
                                             n_layer=2, n_head=4)  # fmt: skip
            return transformers.GPT2LMHeadModel(config)
        config = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config)

    return make
