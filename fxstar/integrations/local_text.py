"""A language-modelling data set from a local text, with a tokenizer trained on that text.

For runs that must not download anything (tests, examples, machines without a hub): a
byte-level BPE tokenizer trained by `tokenizers` on the text itself, wrapped as transformers'
`PreTrainedTokenizerFast` (so a Trainer saves it beside the model), and the text's token ids
cut into fixed-length blocks whose labels are their inputs (causal LMs shift them).
"""

from __future__ import annotations

import torch

__all__ = ["TokenBlocks", "train_tokenizer"]

END_OF_TEXT = "<|endoftext|>"


def train_tokenizer(text: str, vocab_size: int = 512):
    """A byte-level BPE tokenizer of at most `vocab_size` tokens learnt from `text`: the 256
    bytes (any text encodes), merges up to `vocab_size`, and one special token (end of
    text, also used for padding)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([text], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=END_OF_TEXT, pad_token=END_OF_TEXT
    )


class TokenBlocks(torch.utils.data.Dataset):
    """`ids` cut into consecutive blocks of `length` tokens (the remainder left out), each an
    example {'input_ids', 'labels'} with labels equal to the inputs."""

    def __init__(self, ids: list[int] | torch.Tensor, length: int):
        ids = torch.as_tensor(ids, dtype=torch.long)
        count = len(ids) // length
        if count == 0:
            raise ValueError(f"{len(ids)} tokens make no block of {length}")
        self.blocks = ids[: count * length].view(count, length)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        block = self.blocks[index]
        return {"input_ids": block, "labels": block.clone()}
