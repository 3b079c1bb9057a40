"""Custom torch.autograd.Functions through capture (fxstar/autograd_functions.py): each
application one node that runs the Function's own forward and backward, trained like eager
(loss and every gradient bitwise in fp32; bf16 to its precision), with chunks paging the
parameters it saves, with checkpointed blocks; the Functions that cannot be kept refused by
name."""

import copy
import gc
import threading
import weakref

import pytest
import torch
from conftest import activation_budget, close_in_norm
from torch import nn
from torch.autograd.function import once_differentiable

import fxstar
from fxstar import Plan
from fxstar.autograd_functions import _ops
from fxstar.capture import capture
from fxstar.errors import CaptureError


class RoundSTE(torch.autograd.Function):
    """A straight-through round: autograd's derivative of the forward is zero."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class LinearFunction(torch.autograd.Function):
    """A linear that saves its weight (a parameter the chunks page) with save_for_backward."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        out = x @ weight.t()
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_w = grad.flatten(0, -2).t() @ x.flatten(0, -2) if ctx.needs_input_grad[1] else None
        grad_b = grad.flatten(0, -2).sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b


class ScaledTopK(torch.autograd.Function):
    """setup_context style: numbers, None, a bool and a string among the arguments (one by
    keyword, one left to its default), two outputs of which one is not differentiable, a
    backward that differs from the forward's derivative, once_differentiable."""

    @staticmethod
    def forward(x, scale, shift=None, clamp=True, mode="mean"):
        y = x * scale if shift is None else x * scale + shift
        y = y.clamp(-3, 3) if clamp else y
        return y, y.argmax(-1)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, scale, _, _, mode = inputs
        ctx.save_for_backward(x)
        ctx.scale, ctx.mode = scale, mode
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad, _):
        (x,) = ctx.saved_tensors
        factor = ctx.scale * (0.5 if ctx.mode == "mean" else 1.0)
        return torch.where(x.abs() < 1, grad * factor, grad), None, None, None, None


class GradientReversal(torch.autograd.Function):
    """Returns a view of its input; backward negates (a domain-adaptation layer)."""

    @staticmethod
    def forward(ctx, x, alpha):
        ctx.alpha = alpha
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.alpha * grad, None


class FunctionLinear(nn.Linear):
    def forward(self, x):
        return LinearFunction.apply(x, self.weight, self.bias)


class Net(nn.Module):
    """Every Function above, the STE applied through an `apply` bound at construction."""

    def __init__(self, width=16, depth=4):
        super().__init__()
        self.layers = nn.ModuleList(FunctionLinear(width, width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 1)
        self.rounding = RoundSTE.apply

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        x, top = ScaledTopK.apply(x, 3.0, mode="sum")
        x = GradientReversal.apply(self.rounding(self.norm(x) * 4) / 4, 0.5)
        return (self.head(x) - y).square().mean() + top.float().mean() * 0


def _batch(step=0):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)


def _kept_nodes(program):
    return [n for n in program.graph_module.graph.nodes if "fxstar_fn" in str(n.target)]


def test_each_application_is_one_node_of_the_functions_own_operator():
    torch.manual_seed(0)
    program = capture(Net(), _batch())
    names = [str(n.target).split(".")[1].rsplit("_", 1)[0] for n in _kept_nodes(program)]
    assert names == ["LinearFunction"] * 4 + ["ScaledTopK", "RoundSTE", "GradientReversal"]
    ops = {n.target for n in _kept_nodes(program)}
    assert len(ops) == 4  # one operator for the four linears: one class, one argument pattern
    scaled = next(n for n in _kept_nodes(program) if "ScaledTopK" in str(n.target))
    assert 3.0 in scaled.args and "sum" in scaled.args  # the numbers and strings it was given
    assert {n.target for n in _kept_nodes(capture(Net(), _batch()))} == ops  # reused


