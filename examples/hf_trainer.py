"""Train a transformers Llama with Hugging Face's Trainer, its parameters paged by fxstar.

The Trainer code stays as it is; `FxstarTrainer` takes one more argument, the plan. Nothing is
downloaded: the tokenizer is trained on fxstar's small text, and the model is built from a
small config (transformers' defaults otherwise). Checkpoints go to a temporary directory
unless one is given.

    python examples/hf_trainer.py [OUTPUT_DIR]
"""

from __future__ import annotations

import sys
import tempfile
from importlib import resources

import torch
from torch.utils.data import Subset
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

import fxstar
from fxstar.integrations.local_text import TokenBlocks, train_tokenizer
from fxstar.integrations.transformers import FxstarTrainer

__all__ = ["main"]


def main(output_dir: str | None = None, steps: int = 20) -> None:
    text = resources.files("fxstar.data").joinpath("tiny.txt").read_text(encoding="utf-8")
    tokenizer = train_tokenizer(text, vocab_size=320)
    blocks = TokenBlocks(tokenizer(text)["input_ids"], length=32)
    held_out = Subset(blocks, range(8))  # a real run holds out text it does not train on

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64)  # fmt: skip
    model = LlamaForCausalLM(config)

    with tempfile.TemporaryDirectory() as scratch:
        args = TrainingArguments(
            output_dir=output_dir or scratch,
            max_steps=steps,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            learning_rate=3e-3,
            warmup_steps=2,
            logging_steps=5,
            eval_strategy="steps",
            eval_steps=10,
            save_steps=10,
            report_to="none",
            disable_tqdm=True,
        )
        trainer = FxstarTrainer(
            model=model,
            args=args,
            train_dataset=blocks,
            eval_dataset=held_out,
            processing_class=tokenizer,
            # the parameters paged through the smallest compute-tier budget that runs,
            # activations checkpointed at each decoder layer
            plan=fxstar.Plan(device_memory="auto", checkpoint="blocks"),
        )
        trainer.train()
        for entry in trainer.state.log_history:
            if "loss" in entry:
                print(f"step {entry['step']}: loss {entry['loss']:.4f}, "
                      f"{entry['tokens_per_second']:,.0f} tokens/s, "
                      f"host {entry['host_mib']:.2f} MiB, "
                      f"compute chunks {entry['compute_chunks_peak_mib']:.2f} MiB")  # fmt: skip
            if "eval_loss" in entry:
                print(f"step {entry['step']}: eval loss {entry['eval_loss']:.4f}")
        trainer.save_model()  # a model directory from_pretrained opens
        trainer.engine.close()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
