"""The training-memory estimate behind `fxstar plan`."""

import torch
from conftest import BATCH, SEQ, VOCAB, tiny_gpt

import fxstar
from fxstar.estimate import format_estimate, training_memory


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
