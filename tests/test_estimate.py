"""The training-memory estimate behind `fxstar plan`."""

import pytest
import torch
from conftest import BATCH, SEQ, VOCAB, tiny_gpt, tokens

import fxstar
from fxstar.estimate import estimate, format_estimate, training_memory
from fxstar.passes.chunk_layout import ChunkLayoutError, nonmodel_peak
from fxstar.sizes import format_size


def compiled(passes):
    model = tiny_gpt()
    idx = torch.randint(0, VOCAB, (BATCH, SEQ))
    return model, fxstar.compile(model, fxstar.Plan(passes=passes), example_inputs=(idx, idx + 0))


def test_rows_add_up_from_the_parameter_table():
    model, engine = compiled(["shape_memory"])
    rows = {r.kind: r.nbytes for r in training_memory(engine.program)}
    unique = {id(p): p for p in model.parameters()}.values()  # the tied weight once
    param_bytes = sum(p.numel() * 4 for p in unique)
    assert rows["parameters"] == rows["gradients"] == param_bytes
    assert rows["optimizer state"] == 2 * param_bytes  # AdamW: two fp32 moments
    assert rows["activations saved"] > 0 and rows["largest backward temporary"] > 0
    assert rows["total"] == sum(v for k, v in rows.items() if k != "total")


def test_without_shape_memory_it_says_what_is_missing():
    _, engine = compiled([])
    assert "shape_memory pass did not run" in format_estimate(engine.program)
    assert "activations saved" not in format_estimate(engine.program)
    assert "smallest device_memory" not in format_estimate(engine.program)


def test_estimate_is_the_smallest_device_memory_that_works():
    """Without chunks, estimate() asks the chunk-size search what the plan would need: the
    plan compiles under exactly that device_memory, and not under one byte less."""
    _, engine = compiled(["shape_memory"])
    found = estimate(engine.program)
    assert found.activation_peak == nonmodel_peak(engine.program) > 0
    assert found.param_bytes == engine.program.param_bytes
    inputs = engine.program.example_args
    chunked = fxstar.compile(tiny_gpt(), fxstar.Plan(device_memory=found.device_memory), inputs)
    assert estimate(chunked.program) == found
    with pytest.raises(ChunkLayoutError, match=f"\\({found.device_memory:,} bytes\\)"):
        fxstar.compile(tiny_gpt(), fxstar.Plan(device_memory=found.device_memory - 1), inputs)
    text = format_estimate(engine.program)
    assert f"smallest device_memory for this plan: {format_size(found.device_memory)}" in text


def test_a_later_capture_is_estimated_on_the_layout_already_chosen():
    _, engine = compiled(["shape_memory"])
    budget = 2 * estimate(engine.program).device_memory
    chunked = fxstar.compile(tiny_gpt(), fxstar.Plan(device_memory=budget), tokens(seq=8))
    ids, targets = tokens()
    chunked(ids, targets).backward()
    later = chunked.prepare(ids, targets)
    assert later.decisions.budget_need is None
    need = estimate(later).need
    assert need.chunk_size == later.decisions.chunk_layout.chunk_size
    assert need.device_memory <= budget


def test_engine_estimate_is_the_programs():
    from conftest import tiny_gpt, tokens

    from fxstar.engine import compile
    from fxstar.estimate import estimate
    from fxstar.plan import Plan

    engine = compile(tiny_gpt(), Plan(device_memory="auto"), example_inputs=tokens())
    assert engine.estimate() == estimate(engine.program)
    assert engine.chunks.budget == engine.estimate().device_memory
