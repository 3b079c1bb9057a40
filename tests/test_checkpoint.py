"""Checkpoints: exact resume (plain and chunk engine), weights kept through compile, eager
loading, mismatches listed, and a save that fails halfway leaves the previous checkpoint."""

import os

import pytest
import torch
from conftest import tiny_gpt, tokens
from safetensors import safe_open

import fxstar
import fxstar.checkpoint as ckpt
from fxstar.engine import compile
from fxstar.models.gpt import GPT, GPTConfig
from fxstar.passes.chunk_layout import nonmodel_peak
from fxstar.plan import Plan

OPTIMIZER = {"type": "adamw", "lr": 1e-2, "weight_decay": 0.1}


def plan_for(kind: str) -> Plan:
    """'plain', 'chunk' (half the parameters fit) or 'hybrid' (room to keep some chunks and
    their optimizer on the compute tier)."""
    if kind == "plain":
        return Plan(optimizer=OPTIMIZER)
    ids, targets = tokens()
    program = compile(tiny_gpt(), Plan(passes=["shape_memory"]), (ids, targets)).program
    share = 0.5 if kind == "chunk" else 2.0
    budget = nonmodel_peak(program) + int(share * program.param_bytes)
    return Plan(optimizer=OPTIMIZER, device_memory=budget)


def build(plan: Plan, seed: int = 0):
    """An engine over a tiny GPT with dropout, and an attached lr scheduler."""
    engine = compile(tiny_gpt(seed), plan, tokens())
    scheduler = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=3, gamma=0.7)
    engine.attach_scheduler(scheduler)
    return engine, scheduler


def train(engine, scheduler, steps: range) -> list[torch.Tensor]:
    losses = []
    for step in steps:
        loss = engine(*tokens(seed=100 + step))
        loss.backward()
        if engine.step():
            scheduler.step()
        losses.append(loss.detach().clone())
    return losses


@pytest.mark.parametrize("kind", ["plain", "chunk", "hybrid"])
def test_resume_into_a_fresh_engine_is_bitwise_exact(kind, tmp_path):
    plan = plan_for(kind)
    engine, scheduler = build(plan)
    if kind != "plain":
        assert engine.chunks is not None and len(engine.chunks.layout.chunks) >= 2
    torch.manual_seed(1234)
    expected = train(engine, scheduler, range(20))
    kept = engine.optimizer.device_chunks if kind != "plain" else []
    assert bool(kept) == (kind == "hybrid")

    engine, scheduler = build(plan)
    torch.manual_seed(1234)
    first = train(engine, scheduler, range(10))
    engine.save(tmp_path / "ckpt")
    torch.manual_seed(999)  # the resumed run must not depend on the RNG it finds
    engine, scheduler = build(plan, seed=5)  # other weights: the load must overwrite them
    engine.load(tmp_path / "ckpt")
    assert engine.training_state()["step"]["optimizer_steps"] == 10
    if kind != "plain":  # the same chunks are updated by the same kernels as before
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


def test_training_state_needs_somewhere_to_go(tmp_path):
    engine, _ = build(plan_for("plain"))
    engine.save(tmp_path / "ckpt")
    bare = compile(tiny_gpt(), Plan(optimizer=OPTIMIZER), tokens())
    with pytest.raises(fxstar.CheckpointError, match="'scheduler' state"):
        bare.load(tmp_path / "ckpt")
    bare.load(tmp_path / "ckpt", strict=False)
    with pytest.raises(ValueError, match="engine.optimizer"):
        other = torch.optim.SGD(tiny_gpt().parameters(), lr=0.1)
        bare.attach_scheduler(torch.optim.lr_scheduler.StepLR(other, 1))


def test_a_save_failing_halfway_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    engine, scheduler = build(plan_for("plain"))
    train(engine, scheduler, range(2))
    target = tmp_path / "ckpt"
    engine.save(target)
    saved = {k: v.clone() for k, v in engine.state_dict().items()}
    train(engine, scheduler, range(2, 4))

    real_save_file = ckpt.save_file

    def second_file_fails(tensors, path, metadata=None):
        if str(path).endswith(ckpt.TENSORS):
            raise OSError("disk full")
        real_save_file(tensors, path, metadata=metadata)

    monkeypatch.setattr(ckpt, "save_file", second_file_fails)
    with pytest.raises(OSError, match="disk full"):
        engine.save(target)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # the half-written one is gone
    assert _equal(ckpt.load_parameters(target), saved)
    assert fxstar.load(target).step == 2

    # a crash between moving the old one aside and renaming the new one in: load finds it
    real_replace = os.replace
    calls = []

    def crash_on_second_rename(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_second_rename)
    with pytest.raises(KeyboardInterrupt):
        engine.save(target)
    monkeypatch.undo()
    assert not target.exists()
    with pytest.warns(UserWarning, match="interrupted save"):
        checkpoint = fxstar.load(target)
    assert checkpoint.step == 2 and _equal(checkpoint.parameters, saved)

    engine.save(target)  # the next save works and clears what the crash left aside
    assert fxstar.load(target).step == 4
    assert not [name for name in os.listdir(tmp_path) if ".old-" in name]


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_optimizer_state_follows_names_when_the_order_changes(tmp_path):
    engine, scheduler = build(plan_for("plain"))
    train(engine, scheduler, range(2))
    engine.save(tmp_path / "ckpt")
    name_of = {id(p): n for n, p in engine.named_parameters()}
    saved = {name_of[id(p)]: s for p, s in engine.optimizer.state.items()}
    other = compile(tiny_gpt(), Plan(optimizer=OPTIMIZER), tokens())
    groups = [{**g, "params": g["params"][::-1]} for g in other.optimizer.param_groups]
    other._optimizer = torch.optim.AdamW(groups, lr=1e-2)  # same tensors, another order
    other.load(tmp_path / "ckpt", strict=False)
    name_of = {id(p): n for n, p in other.named_parameters()}
    for p, state in other.optimizer.state.items():
        assert torch.equal(state["exp_avg"], saved[name_of[id(p)]]["exp_avg"])


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
