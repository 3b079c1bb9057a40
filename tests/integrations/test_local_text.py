"""The local-text data set: a tokenizer trained on the text, fixed blocks of its ids."""

from __future__ import annotations

import pytest
import torch
from trainer_setup import text, tokenizer

from fxstar.integrations.local_text import END_OF_TEXT, TokenBlocks


def test_the_tokenizer_learns_the_text_and_encodes_any():
    ids = tokenizer()(text())["input_ids"]
    assert tokenizer().decode(ids) == text()
    assert len(ids) < 0.6 * len(text().encode())  # merges learnt: fewer tokens than bytes
    trained = tokenizer()
    assert len(trained) <= 320 and trained.eos_token == trained.pad_token == END_OF_TEXT
    unseen = "Zürich ☃"  # bytes the text never had still encode (byte-level alphabet)
    assert trained.decode(trained(unseen)["input_ids"]) == unseen


def test_blocks_are_consecutive_and_labelled_by_their_inputs():
    data = TokenBlocks(list(range(10)), 4)
    assert len(data) == 2  # the remainder of 2 left out
    assert torch.equal(data[1]["input_ids"], torch.tensor([4, 5, 6, 7]))
    assert torch.equal(data[1]["labels"], data[1]["input_ids"])
    with pytest.raises(ValueError, match="3 tokens make no block of 4"):
        TokenBlocks([1, 2, 3], 4)
