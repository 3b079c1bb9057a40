"""Checkpoints: exact resume (plain, chunk, hybrid and tiled engines), weights kept through
compile, loading into the eager model, mismatches listed, a resume that reads one tensor at a
time (fxstar/saving/checkpoint.py)."""

import pytest
import torch
from conftest import tiny_gpt, tokens
from safetensors import safe_open
from trained import (
    build,
    equal,
    plan_for,
    train,
)

import fxstar
import fxstar.saving as ckpt
import fxstar.saving.checkpoint as checkpoint_module
from fxstar.engine import compile
from fxstar.models.gpt import GPT, GPTConfig
from fxstar.plan import Plan


@pytest.mark.parametrize("kind", ["plain", "chunk", "hybrid", "tiled", "tiled+chunk"])
def test_resume_into_a_fresh_engine_is_bitwise_exact(kind, tmp_path):
    plan = plan_for(kind)
    engine, scheduler = build(plan)
    if kind in ("chunk", "hybrid"):
        assert engine.chunks is not None and len(engine.chunks.layout.chunks) >= 2
    torch.manual_seed(1234)
    expected = train(engine, scheduler, range(20))
    kept = engine.optimizer.device_chunks if engine.chunks is not None else []
    if kind in ("chunk", "hybrid"):
        assert bool(kept) == (kind == "hybrid")

    engine, scheduler = build(plan)
    torch.manual_seed(1234)
    first = train(engine, scheduler, range(10))
    engine.save(tmp_path / "ckpt")
    torch.manual_seed(999)  # the resumed run must not depend on the RNG it finds
    engine, scheduler = build(plan, seed=5)  # other weights: the load must overwrite them
    engine.load(tmp_path / "ckpt")
    assert engine.training_state()["step"]["optimizer_steps"] == 10
    if engine.chunks is not None:  # the same chunks are updated by the same kernels as before
        assert engine.optimizer.device_chunks == kept
    rest = train(engine, scheduler, range(10, 20))
    for step, (got, want) in enumerate(zip(first + rest, expected)):
        assert torch.equal(got, want), (step, got, want)


def test_load_restores_a_diverged_engine_in_place(tmp_path):
    engine, scheduler = build(plan_for("plain"))
    torch.manual_seed(1)
    train(engine, scheduler, range(3))
    engine.save(tmp_path / "ckpt")
    expected = train(engine, scheduler, range(3, 6))
    params = list(engine.parameters())
    engine.load(tmp_path / "ckpt")
    assert all(p is q for p, q in zip(params, engine.parameters()))  # copied, not replaced
    assert engine.optimizer.param_groups[0]["params"][0] is params[0]
    got = train(engine, scheduler, range(3, 6))
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("kind", ["plain", "chunk"])
def test_pretrained_weights_survive_compile(kind):
    model = tiny_gpt(3)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()  # "trained" values no initialiser would make
    original = {k: v.clone() for k, v in model.state_dict().items()}
    engine = compile(model, plan_for(kind), tokens())
    state = engine.state_dict()
    assert list(state) == list(original)
    for name, value in original.items():
        assert torch.equal(state[name], value), name
    for name, p in engine.named_parameters():
        assert torch.equal(p, original[name]), name


