"""release_after_init in one process (fxstar/release.py): True frees the model's original
parameter tensors once the chunk homes hold their values; False leaves them intact and
untouched by training. Either way the model's parameters are the engine's."""

import pytest
import torch
from conftest import tiny_gpt, tokens

import fxstar
from fxstar.errors import OptionNotImplementedError
from fxstar.passes.chunk_layout import ChunkLayoutError
from fxstar.release import check_release

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _train(engine, steps=2):
    ids, targets = tokens()
    losses = []
    for step in range(steps):
        torch.manual_seed(10 + step)
        loss = engine(ids, targets)
        loss.backward()
        engine.step()
        losses.append(loss.item())
    return losses


def _compiled(release, precision="fp32", **options):
    model = tiny_gpt()
    originals = dict(model.named_parameters())
    before = {n: p.detach().clone() for n, p in originals.items()}
    plan = fxstar.Plan(device_memory="auto", precision=precision, release_after_init=release,
                       optimizer={"lr": 1e-2}, **options)  # fmt: skip
    engine = fxstar.compile(model, plan, example_inputs=tokens())
    return model, engine, originals, before


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_true_frees_the_original_tensors_and_trains_the_same(precision):
    model, engine, originals, _ = _compiled(True, precision)
    for name, original in originals.items():
        assert original.untyped_storage().nbytes() == 0, name
    homes = {id(p) for p in engine.chunks.stable.values()}
    for name, param in model.named_parameters():
        assert id(param) in homes and param.untyped_storage().nbytes() > 0, name
    kept = _compiled(False, precision)[1]
    assert _train(engine) == _train(kept)  # the option changes memory only


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_false_leaves_the_original_tensors_intact(precision):
    model, engine, originals, before = _compiled(False, precision)
    _train(engine)
    for name, original in originals.items():
        assert torch.equal(original.detach(), before[name]), name
    trained = dict(model.named_parameters())
    assert all(trained[n] is not originals[n] for n in originals)
    assert not torch.equal(trained["h.0.mlp.c_fc.weight"].detach(), before["h.0.mlp.c_fc.weight"])


def test_parameters_kept_out_of_the_chunks_keep_their_storage():
    model, engine, originals, _ = _compiled(True, cpu_embedding=True)
    outside = [n for n, p in model.named_parameters() if p is originals[n]]
    assert outside == ["wpe.weight"]  # the untied lookup stays the model's own tensor
    assert originals["wpe.weight"].untyped_storage().nbytes() > 0
    assert torch.isfinite(torch.tensor(_train(engine))).all()


def test_a_meta_model_goes_straight_into_its_chunk_homes():
    with torch.device("meta"):
        model = tiny_gpt()
    plan = fxstar.Plan(device_memory="auto", release_after_init=True)
    engine = fxstar.compile(model, plan, example_inputs=tokens(), weights="init")
    assert all(not p.is_meta for p in model.parameters())
    assert torch.isfinite(torch.tensor(_train(engine))).all()


def test_without_chunk_homes_it_is_refused_by_name():
    with pytest.raises(ChunkLayoutError, match="release_after_init.*device_memory"):
        fxstar.compile(tiny_gpt(), fxstar.Plan(release_after_init=True))


def test_data_parallel_meaning_is_refused_by_name():
    plan = fxstar.Plan(device_memory="40%", release_after_init=True)
    check_release(plan, 1)
    check_release(fxstar.Plan(device_memory="40%"), 4)
    refused = "'release_after_init' under data parallelism.*serial RNG"
    with pytest.raises(OptionNotImplementedError, match=refused):
        check_release(plan, 2)
