"""The chunk engine against eager PyTorch: parameters paged through a budget of the activations'
peak plus 40% of the parameter bytes, and still bit for bit the same training."""

import pytest
import torch
from conftest import (
    activation_budget,
    assert_same_step,
    example,
    hf_gpt2,
    hf_llama,
    tiny_gpt,
    tokens,
)

from fxstar.engine import compile
from fxstar.plan import Plan

FACTORIES = {"gpt": tiny_gpt, "gpt2": hf_gpt2, "llama": hf_llama}


def tight_budget(kind) -> int:
    """The non-model peak plus 40% of the parameter bytes."""
    return activation_budget(FACTORIES[kind], 0.4, **example(kind, *tokens()))


@pytest.mark.parametrize("kind", FACTORIES)
def test_ten_steps_bitwise_equal_to_eager_under_a_tight_budget(kind):
    ids, targets = tokens()
    eager, model = FACTORIES[kind](), FACTORIES[kind]()
    plan = Plan(device_memory=tight_budget(kind))
    engine = compile(model, plan, **example(kind, ids, targets))
    engine.chunks.checking = True  # residency invariants after every fetch and unpack
    layout = engine.chunks.layout
    assert len(layout.chunks) >= 3  # really paged: the share holds only some of them
    reference = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-2)
    for step in range(10):
        assert_same_step(kind, eager, engine, step)
        reference.step()
        optimizer.step()
        reference.zero_grad()
        optimizer.zero_grad()
    for p, q in zip(eager.parameters(), engine.parameters(), strict=True):
        assert torch.equal(p, q)
    stats = engine.chunks.stats
    assert stats.evictions > 0 and stats.unexpected_accesses == 0
    assert engine.chunks.arena.stats()["peak_in_use"] <= engine.chunks.arena.capacity