def _tight(model) -> int:
    return activation_budget(lambda: copy.deepcopy(model), 0.4, example_inputs=_batch())


PLANS = {
    "plain": lambda model: Plan(optimizer={"type": "sgd", "lr": 0.1}),
    "chunks": lambda model: Plan(device_memory=_tight(model), optimizer={"type": "sgd", "lr": 0.1}),
    "blocks": lambda model: Plan(checkpoint="blocks", optimizer={"type": "sgd", "lr": 0.1}),
    "chunks+blocks": lambda model: Plan(
        device_memory=_tight(model), checkpoint="blocks", optimizer={"type": "sgd", "lr": 0.1}
    ),
}


@pytest.mark.parametrize("plan", PLANS)
def test_functions_train_bitwise_like_eager(plan):
    """Three steps (SGD with momentum, the plan's optimizer): loss, every gradient and the
    parameters after each step bitwise equal; the chunks evict the linears' weights the
    Function saved between forward and backward (the arena reused), and backward gets them
    back through the saved-tensor hooks."""
    torch.manual_seed(0)
    model = Net()
    eager = copy.deepcopy(model)
    engine = fxstar.compile(model, PLANS[plan](model), example_inputs=_batch())
    reference = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        loss, expected = engine(*_batch(step)), eager(*_batch(step))
        loss.backward()
        expected.backward()
        assert torch.equal(loss.detach(), expected.detach()), step
        grads = engine.gradients()
        for name, p in eager.named_parameters():
            assert torch.equal(grads[name], p.grad), (step, name)
        assert eager.norm.weight.grad.abs().sum() > 0  # through the STE: round's derivative is 0
        engine.step()
        reference.step()
        reference.zero_grad()
    for name, p in eager.named_parameters():
        assert torch.equal(dict(model.named_parameters())[name].detach(), p.detach()), name
    if engine.chunks is not None:
        assert engine.chunks.stats.evictions > 0 and engine.chunks.stats.unexpected_accesses == 0


def test_functions_train_like_eager_in_bf16():
    torch.manual_seed(0)
    model = Net()
    eager = copy.deepcopy(model)
    engine = fxstar.compile(model, Plan(precision="bf16"), example_inputs=_batch())
    loss, expected = engine(*_batch()), eager(*_batch())
    loss.backward()
    expected.backward()
    assert _kept_nodes(engine.program)
    torch.testing.assert_close(loss.float(), expected, rtol=5e-2, atol=0)
    grads = engine.gradients()
    for name, p in eager.named_parameters():
        assert close_in_norm(grads[name], p.grad, 0.15), name


class Widened(torch.autograd.Function):
    """A dtype, a device and a tuple among the arguments; a number among the outputs."""

    @staticmethod
    def forward(ctx, x, dtype, device, window):
        ctx.dtype, ctx.factor = x.dtype, window[0]
        return x.to(dtype=dtype, device=device) * window[0], x.shape[0]

    @staticmethod
    def backward(ctx, grad, _):
        return (grad * ctx.factor * 3).to(ctx.dtype), None, None, None


class WidenedNet(nn.Linear):
    def forward(self, x):
        y, rows = Widened.apply(super().forward(x), torch.float64, x.device, (2, 3))
        return y.sum() / rows


def test_a_function_with_a_dynamic_dimension_runs_other_sizes():
    """Sizes reach a node as symbols, and a number the Function returns is one of them: one
    capture, any batch, each with eager's loss and gradients."""
    torch.manual_seed(0)
    for model in (Net(), WidenedNet(16, 16)):
        batch = torch.export.Dim("batch", min=2, max=64)
        example = _batch() if isinstance(model, Net) else _batch()[:1]
        shapes = tuple({0: batch} for _ in example)
        program = capture(model, example, dynamic_shapes=shapes)
        for rows in (3, 8, 20):
            inputs = _batch(rows)
            inputs = tuple(torch.cat([t] * 3)[:rows] for t in inputs[: len(example)])
            loss, expected = program.run(inputs), model(*inputs)
            assert torch.equal(loss, expected), (type(model).__name__, rows)
            got = torch.autograd.grad(loss, list(model.parameters()))
            want = torch.autograd.grad(expected, list(model.parameters()))
            for g, w in zip(got, want, strict=True):
                assert torch.equal(g, w), (type(model).__name__, rows)


