"""chunk_layout: first-use order, ties stored once, frozen chunks apart, the auto size search."""

import pytest
import torch
from conftest import activation_budget, tiny_gpt, tokens

from fxstar.engine import compile
from fxstar.passes.chunk_layout import LAYOUT_KEY, ChunkLayoutError, nonmodel_peak
from fxstar.plan import Plan


def compiled(model, **plan):
    return compile(model, Plan(**plan), example_inputs=tokens())


def roomy() -> int:
    """Every chunk fits besides the activations."""
    return activation_budget(tiny_gpt, 1.0, example_inputs=tokens())


def test_first_use_order_and_ties_stored_once():
    model = tiny_gpt()
    engine = compiled(model, device_memory=roomy())
    layout = engine.program.meta[LAYOUT_KEY]
    order = [p.name for c in layout.chunks for p in c.params]
    uses = {p.name: i for i, p in enumerate(engine.program.params)}
    assert order == sorted(order, key=uses.__getitem__)  # packed in first-use order
    slots = layout.slots()
    assert slots["wte.weight"] is slots["head.weight"]  # the tie, once
    unique = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert sum(c.used for c in layout.chunks) == unique
    info = engine.program.param("h.0.attn.c_attn.weight")
    slot = slots["h.0.attn.c_attn.weight"]
    assert (info.chunk, info.chunk_offset) == (slot.chunk, slot.offset)
    assert f"chunk={slot.chunk}+{slot.offset}" in engine.program.stages[2].text
    assert "chunk 0: " in layout.describe() and "wte.weight" in layout.describe()


def test_auto_size_holds_the_largest_and_fits_the_share():
    budget = roomy()
    engine = compiled(tiny_gpt(), device_memory=budget)
    layout = engine.program.meta[LAYOUT_KEY]
    largest = max(p.numel() for p in tiny_gpt().parameters())
    assert layout.chunk_size >= largest
    share = budget - nonmodel_peak(engine.program)
    assert 2 * layout.chunk_bytes <= share


def test_frozen_parameters_get_chunks_without_gradient_space():
    model = tiny_gpt()
    for p in model.h[0].parameters():
        p.requires_grad_(False)
    engine = compiled(
        model,
        device_memory=roomy(),
        chunk_size=8192,
    )
    for chunk in engine.chunks.chunks:
        kinds = {s.requires_grad for s in chunk.slots}
        assert len(kinds) == 1  # never mixed
        assert (chunk.host_grad is None) == (kinds == {False})
    ids, targets = tokens()
    engine(ids, targets).backward()
    assert all(p.grad is None for p in model.h[0].parameters())
    assert model.h[1].mlp.c_fc.weight.grad is not None


def test_explicit_chunk_size_must_hold_the_largest_parameter():
    with pytest.raises(ChunkLayoutError, match="chunk_size: 100 elements cannot hold"):
        compiled(tiny_gpt(), device_memory="10MiB", chunk_size=100)


def test_a_budget_too_small_says_what_it_needs():
    with pytest.raises(ChunkLayoutError, match="no chunk size fits.*Raise device_memory"):
        compiled(tiny_gpt(), device_memory=200_000)


class MixedDtypes(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.scale = torch.nn.Parameter(torch.ones(8, dtype=torch.float64))

    def forward(self, x):
        return (self.linear(x) * self.scale.float()).sum()


def test_one_dtype_per_layout():
    with pytest.raises(ChunkLayoutError, match="one dtype"):
        compile(MixedDtypes(), Plan(device_memory="10MiB"), (torch.randn(2, 8),))


def test_layout_is_shared_by_every_capture():
    engine = compiled(tiny_gpt(), device_memory=roomy())
    first = engine.program.meta[LAYOUT_KEY]
    ids, targets = tokens(seq=8)
    engine(ids, targets).backward()
    assert len(engine.programs) == 2
    assert all(p.meta[LAYOUT_KEY] is first for p in engine.programs.values())
    assert torch.isfinite(engine(ids, targets))


def test_chunk_options_without_a_budget_are_refused():
    with pytest.raises(ChunkLayoutError, match="chunk_size, mem_cache: configure the chunk engine"):
        compiled(tiny_gpt(), chunk_size=4096, mem_cache=0)


def test_the_memory_monitor_samples_in_the_background():
    engine = compiled(
        tiny_gpt(),
        device_memory=roomy(),
        async_mem_monitor=True,
    )
    ids, targets = tokens()
    for _ in range(20):
        engine(ids, targets).backward()
    monitor = engine.chunks.monitor
    monitor.stop()
    assert monitor.samples and monitor.peak > 0
    assert "memory monitor:" in engine.report()


def test_tiles_are_chunk_entries_of_their_own():
    budget = roomy()
    plain = compiled(tiny_gpt(), device_memory=budget)
    tiles = {"in_splits": 2, "out_splits": 2, "min_size": 1024}
    eager, model = tiny_gpt(), tiny_gpt()
    tiled = compiled(model, device_memory=budget, tiled_linear=tiles)
    names = [p.name for c in tiled.chunks.layout.chunks for p in c.params]
    assert "h.0.mlp.c_fc.weight.tile_1_0" in names and "h.0.mlp.c_fc.weight" not in names
    largest = max(p.numel for c in tiled.chunks.layout.chunks for p in c.params)
    assert largest < max(p.numel for c in plain.chunks.layout.chunks for p in c.params)
    ids, targets = tokens()
    torch.manual_seed(0)
    expected = eager(ids, targets)
    expected.backward()
    torch.manual_seed(0)
    tiled(ids, targets).backward()
    grads = tiled.store.consolidate_grads({n: p.grad for n, p in tiled.named_parameters()})
    for name, p in eager.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6)


def test_auto_size_leaves_hybrid_adam_chunks_it_can_keep():
    """With room for some optimizer state, the least-waste size is one chunk of the whole
    model here, which the margin cannot keep; with HybridAdam's device half on, the search
    prefers a size of which the margin can keep at least one."""
    from fxstar.models.gpt import GPT, GPTConfig

    def gpt():
        torch.manual_seed(0)
        return GPT(GPTConfig(vocab_size=2048, block_size=128, n_layer=4, n_head=4, n_embd=256,
                             dropout=0.0, bias=False))  # fmt: skip

    batch = (torch.randint(0, 2048, (2, 128)), torch.randint(0, 2048, (2, 128)))
    budget = activation_budget(gpt, 2.0, example_inputs=batch)
    one = compile(gpt(), Plan(device_memory=budget, hybrid_adam=False), batch)
    assert len(one.program.meta[LAYOUT_KEY].chunks) == 1
    engine = compile(gpt(), Plan(device_memory=budget), batch)
    assert len(engine.program.meta[LAYOUT_KEY].chunks) > 1
    engine(*batch).backward()
    engine.step()
    assert engine.optimizer.device_chunks