def test_parameters_load_into_the_eager_model(tmp_path):
    engine, scheduler = build(plan_for("plain"))
    train(engine, scheduler, range(2))
    engine.save(tmp_path / "ckpt")
    with safe_open(tmp_path / "ckpt" / ckpt.PARAMETERS, "pt") as f:
        keys = set(f.keys())
        aliases = f.metadata()[ckpt.ALIASES_KEY]
    assert "head.weight" not in keys and '"head.weight": "wte.weight"' in aliases  # tied: once
    eager = tiny_gpt(7)
    eager.load_state_dict(ckpt.load_parameters(tmp_path / "ckpt"))
    for name, value in engine.state_dict().items():
        assert torch.equal(eager.state_dict()[name], value), name
    assert eager.head.weight is eager.wte.weight
    # fxstar.load(dir, model) does the same, and a compiled model then keeps the weights
    fresh = tiny_gpt(8)
    checkpoint = fxstar.load(tmp_path / "ckpt", fresh)
    assert checkpoint.step == 2 and checkpoint.state["scheduler"]["last_epoch"] == 2
    assert torch.equal(fresh.wte.weight, engine.state_dict()["wte.weight"])
    for name, value in engine.state_dict().items():  # read one tensor at a time into `fresh`
        assert torch.equal(fresh.state_dict()[name], value), name
    assert checkpoint.parameters["h.0.ln_1.weight"].data_ptr() == fresh.h[0].ln_1.weight.data_ptr()


def test_a_mismatched_checkpoint_is_refused_with_every_difference(tmp_path):
    engine, _ = build(plan_for("plain"))
    engine.save(tmp_path / "ckpt")
    bigger = GPT(GPTConfig(n_layer=3, vocab_size=72))
    before = {k: v.clone() for k, v in bigger.state_dict().items()}
    with pytest.raises(fxstar.CheckpointError) as info:
        fxstar.load(tmp_path / "ckpt", bigger)
    message = str(info.value)
    assert message.count("missing: h.2.") == 12
    assert "shape mismatch: wte.weight is (64, 32) in the checkpoint, (72, 32)" in message
    assert "shape mismatch: head.weight" in message
    assert all(torch.equal(v, bigger.state_dict()[k]) for k, v in before.items())  # untouched
    smaller = compile(GPT(GPTConfig(n_layer=1)), Plan(), tokens())
    with pytest.raises(fxstar.CheckpointError, match="unexpected: h.1.attn"):
        smaller.load(tmp_path / "ckpt")


def test_engine_load_reads_the_parameters_one_tensor_at_a_time(tmp_path, monkeypatch):
    """A resume never holds the checkpoint's parameters whole: each tensor read is gone
    (copied into the engine's own) before the next is read, and the eager reader of
    fxstar.load is not used."""
    import weakref

    from fxstar.weights import WeightSource

    engine, scheduler = build(plan_for("chunk"))
    train(engine, scheduler, range(2))
    engine.save(tmp_path / "ckpt")
    saved = {k: v.clone() for k, v in engine.state_dict().items()}
    train(engine, scheduler, range(2, 4))
    live: list[weakref.ref] = []
    real_read = WeightSource.read

    def read(self, name):
        assert all(ref() is None for ref in live), "two parameters in memory at once"
        tensor = real_read(self, name)
        live.append(weakref.ref(tensor))
        return tensor

    monkeypatch.setattr(WeightSource, "read", read)
    # the eager path would fail here
    monkeypatch.setattr(checkpoint_module, "parameter_values", None)
    engine.load(tmp_path / "ckpt")
    with WeightSource(tmp_path / "ckpt" / ckpt.PARAMETERS) as source:
        assert len(live) == len(source.names())  # every stored tensor, each read once
    assert equal(engine.state_dict(), saved)


class ScaledLinear(torch.nn.Module):
    """A float buffer in the state dict (as BatchNorm's running statistics are)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 0.5))

    def forward(self, x):
        return (self.linear(x) * self.scale).square().mean()


def test_a_low_precision_state_dict_has_the_model_s_own_dtypes():
    """bf16 traces a bf16 copy, buffers included; the state dict still has the eager model's
    dtypes (fp32 masters, buffers back in their own dtype), so it loads without a cast."""
    torch.manual_seed(0)
    model = ScaledLinear()
    engine = compile(model, Plan(precision="bf16"), (torch.randn(4, 8, dtype=torch.bfloat16),))
    state = engine.state_dict()
    assert {k: v.dtype for k, v in state.items()} == {k: torch.float32 for k in state}
    assert torch.equal(state["scale"], model.scale)