def test_an_operator_goes_with_its_function_class():
    """Operators are process-wide, one per class: a class that is gone takes its own along."""

    def capture_a_local_function():
        class Local(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x * 2

            @staticmethod
            def backward(ctx, grad):
                return grad * 2

        class Model(nn.Linear):
            def forward(self, x):
                return Local.apply(super().forward(x)).sum()

        capture(Model(4, 4), (torch.randn(2, 4),))
        assert Local in _ops
        return weakref.ref(Local)

    gone = capture_a_local_function()
    gc.collect()
    assert gone() is None
    assert all(cls.__name__ != "Local" for cls in list(_ops))


def test_another_threads_function_runs_as_torch_wrote_it_during_a_capture():
    """The routing is process-wide while a capture traces, but only the capturing thread's
    applications become operator calls."""
    seen = []

    class Probe(nn.Linear):
        def forward(self, x):
            def elsewhere():
                out = RoundSTE.apply(torch.full((2,), 1.4, requires_grad=True) * 1)
                seen.append(type(out.grad_fn).__name__)

            thread = threading.Thread(target=elsewhere)
            thread.start()
            thread.join()
            return RoundSTE.apply(super().forward(x)).sum()

    program = capture(Probe(4, 4), (torch.randn(2, 4),))
    assert seen == ["RoundSTEBackward"]
    assert len(_kept_nodes(program)) == 1


# -- refused by name -------------------------------------------------------------------------


class ToNumpy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.from_numpy(x.detach().numpy() * 2)

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class Positives(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x[x > 0]

    @staticmethod
    def backward(ctx, grad):
        return None


class NormalizedByMax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x / x.abs().max().item()

    @staticmethod
    def backward(ctx, grad):
        return grad


class KeepsWeightOnCtx(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.weight = weight  # not through save_for_backward: no saved-tensor hook sees it
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        return grad @ ctx.weight, None


class Doubles(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.mul_(2)

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class CallsModule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, module):
        return module(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class Applies(nn.Linear):
    def __init__(self, function):
        super().__init__(4, 4)
        self.function = function

    def forward(self, x):
        if self.function is KeepsWeightOnCtx:
            return KeepsWeightOnCtx.apply(x, self.weight).sum()
        if self.function is CallsModule:
            return CallsModule.apply(x, nn.Identity()).sum()
        return self.function.apply(super().forward(x) * 1).sum()


@pytest.mark.parametrize(
    ("function", "reason"),
    [
        (ToNumpy, "cannot run on fake tensors"),
        (NormalizedByMax, "cannot run on fake tensors"),
        (Positives, "shape .* follows tensor values"),
        (KeepsWeightOnCtx, "keeps a parameter .* as ctx.weight"),
        (Doubles, "writes its input"),
        (CallsModule, "takes a module"),
    ],
    ids=["numpy", "item", "data-dependent-shape", "weight-on-ctx", "in-place", "module"],
)
def test_a_function_that_cannot_be_kept_is_refused_by_name(function, reason):
    with pytest.raises(CaptureError, match=function.__qualname__) as info:
        capture(Applies(function), (torch.randn(2, 4),))
    assert info.match(reason)
    assert "try:" in str(info.value)


def test_a_function_applied_without_grad_runs_inline():
    """No backward to keep: its forward is traced as it is."""
    model = Applies(RoundSTE)
    with torch.no_grad():
        program = capture(model, (torch.randn(2, 4),))
    assert not _kept_nodes(program)
