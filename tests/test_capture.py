import pytest
import torch
from conftest import hf_gpt2, hf_llama, tiny_gpt, tokens
from torch import nn

from fxstar.capture import capture
from fxstar.errors import CaptureError
from fxstar.plan import Plan


def test_capture_records_stage_and_program_parts():
    model = tiny_gpt()
    program = capture(model, tokens())
    assert [s.name for s in program.stages] == ["capture"]
    assert program.ir == "export" and program.training
    kinds = {slot.kind for slot in program.inputs}
    assert kinds == {"parameter", "input"}
    assert "aten.linear(" in program.stages[0].text


def test_tied_parameters_are_one_entry_with_every_alias():
    program = capture(tiny_gpt(), tokens())
    info = program.param("head.weight")
    assert info.name == "wte.weight"
    assert info.aliases == ("wte.weight", "head.weight")
    assert set(info.placeholders) == {"p_wte_weight", "p_head_weight"}
    assert len(program.params) == len(list(tiny_gpt().parameters()))
    assert info.first_use == "embedding" and info.last_use.startswith("linear")


def test_param_table_follows_execution_order():
    program = capture(tiny_gpt(), tokens())
    order = {n.name: i for i, n in enumerate(program.graph_module.graph.nodes)}
    firsts = [order[p.first_use] for p in program.params]
    assert firsts == sorted(firsts)
    assert program.params[-1].name.startswith("ln_f")


def test_llama_buffers_are_fed_from_the_model():
    program = capture(hf_llama(), (), {"input_ids": tokens()[0], "labels": tokens()[1]})
    buffers = [s.target for s in program.inputs if s.kind == "buffer"]
    assert "model.rotary_emb.inv_freq" in buffers
    out = program.run((), {"input_ids": tokens()[0], "labels": tokens()[1]})
    assert out.loss.dim() == 0


def test_identical_inputs_are_captured_as_distinct_placeholders():
    model = tiny_gpt(dropout=0.0)
    idx, other = tokens()
    program = capture(model, (idx, idx))
    # The capture must not merge idx and targets: feeding different targets must matter.
    assert not torch.equal(program.run((idx, idx)), program.run((idx, other)))
    assert torch.equal(program.run((idx, other)), model(idx, other))


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()

    def forward(self, x):
        return self.inner(x).sum()


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:  # value-dependent branch: not capturable
            return y
        return -y


def test_capture_error_names_module_line_and_hint():
    with pytest.raises(CaptureError) as info:
        capture(Branchy(), (torch.randn(2, 4),))
    error = info.value
    assert error.module_path == "inner"
    assert error.location is not None and "test_capture.py" in error.location
    assert "y.sum() > 0" in error.location
    assert "torch.where" in error.hint
    assert error.original is error.__cause__ and error.original is not None
    assert "module: inner" in str(error)


def test_capture_error_for_a_cache_suggests_use_cache_false():
    model = hf_gpt2()
    model.config.use_cache = True
    ids, labels = tokens()
    with pytest.raises(CaptureError) as info:
        capture(model, (), {"input_ids": ids, "labels": labels})
    assert "use_cache" in info.value.hint


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))).pow(2).mean()


def test_symbolic_trace_fallback_runs_identically():
    torch.manual_seed(0)
    model = Mlp()
    x = torch.randn(4, 8)
    program = capture(model, (x,), method="symbolic_trace")
    assert program.ir == "symbolic_trace"
    assert {p.name for p in program.params} == {n for n, _ in model.named_parameters()}
    assert program.param("fc1.weight").first_use == "fc1"
    assert "self.fc1(x)" in program.stages[0].text
    assert torch.equal(program.run((x,)), model(x))


def test_loss_fn_wrapper_keeps_model_names():
    model = tiny_gpt(dropout=0.0)
    plan = Plan(
        loss_fn=lambda logits, t: nn.functional.cross_entropy(logits.flatten(0, 1), t.flatten())
    )
    idx, targets = tokens()
    program = capture(model, (idx, targets), plan=plan)
    assert program.param("wte.weight").aliases == ("wte.weight", "head.weight")
    assert all(not s.target.startswith("model.") for s in program.inputs if s.target)
    assert torch.equal(program.run((idx, targets)), model(idx, targets))


class StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class CustomGelu(torch.autograd.Function):
    """A forward whose autograd derivative differs slightly from the backward given."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.nn.functional.gelu(x, approximate="tanh")

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * torch.sigmoid(1.702 * x) * (1 + 1.702 * x * (1 - torch.sigmoid(1.702 * x)))


@torch.library.custom_op("fxstar_test::round_ste", mutates_args=())
def round_ste(x: torch.Tensor) -> torch.Tensor:
    return torch.round(x)


round_ste.register_fake(lambda x: torch.empty_like(x))
round_ste.register_autograd(lambda ctx, grad: grad)


class Quantized(nn.Module):
    def __init__(self, rounding):
        super().__init__()
        self.lin, self.head, self.rounding = nn.Linear(8, 8), nn.Linear(8, 1), rounding

    def forward(self, x, y):
        return (self.head(self.rounding(self.lin(x))) - y).square().mean()


@pytest.mark.parametrize("function", [StraightThrough, CustomGelu], ids=["ste", "gelu"])
def test_a_custom_autograd_function_keeps_its_backward(function):
    """One node running the Function's own forward and backward (export alone would inline the
    forward and train on its derivative: zero for the straight-through round)."""
    from fxstar.engine import compile

    torch.manual_seed(0)
    eager = Quantized(function.apply)
    model = Quantized(function.apply)
    model.load_state_dict(eager.state_dict())
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    engine = compile(model, Plan(), example_inputs=(x, y))
    targets = [str(n.target) for n in engine.program.graph_module.graph.nodes]
    assert f"fxstar_fn.{function.__qualname__}" in " ".join(targets)
    assert "aten.round.default" not in targets and "aten.gelu.default" not in targets
    eager(x, y).backward()
    engine(x, y).backward()
    assert eager.lin.weight.grad.abs().sum() > 0
    for p, q in zip(eager.parameters(), engine.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_a_custom_op_keeps_its_backward():
    """The remedy the error gives: a torch.library custom op is captured whole."""
    from fxstar.engine import compile

    torch.manual_seed(0)
    eager = Quantized(round_ste)
    model = Quantized(round_ste)
    model.load_state_dict(eager.state_dict())
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    engine = compile(model, Plan(), example_inputs=(x, y))
    eager(x, y).backward()
    engine(x, y).backward()
    assert eager.lin.weight.grad.abs().sum() > 0
    for p, q in zip(eager.parameters(), engine.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


class _Smoothed(nn.Module):
    """A block that keeps a running mean by assigning its buffer (not writing it in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("ema", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.ema = self.ema * 0.9 + x.detach().mean()
        return torch.tanh(self.fc(x) + self.ema)


class _SmoothedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Smoothed(), _Smoothed()])
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = self.calls + 1  # the root's own: export keeps this one by itself
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


@pytest.mark.parametrize(
    "options",
    [{}, {"device_memory": "auto"}, {"checkpoint": "blocks"}],
    ids=["plain", "chunks", "blocks"],
)
def test_a_buffer_assigned_in_a_submodules_forward_is_kept_like_eagers(options):
    import copy

    import fxstar

    torch.manual_seed(0)
    model = _SmoothedNet()
    eager = copy.deepcopy(model)
    x = torch.randn(4, 8)
    engine = fxstar.compile(model, Plan(optimizer={"type": "sgd", "lr": 0.1}, **options), (x,))
    reference = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)  # the plan's
    for step in range(3):
        batch = x + step
        loss, expected = engine(batch), eager(batch)
        loss.backward()
        expected.backward()
        engine.step()
        reference.step()
        reference.zero_grad()
        assert torch.equal(loss.detach(), expected.detach())
    for name, buffer in eager.named_buffers():
        assert torch.equal(dict(model.named_buffers())[name], buffer), name
    for name, p in eager.named_parameters():
        assert torch.equal(dict(model.named_parameters())[name].detach(), p.detach()), name


def test_a_buffer_assigned_another_shape_in_a_submodule_is_refused_by_name():
    class Grows(_Smoothed):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.ema = x.detach().mean(0)  # () -> (8,): cannot be written in place
            return self.fc(x)

    model = nn.Sequential(Grows())
    with pytest.raises(CaptureError, match=r"buffer 0\.ema"):
        capture(model, (torch.randn(4, 8),))
    assert model[0].ema.shape == ()
