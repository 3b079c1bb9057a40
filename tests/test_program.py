import pytest
import torch
from conftest import tiny_gpt, tokens

from fxstar.capture import capture


@pytest.fixture
def program():
    return capture(tiny_gpt(dropout=0.0), tokens())


def test_stage_lookup(program):
    program.record("again")
    assert program.stage()[0] == 1
    assert program.stage("capture") == (0, program.stages[0])
    assert program.stage(-1)[1].name == "again"
    assert program.stages[1].after == ("capture",)
    with pytest.raises(LookupError, match="stages: capture, again"):
        program.stage("missing")
    with pytest.raises(LookupError):
        program.stage(5)


def test_record_can_keep_a_graph_snapshot(program):
    stage = program.record("snap", keep_graph=True)
    assert stage.graph_module is not None and stage.graph_module is not program.graph_module
    assert program.stages[0].graph_module is None


def test_param_lookup_by_alias_and_placeholder(program):
    assert program.param("p_head_weight") is program.param("wte.weight")
    with pytest.raises(KeyError):
        program.param("nope")
    assert program.param_bytes == sum(p.numel() * 4 for p in tiny_gpt().parameters())


def test_refresh_param_uses_after_a_rewrite(program):
    graph = program.graph_module.graph
    placeholder = next(n for n in graph.nodes if n.name == "p_wpe_weight")
    last = next(n for n in graph.nodes if n.op == "output").prev
    with graph.inserting_before(last.next):
        late = graph.call_function(torch.ops.aten.clone.default, (placeholder,))
    program.refresh_param_uses()
    assert program.param("wpe.weight").last_use == late.name


def test_run_on_other_tensors_leaves_the_model_alone(program):
    tensors = {n: t.detach().clone().requires_grad_() for n, t in program.model_tensors().items()}
    tensors["head.weight"] = tensors["wte.weight"]
    program.run(tokens(), tensors=tensors).backward()
    assert all(p.grad is None for p in program.model.parameters())
    assert tensors["wte.weight"].grad is not None


def test_mismatched_inputs_are_refused(program):
    with pytest.raises(TypeError, match="captured signature"):
        program.run((tokens()[0],))


def test_a_name_several_stages_have_is_refused_listing_them(program):
    """An analysis re-run after a rewrite records a second stage of its name: which one a name
    means is the caller's to say, by number."""
    program.record("shape_memory")
    program.record("rewrite")
    program.record("shape_memory")
    with pytest.raises(LookupError, match=r"2 stages are named 'shape_memory': 1 \(after "
                       r"capture\); 3 \(after rewrite\); give the stage's number"):  # fmt: skip
        program.stage("shape_memory")
    assert program.stage(3)[1].name == "shape_memory"
    assert program.stage("rewrite")[0] == 2
