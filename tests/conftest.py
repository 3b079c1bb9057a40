"""Shared small models: the example GPT, and transformers GPT-2 / Llama from tiny configs.

Nothing is downloaded: transformers models are built from configs in code. Tests that need
transformers skip cleanly when it is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

VOCAB, BATCH, SEQ = 64, 2, 16
GOLDEN = os.path.join(os.path.dirname(__file__), "golden")


def check_golden(name: str, text: str) -> None:
    """Compare with tests/golden/<name>; FXSTAR_UPDATE_GOLDEN=1 rewrites the file."""
    path = os.path.join(GOLDEN, name)
    if os.environ.get("FXSTAR_UPDATE_GOLDEN") == "1":
        os.makedirs(GOLDEN, exist_ok=True)
        with open(path, "w", encoding="utf-8") as file:
            file.write(text)
    with open(path, encoding="utf-8") as file:
        assert text == file.read(), f"{name} changed; FXSTAR_UPDATE_GOLDEN=1 to accept"


def tiny_gpt(seed: int = 0, dropout: float = 0.1) -> torch.nn.Module:
    from fxstar.models.gpt import GPT, GPTConfig

    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=32,
                    dropout=dropout)  # fmt: skip
    return GPT(cfg)


def hf_gpt2(seed: int = 0) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ * 2, n_embd=32, n_layer=2, n_head=2,
        use_cache=False, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


def hf_llama(seed: int = 0) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ * 2,
        tie_word_embeddings=True, use_cache=False, bos_token_id=0, eos_token_id=0,
        pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def tokens(seed: int = 1, batch: int = BATCH, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets): two distinct integer tensors."""
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, VOCAB, (batch, seq), generator=g),
        torch.randint(0, VOCAB, (batch, seq), generator=g),
    )


@pytest.fixture
def gpt_factory():
    return tiny_gpt


# The hand-written GPT takes (idx, targets) and returns the loss; transformers models take
# keyword inputs and return an output with .loss. These let one test body drive both.


def call(kind: str, model, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss of `model` ('gpt' or a transformers model) on one batch."""
    if kind == "gpt":
        return model(ids, targets)
    return model(input_ids=ids, labels=targets).loss


def seeded_backward(kind: str, model, ids: torch.Tensor, targets: torch.Tensor, seed: int):
    """The loss of one forward on `seed` (dropout draws replay), after its backward."""
    torch.manual_seed(seed)
    loss = call(kind, model, ids, targets)
    loss.backward()
    return loss


def close_in_norm(got: torch.Tensor, want: torch.Tensor, rel: float) -> bool:
    """A low-precision gradient against fp32 eager: within `rel` of it in norm, with a floor
    for gradients that are zero but for rounding (attention key biases)."""
    got = got.float()
    return bool((got - want).norm() <= rel * want.norm() + 1e-4 * want.numel() ** 0.5)


def example(kind: str, ids: torch.Tensor, targets: torch.Tensor) -> dict:
    """The example inputs for fxstar.compile, as keyword arguments of it."""
    if kind == "gpt":
        return {"example_inputs": (ids, targets)}
    return {"example_kwargs": {"input_ids": ids, "labels": targets}}


def inputs(make) -> tuple[tuple, dict]:
    """(args, kwargs) of one batch for a model factory from this file."""
    ids, targets = tokens()
    if make is tiny_gpt:
        return (ids, targets), {}
    return (), {"input_ids": ids, "labels": targets}


def assert_same_step(kind: str, eager, engine, step: int) -> None:
    """One forward and backward of the eager model and of the engine on batch `step`, with the
    same seed (dropout replays): the loss and every gradient bitwise equal."""
    ids, targets = tokens(seed=step)
    torch.manual_seed(step)
    expected = call(kind, eager, ids, targets)
    expected.backward()
    torch.manual_seed(step)
    loss = call(kind, engine, ids, targets)
    loss.backward()
    assert torch.equal(loss, expected), step
    pairs = zip(eager.named_parameters(), engine.named_parameters(), strict=True)
    for (name, p), (other, q) in pairs:
        assert name == other
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad), (step, name)


def activation_budget(factory, share: float, **compile_kwargs) -> int:
    """A device_memory for tests that page parameters: the activations' measured peak (with
    room for the largest temporary) plus `share` of the parameter bytes."""
    from fxstar.engine import compile
    from fxstar.passes.chunk_layout import nonmodel_peak
    from fxstar.plan import Plan

    program = compile(factory(), Plan(passes=["shape_memory"]), **compile_kwargs).program
    return nonmodel_peak(program) + int(share * program.param_bytes)


BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


def benchmark(name: str, monkeypatch):
    """benchmarks/<name>.py as a module, importing as when run as a script (gpt_setup)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module
