"""ParameterStore: derived parameters (tiles, shards) and rebinding, end to end."""

import pytest
import torch
from conftest import tiny_gpt, tokens
from torch import nn

from fxstar import passes
from fxstar.engine import compile
from fxstar.params import ParameterStore
from fxstar.plan import Plan


def halves(weight):
    top, bottom = weight.chunk(2, dim=0)
    return {"top": top, "bottom": bottom}


def glue(parts):
    return torch.cat(list(parts.values()), dim=0)


def test_derive_replaces_every_alias_and_glues_back():
    model = tiny_gpt()
    store = ParameterStore(model)
    parts = store.derive("head.weight", halves, glue)  # tied with wte.weight
    assert list(parts) == ["wte.weight.top", "wte.weight.bottom"]
    assert store.derive("wte.weight", halves, glue) is parts  # idempotent, by any alias
    fed = store.tensors()
    assert "wte.weight" not in fed and "head.weight" not in fed
    assert store.origin("wte.weight.top") == "wte.weight"
    state = store.state_dict()
    assert state.keys() == model.state_dict().keys()
    assert torch.equal(state["head.weight"], model.head.weight)
    names = [n for n, _ in store.named_parameters()]
    assert names[:2] == ["wte.weight.top", "wte.weight.bottom"]
    assert len(names) == len(list(model.parameters())) + 1  # one tensor became two


def test_rebind_feeds_another_tensor_under_every_alias():
    model = tiny_gpt()
    store = ParameterStore(model)
    replacement = nn.Parameter(model.wte.weight.detach().clone())
    store.rebind("head.weight", replacement)
    assert store["wte.weight"] is replacement and store["head.weight"] is replacement
    with pytest.raises(KeyError, match="no parameter"):
        store.rebind("nope", replacement)


@passes.register(name="t_split_fc", replace=True)
def split_fc(program):
    """Computes the first MLP up-projection as two half linears on derived parameters."""
    graph = program.graph_module.graph
    fc = next(
        n for n in graph.nodes
        if n.target is torch.ops.aten.linear.default
        and n.args[1].name == "p_h_0_mlp_c_fc_weight"
    )  # fmt: skip
    weight_node = fc.args[1]
    parts = program.store.derive("h.0.mlp.c_fc.weight", halves, glue)
    top, bottom = (program.add_input("parameter", name, name.replace(".", "_")) for name in parts)
    with graph.inserting_before(fc):
        a = graph.call_function(torch.ops.aten.linear.default, (fc.args[0], top))
        b = graph.call_function(torch.ops.aten.linear.default, (fc.args[0], bottom))
        cat = graph.call_function(torch.ops.aten.cat.default, ([a, b], -1))
        out = graph.call_function(torch.ops.aten.add.Tensor, (cat, fc.args[2]))
    fc.replace_all_uses_with(out)
    graph.erase_node(fc)
    program.remove_input(weight_node)
    graph.lint()
    program.graph_module.recompile()
    return program


def test_a_pass_that_derives_parameters_trains_like_eager():
    # SGD: Adam would amplify the split's rounding differences on near-zero gradients
    plan = Plan(passes=["t_split_fc"], optimizer={"type": "sgd", "lr": 0.1})
    eager, model = tiny_gpt(dropout=0.0), tiny_gpt(dropout=0.0)
    engine = compile(model, plan)
    reference = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=plan.optimizer.betas[0])
    for step in range(3):
        ids, targets = tokens(seed=step)
        expected = eager(ids, targets)
        expected.backward()
        reference.step()
        reference.zero_grad()
        loss = engine(ids, targets)
        loss.backward()
        engine.step()
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    names = [n for n, _ in engine.named_parameters()]
    assert "h.0.mlp.c_fc.weight.top" in names and "h.0.mlp.c_fc.weight" not in names
    state = engine.state_dict()
    for key, value in eager.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6)
    fresh = tiny_gpt()
    fresh.load_state_dict(state)  # consolidated: loadable into the unsharded model
    assert fresh(ids, targets).shape == ()
    assert state["h.0.mlp.c_fc.weight"].shape == eager.h[0].mlp.c_fc.weight.shape
