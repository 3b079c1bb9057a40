"""What the engine refuses or follows instead of training silently on the wrong values: a
backward after the weights it saved were stepped, a second engine over one model, parameters
replaced after compile, dtype changes under the chunk engine."""

import copy
import threading

import pytest
import torch
from conftest import activation_budget, tiny_gpt, tokens
from torch import nn

from fxstar.engine import compile
from fxstar.errors import EngineStateError
from fxstar.plan import Plan


def gpt(**kwargs):
    return tiny_gpt(dropout=0.0, **kwargs)


def chunk_plan(**options) -> Plan:
    return Plan(device_memory=activation_budget(gpt, 0.5, example_inputs=tokens()), **options)


PLANS = {
    "chunks": chunk_plan,
    "bf16": lambda: Plan(precision="bf16"),
    "chunks+checkpoint": lambda: chunk_plan(checkpoint="blocks"),
}


@pytest.mark.parametrize("make_plan", PLANS.values(), ids=PLANS.keys())
def test_backward_after_step_raises_like_eager(make_plan):
    """Eager raises "modified by an inplace operation"; the saved parameters brought back by
    the chunk engine (or recomputed by a region) must not silently be the stepped ones."""
    engine = compile(gpt(), make_plan(), example_inputs=tokens())
    first, second = engine(*tokens()), engine(*tokens(seed=2))
    first.backward()
    engine.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        second.backward()
    engine.zero_grad()
    engine(*tokens()).backward()  # a fresh forward trains on
    assert engine.step()


def test_eager_raises_the_same():
    model = gpt()
    opt = torch.optim.AdamW(model.parameters())
    first, second = model(*tokens()), model(*tokens(seed=2))
    first.backward()
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        second.backward()


@pytest.mark.parametrize("make_plan", [chunk_plan, lambda: Plan(precision="bf16")],
                         ids=["chunks", "bf16"])  # fmt: skip
def test_a_second_engine_over_one_model_is_refused(make_plan):
    model = gpt()
    first = compile(model, make_plan(), example_inputs=tokens())
    with pytest.raises(EngineStateError, match="already compiled"):
        compile(model, make_plan(), example_inputs=tokens())
    with pytest.raises(EngineStateError, match="already compiled"):
        compile(model, Plan(), example_inputs=tokens())
    compile(copy.deepcopy(model), make_plan(), example_inputs=tokens())  # a copy is its own
    first.close()
    compile(model, Plan(), example_inputs=tokens())  # the first engine let go


def test_two_plain_engines_share_the_models_tensors():
    model = gpt()
    a = compile(model, Plan(), example_inputs=tokens())
    b = compile(model, Plan(), example_inputs=tokens())
    assert [p for _, p in a.named_parameters()] == [p for _, p in b.named_parameters()]


def test_values_given_through_data_are_trained():
    """`p.data = t` after compile: the chunk engine takes the new values into the chunk."""
    eager, model = gpt(), gpt()
    engine = compile(model, chunk_plan(), example_inputs=tokens())
    engine(*tokens()).backward()  # chunks resident, the head among them
    engine.zero_grad()
    new = torch.randn_like(model.head.weight)
    model.head.weight.data = new.clone()
    eager.head.weight.data = new.clone()
    loss, expected = engine(*tokens()), eager(*tokens())
    assert torch.equal(loss, expected)
    loss.backward()
    expected.backward()
    for (name, p), (_, q) in zip(eager.named_parameters(), engine.named_parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    assert torch.equal(engine.state_dict()["head.weight"], new)
    with pytest.raises(EngineStateError, match="shape"):
        model.head.weight.data = torch.zeros(3, 3)
        engine(*tokens())


@pytest.mark.parametrize("make_plan", [Plan, chunk_plan], ids=["plain", "chunks"])
def test_a_replaced_parameter_object_is_refused(make_plan):
    model = gpt()
    engine = compile(model, make_plan(), example_inputs=tokens())
    model.h[0].attn.c_proj.weight = nn.Parameter(torch.zeros_like(model.h[0].attn.c_proj.weight))
    with pytest.raises(EngineStateError, match=r"h\.0\.attn\.c_proj\.weight"):
        engine(*tokens())


def test_dtype_changes_refused_under_chunks_and_followed_without():
    engine = compile(gpt(), chunk_plan(), example_inputs=tokens())
    with pytest.raises(EngineStateError, match="chunks"):
        engine.to(torch.float64)
    plain = compile(gpt(), Plan(), example_inputs=tokens())
    plain.to(torch.float64)
    assert all(p.dtype == torch.float64 for p in plain.parameters())
    assert plain(*tokens()).dtype == torch.float64


def test_step_from_two_threads_steps_one_after_the_other():
    """Two threads stepping at once (a forward in flight would go stale: that raises, see
    above): the steps are serialized, no internal state error."""
    engine = compile(gpt(), chunk_plan(optimizer={"type": "adamw", "lr": 1e-3}),
                     example_inputs=tokens())  # fmt: skip
    errors = []
    for round_ in range(5):
        engine(*tokens(seed=round_)).backward()
        start = threading.Barrier(2)

        def step(start: threading.Barrier = start) -> None:
            try:
                start.wait()
                engine.step()
            except Exception as error:  # noqa: BLE001 - collected for the assertion
                errors.append(error)

        threads = [threading.Thread(target=step) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    assert engine.step_count == 10


def test_a_compiled_model_still_pickles_and_copies(tmp_path):
    """The owner mark a chunk engine leaves on the model travels with neither."""
    model = gpt()
    engine = compile(model, chunk_plan(), example_inputs=tokens())
    torch.save(model, tmp_path / "model.pt")
    again = torch.load(tmp_path / "model.pt", weights_only=False)
    compile(again, chunk_plan(), example_inputs=tokens())  # not owned by `engine`
    compile(copy.deepcopy(model), chunk_plan(), example_inputs=tokens())
    assert engine.chunks is not None
