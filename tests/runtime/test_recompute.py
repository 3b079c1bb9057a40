"""recompute: a checkpoint region that writes buffers in place (BatchNorm's running statistics,
a counter, an EMA a module reads back) leaves them as eager PyTorch does, however it is
checkpointed, with chunks paged or not, with activation offload, in fp32 and bf16."""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import activation_budget, hf_gpt2, hf_llama, tiny_gpt, tokens
from torch import nn

from fxstar.dump import NOTES_KEY
from fxstar.engine import compile
from fxstar.passes.activation_checkpoint import region_calls
from fxstar.plan import Plan
from fxstar.runtime.recompute import COPIED_INPUTS_KEY


class Tally(nn.Module):
    """Buffers a module updates in forward and reads back: a counter bumped in place, one
    bumped through a view, and an EMA of its input's mean that scales the output."""

    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("seen", torch.zeros(2))
        self.register_buffer("ema", torch.ones(()))

    def forward(self, x):
        self.count += 1
        self.seen[0].add_(1)
        self.ema.mul_(0.9).add_(x.detach().mean())
        return x * self.ema


class ResBlock(nn.Module):
    """ResNet's basic block, with dropout, a Tally, and a BatchNorm under torch.no_grad()
    (frozen statistics of the input, which still update in train mode)."""

    def __init__(self, width: int):
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.frozen = nn.BatchNorm2d(width, affine=False)
        self.drop = nn.Dropout(0.1)
        self.tally = Tally()

    def forward(self, x, scale):
        with torch.no_grad():
            gate = torch.sigmoid(self.frozen(x).mean())
        h = torch.relu(self.bn1(self.conv1(x)))
        h = self.drop(self.tally(self.bn2(self.conv2(h))))
        return torch.relu(x + torch.tanh(h * gate + scale))  # tanh saves what scale gives


class TinyResNet(nn.Module):
    """A stem, two residual blocks and a head; `scale` is a buffer the blocks read and the
    model decays after them (a value the blocks' recomputation must not see)."""

    def __init__(self, width: int = 4, classes: int = 3):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width))
        self.layers = nn.ModuleList(ResBlock(width) for _ in range(2))
        self.head = nn.Linear(width, classes)
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x, y):
        x = torch.relu(self.stem(x))
        for layer in self.layers:
            x = layer(x, self.scale)
        self.scale.mul_(0.99)
        return F.cross_entropy(self.head(x.mean((2, 3))), y)


def resnet() -> TinyResNet:
    torch.manual_seed(0)
    return TinyResNet()


g = torch.Generator().manual_seed(1)
IMAGES = (torch.randn(4, 3, 6, 6, generator=g), torch.randint(0, 3, (4,), generator=g))


def buffers(model) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in model.named_buffers()}


def assert_matches_eager(make, plan: Plan, args=(), kwargs=None, *, steps: int = 3,
                         train: bool = True, rel: float = 0.0):  # fmt: skip
    """`steps` SGD steps of make() compiled under `plan` against make() in eager, dropout
    drawn from one seed: the loss, every gradient and every buffer after each step equal
    (bitwise with rel=0; else within `rel` of eager's norm)."""
    kwargs = kwargs or {}
    eager = make().train(train)
    engine = compile(make().train(train), plan.replace(optimizer={"type": "sgd", "lr": 0.1}),
                     args, kwargs)  # fmt: skip
    reference = torch.optim.SGD([p for p in eager.parameters() if p.requires_grad], lr=0.1,
                                momentum=0.9)  # fmt: skip

    def same(got, want, what):
        if rel == 0.0:
            assert torch.equal(got, want), what
        else:
            got, want = got.double(), want.double()
            assert (got - want).norm() <= rel * want.norm() + 1e-6, what

    for step in range(steps):
        losses = []
        for model in (eager, engine):
            torch.manual_seed(step)
            out = model(*args, **kwargs)
            losses.append(out if isinstance(out, torch.Tensor) else out.loss)
            losses[-1].backward()
        same(losses[1].detach(), losses[0].detach(), ("loss", step))
        for (name, p), (_, q) in zip(eager.named_parameters(), engine.named_parameters()):
            if p.grad is None:
                assert q.grad is None, (name, step)
            else:
                same(q.grad, p.grad, (name, step))
        got, want = buffers(engine), buffers(eager)
        assert got.keys() == want.keys()
        for name in want:
            same(got[name], want[name], (name, step))
        reference.step()
        reference.zero_grad()
        engine.step()
    return engine


def paged(make, args=(), kwargs=None) -> int:
    """A device_memory at which the chunks page: the activations and half the parameters."""
    return activation_budget(make, 0.5, example_inputs=args, example_kwargs=kwargs)


SLOW = pytest.mark.slow
PLANS = [  # (plan options, device_memory so that chunks page)
    pytest.param({"checkpoint": "blocks"}, False, id="blocks"),
    pytest.param({"checkpoint": "blocks"}, True, id="blocks-chunks"),
    pytest.param({"checkpoint": "blocks", "offload_activations": True}, True, id="offload-chunks"),
    pytest.param({"checkpoint": ["layers.*.tally", "layers.*.bn2"]}, False, id="patterns"),
    pytest.param({"checkpoint": "blocks", "offload_activations": True}, False, id="offload",
                 marks=SLOW),
    pytest.param({"checkpoint": ["layers.*.tally", "layers.*.bn2"]}, True, id="patterns-chunks",
                 marks=SLOW),
    pytest.param({"checkpoint": "auto", "activation_memory": 1}, False, id="auto", marks=SLOW),
    pytest.param({"checkpoint": "auto", "activation_memory": 1}, True, id="auto-chunks",
                 marks=SLOW),
    pytest.param({"checkpoint": "blocks", "checkpoint_every": 2}, True, id="every_2-chunks",
                 marks=SLOW),
]  # fmt: skip


