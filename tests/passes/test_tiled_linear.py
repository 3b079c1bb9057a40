"""tiled_linear: tiles are parameters cut from the weights; outputs and gradients within the
declared fp32 reassociation tolerance; state_dict gives the original names and shapes."""

import pytest
import torch
from conftest import hf_gpt2, hf_llama, inputs, tiny_gpt

from fxstar.dump import dump
from fxstar.engine import compile
from fxstar.passes.tiled_linear import TOLERANCE, split_sizes
from fxstar.plan import Plan
from fxstar.verify import Verifier

MODELS = {"gpt": tiny_gpt, "gpt2": hf_gpt2, "llama": hf_llama}
TILES = {"in_splits": 2, "out_splits": 2, "min_size": 0}


@pytest.mark.parametrize("kind", MODELS)
def test_tiles_match_eager_within_tolerance(kind):
    make = MODELS[kind]
    args, kwargs = inputs(make)
    model = make()
    engine = compile(model, Plan(tiled_linear=TILES, verify=True, seed=0), args, kwargs)
    rtol, atol = TOLERANCE
    check = Verifier(model, args, kwargs)
    eager, tiled = check.run_eager(), check.run_program(engine.program)
    torch.testing.assert_close(tiled.outputs, eager.outputs, rtol=rtol, atol=atol)
    for name, grad in eager.grads.items():
        torch.testing.assert_close(tiled.grads[name], grad, rtol=rtol, atol=atol)
    state = engine.state_dict()
    reference = model.state_dict()
    assert list(state) == list(reference)
    assert all(torch.equal(state[k], v) for k, v in reference.items())  # cut, not changed


def test_names_shapes_and_the_largest_weight():
    args, _ = inputs(tiny_gpt)
    model = tiny_gpt()
    engine = compile(model, Plan(tiled_linear=TILES), args)
    names = dict(engine.named_parameters())
    assert "h.0.mlp.c_fc.weight" not in names
    assert names["h.0.mlp.c_fc.weight.tile_1_0"].shape == (64, 16)  # [out, in] of 128 x 32
    assert engine.store.origin("h.0.mlp.c_fc.weight.tile_1_0") == "h.0.mlp.c_fc.weight"
    linears = [p.numel() for n, p in model.named_parameters() if n.startswith("h.")]
    tiles = [p.numel for p in engine.program.params if ".tile_" in p.name]
    assert max(tiles) * 4 == max(linears)  # the largest linear weight shrinks by in x out
    assert engine.program.param_bytes == sum(
        p.numel() * 4 for p in model.parameters()
    )  # the table lists tiles instead of weights: same bytes


def test_tied_weight_is_left_whole_with_a_note():
    args, _ = inputs(tiny_gpt)
    engine = compile(tiny_gpt(), Plan(tiled_linear=TILES), args)
    assert "wte.weight" in dict(engine.named_parameters())
    assert "tiled_linear=not tiled: head.weight has 2 uses (tied weight)" in dump(engine)
    assert "tiled_linear=2x2 tiles of h.0.attn.c_attn.weight" in dump(engine)
    chosen = [choice.weight for choice in engine.program.decisions.tiled_linear]
    assert "head.weight" not in chosen and "h.0.attn.c_attn.weight" in chosen  # decided first


def test_gpt2_conv1d_addmm_becomes_mm_tiles():
    args, kwargs = inputs(hf_gpt2)
    engine = compile(hf_gpt2(), Plan(tiled_linear=TILES), args, kwargs)
    text = dump(engine)
    assert "aten.addmm" not in text and "aten.mm(" in text
    assert engine.state_dict()["transformer.h.0.mlp.c_fc.weight"].shape == (32, 128)


def test_optimizer_groups_match_the_original_name_and_training_follows_eager():
    args, _ = inputs(tiny_gpt)
    opt = {"type": "sgd", "lr": 0.1, "weight_decay": 0.1, "no_decay": ("*c_fc.weight",)}
    plan = Plan(tiled_linear=TILES, optimizer=opt)
    eager, model = tiny_gpt(dropout=0.0), tiny_gpt(dropout=0.0)
    engine = compile(model, plan, args)
    decayed = {id(p) for p in engine.optimizer.param_groups[0]["params"]}
    tile = dict(engine.named_parameters())["h.0.mlp.c_fc.weight.tile_0_0"]
    assert id(tile) not in decayed and engine.optimizer.param_groups[1]["weight_decay"] == 0
    loss = engine(*args)
    loss.backward()
    expected = eager(*args)
    torch.testing.assert_close(loss, expected, rtol=TOLERANCE[0], atol=TOLERANCE[1])


def test_split_sizes():
    assert split_sizes(10, 3) == [4, 3, 3]
    assert split_sizes(2, 4) == [1, 1]
