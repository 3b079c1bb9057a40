import pytest
import torch
from conftest import tiny_gpt, tokens

from fxstar import passes
from fxstar.capture import capture
from fxstar.engine import compile
from fxstar.errors import VerifyError
from fxstar.plan import Plan
from fxstar.verify import Verifier, find_loss


def _swap_gelu(program, target=torch.ops.aten.relu.default):
    for node in program.graph_module.graph.nodes:
        if node.target is torch.ops.aten.gelu.default:
            node.target = target
    program.graph_module.recompile()
    return program


def _scale_loss(factor):
    def rewrite(program):
        graph = program.graph_module.graph
        output = next(n for n in graph.nodes if n.op == "output")
        loss = output.args[0][0]
        with graph.inserting_before(output):
            scaled = graph.call_function(torch.ops.aten.mul.Tensor, (loss, factor))
        output.args = ((scaled,),)
        program.graph_module.recompile()
        return program

    return rewrite


@pytest.fixture
def register():
    names = []

    def add(fn, **options):
        passes.register(fn, replace=True, **options)
        names.append(options["name"])

    yield add
    for name in names:
        passes.unregister(name)


def test_identity_passes_verify_bitwise(register):
    register(lambda p: p, name="t_identity")
    model = tiny_gpt()
    engine = compile(model, Plan(verify=True, passes=["t_identity", "shape_memory"]),
                     example_inputs=tokens())  # fmt: skip
    assert [s.name for s in engine.program.stages] == ["capture", "t_identity", "shape_memory"]
    assert all(p.grad is None for p in model.parameters())


def test_a_pass_that_breaks_numerics_is_named(register):
    register(_swap_gelu, name="t_relu")
    with pytest.raises(VerifyError, match="pass 't_relu' changed the output 0") as info:
        compile(tiny_gpt(), Plan(verify=True, passes=["t_relu"]), example_inputs=tokens())
    assert info.value.pass_name == "t_relu"


def test_tolerance_is_honoured(register):
    register(_scale_loss(1.0 + 1e-6), name="t_tiny", tolerance=(1e-4, 1e-6))
    compile(tiny_gpt(), Plan(verify=True, passes=["t_tiny"]), example_inputs=tokens())
    register(_scale_loss(1.0 + 1e-6), name="t_tiny_bitwise")
    with pytest.raises(VerifyError, match="bitwise"):
        compile(tiny_gpt(), Plan(verify=True, passes=["t_tiny_bitwise"]),
                example_inputs=tokens())  # fmt: skip


def test_verifier_compares_capture_with_eager_and_keeps_rng():
    model = tiny_gpt()
    args = tokens()
    verifier = Verifier(model, args, seed=3)
    verifier.baseline()
    state = torch.random.get_rng_state()
    verifier(type("P", (), {"name": "capture", "tolerance": None})(), capture(model, args))
    assert torch.equal(state, torch.random.get_rng_state())
    assert verifier.last[0] == "capture"
    assert set(verifier.last[1].grads) == {n for n, _ in model.named_parameters(
        remove_duplicate=False)}  # fmt: skip


def test_find_loss():
    loss = torch.tensor(1.0)
    assert find_loss(loss) is loss
    assert find_loss((torch.zeros(2), loss)) is loss
    assert find_loss({"loss": loss, "logits": torch.zeros(2)}) is loss
    assert find_loss(torch.zeros(2)) is None