@pytest.mark.parametrize(("options", "chunks"), PLANS)
@pytest.mark.filterwarnings("ignore:checkpoint='auto'.*cannot be met:UserWarning")  # 1 byte
def test_buffers_written_in_regions_are_updated_once_as_in_eager(options, chunks):
    plan = Plan(**options)
    if chunks:
        plan = plan.replace(device_memory=paged(resnet, IMAGES))
    engine = assert_matches_eager(resnet, plan, IMAGES, steps=2)
    assert region_calls(engine.program.graph_module)
    assert engine.chunks is not None if chunks else engine.chunks is None
    assert engine.model.layers[0].bn1.num_batches_tracked.item() == 2
    assert engine.model.layers[1].tally.count.item() == 2


def test_the_regions_recompute_from_copies_of_what_is_written():
    engine = compile(resnet(), Plan(checkpoint="blocks"), IMAGES)
    fed = engine.program.placeholder_kinds()
    for i, (call, region) in enumerate(region_calls(engine.program.graph_module)):
        copied = {fed[n].target for n in region.meta[COPIED_INPUTS_KEY]}
        assert len(copied) == 13 and f"layers.{i}.tally.ema" in copied and "scale" in copied
        assert call.meta[NOTES_KEY]["writes"].startswith(f"layers.{i}.frozen.num_batches_tracked")


def test_eval_mode_updates_no_statistics_and_matches_eager():
    engine = assert_matches_eager(resnet, Plan(checkpoint="blocks"), IMAGES, train=False, steps=2)
    assert engine.model.layers[0].bn1.num_batches_tracked.item() == 0
    assert engine.model.layers[0].tally.count.item() == 2  # a counter counts in eval too


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="blocks", marks=SLOW),
        pytest.param({"offload_activations": True}, id="offload"),
    ],
)
def test_bf16_recomputation_changes_no_buffer(options):
    """bf16 checkpointed equals bf16 without checkpoint bitwise (same arithmetic), and both
    are close to fp32 eager."""
    plans = [Plan(precision="bf16"), Plan(precision="bf16", checkpoint="blocks", **options)]
    engines = [compile(resnet(), plan, IMAGES) for plan in plans]
    for step in range(3):
        losses = []
        for engine in engines:
            torch.manual_seed(step)
            losses.append(engine(*IMAGES))
            losses[-1].backward()
        assert torch.equal(*losses), step
        grads = [engine.gradients() for engine in engines]
        for name, grad in grads[0].items():
            assert torch.equal(grad, grads[1][name]), (name, step)
        for name, b in buffers(engines[0]).items():
            assert torch.equal(b, buffers(engines[1])[name]), (name, step)
        for engine in engines:
            engine.zero_grad()
    eager = resnet()
    for step in range(3):
        torch.manual_seed(step)
        eager(*IMAGES)
    for name, want in buffers(eager).items():
        got = buffers(engines[1])[name].to(want.dtype)
        assert (got - want).double().norm() <= 0.02 * want.double().norm() + 1e-3, name


def hf_resnet() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 8], depths=[1, 1],
                                       num_labels=3)  # fmt: skip
    torch.manual_seed(0)
    return transformers.ResNetForImageClassification(config)


HF_IMAGES = {"pixel_values": torch.randn(2, 3, 16, 16, generator=g),
             "labels": torch.randint(0, 3, (2,), generator=g)}  # fmt: skip


@pytest.mark.parametrize(
    "chunks", [pytest.param(False, id="no_chunks", marks=SLOW), pytest.param(True, id="chunks")]
)
def test_transformers_resnet_keeps_its_batchnorm_statistics_like_eager(chunks):
    plan = Plan(checkpoint="blocks")
    if chunks:
        plan = plan.replace(device_memory=paged(hf_resnet, kwargs=HF_IMAGES))
    engine = assert_matches_eager(hf_resnet, plan, kwargs=HF_IMAGES, steps=2)
    assert engine.chunks is not None if chunks else engine.chunks is None
    decision = engine.program.decisions.checkpoint_regions
    assert len(decision.chosen) == 2 and all(r.writes for r in decision.chosen)


@pytest.mark.parametrize("make", [tiny_gpt, hf_gpt2, hf_llama], ids=["gpt", "gpt2", "llama"])
def test_models_that_write_no_buffer_copy_nothing(make):
    ids, targets = tokens()
    args, kwargs = (
        ((ids, targets), {}) if make is tiny_gpt else ((), {"input_ids": ids, "labels": targets})
    )
    engine = compile(make(), Plan(checkpoint="blocks"), args, kwargs)
    decision = engine.program.decisions.checkpoint_regions
    assert decision.chosen and not any(r.writes or r.copied for r in decision.chosen)
    for _, region in region_calls(engine.program.graph_module):
        assert COPIED_INPUTS_KEY not in region.meta
    # trains bitwise like eager, dropout replayed: tests/passes/test_activation_checkpoint.py


def test_a_second_backward_of_one_forward_recomputes_from_the_same_values():
    model = resnet()
    eager = copy.deepcopy(model)
    engine = compile(model, Plan(checkpoint="blocks"), IMAGES)
    torch.manual_seed(0)
    loss = engine(*IMAGES)
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in engine.parameters()]
    engine.zero_grad()
    loss.backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(first, engine.parameters()))
    torch.manual_seed(0)
    eager(*IMAGES)
    for name, want in buffers(eager).items():
        assert torch.equal(buffers(engine)[name], want), name
