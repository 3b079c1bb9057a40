"""The training state: every saved-along object has somewhere to go, optimizer state follows
the parameters' names, the loss scaler's fields and the moments' shapes are checked before
anything is restored (fxstar/saving/training_state.py)."""

import pytest
import torch
from conftest import tiny_gpt, tokens
from safetensors import safe_open
from trained import (
    OPTIMIZER,
    build,
    copy_checkpoint,
    edit_json,
    equal,
    plan_for,
    reseal,
    save_trained,
    train,
)

import fxstar
import fxstar.saving as ckpt
from fxstar.engine import compile
from fxstar.plan import Plan
from fxstar.runtime.loss_scale import LossScaler

# an engine and its checkpoint after two steps, once per module; tests damage copies of it
saved = pytest.fixture(save_trained, scope="module", name="saved")


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


def test_loss_scaler_state_sets_only_the_scaler_s_fields(tmp_path):
    scaler = LossScaler()
    with pytest.raises(fxstar.CheckpointError, match="unknown fields 'update'"):
        scaler.load_state_dict({"scale": 8.0, "update": None})  # would shadow the method
    assert scaler.scale == 2.0**16 and callable(scaler.update)
    engine = compile(tiny_gpt(), Plan(optimizer=OPTIMIZER), tokens())
    engine.scaler = LossScaler()
    engine.save(tmp_path / "ckpt")
    edit_json(tmp_path / "ckpt", lambda meta: meta["state"]["loss_scaler"].update(update=None))
    reseal(tmp_path / "ckpt")
    with pytest.raises(fxstar.CheckpointError, match="unknown fields 'update'"):
        engine.load(tmp_path / "ckpt")
    assert callable(engine.scaler.update)


def test_loss_scaler_values_are_checked(tmp_path):
    engine = compile(tiny_gpt(), Plan(optimizer=OPTIMIZER), tokens())
    engine.scaler = LossScaler()
    engine.save(tmp_path / "ckpt")
    for field, value, named in (("window", 0, "window: must be >= 1"),
                                ("scale", float("inf"), "scale: must be in"),
                                ("dynamic", "yes", "dynamic: must be a bool")):  # fmt: skip
        path = copy_checkpoint(tmp_path / "ckpt", tmp_path / field)
        edit_json(path, lambda meta, f=field, v=value: meta["state"]["loss_scaler"].update({f: v}))
        reseal(path)
        with pytest.raises(fxstar.CheckpointError, match=f"loss_scaler.{named}"):
            engine.load(path)
    assert engine.scaler == LossScaler()


def test_the_loss_scaler_checks_cover_every_field_of_the_loss_scaler():
    from dataclasses import fields

    from fxstar.checkpoint_values import LOSS_SCALER_FIELDS

    assert set(LOSS_SCALER_FIELDS) == {f.name for f in fields(LossScaler)}


def test_moments_of_another_shape_are_refused_before_anything_is_restored(saved, tmp_path):
    """A moment of the wrong shape would be broadcast into its parameter's by a copy."""
    from fxstar.weights import write_safetensors

    engine, _ = saved
    path = copy_checkpoint(saved[1], tmp_path)
    with safe_open(path / ckpt.TENSORS, "pt") as f:
        keys = f.keys()  # safe_open is not iterable
        tensors = {k: f.get_tensor(k).clone() for k in keys}  # not the mapped file: rewritten
        metadata = f.metadata()
    key = next(k for k in tensors if k.endswith("/exp_avg") and tensors[k].dim() == 2)
    tensors[key] = tensors[key][:1].clone()  # broadcastable to the parameter's shape
    write_safetensors(path / ckpt.TENSORS, tensors, metadata)
    reseal(path)
    before = {k: v.clone() for k, v in engine.state_dict().items()}
    with pytest.raises(fxstar.CheckpointError, match=r"exp_avg: must have its parameter's shape"):
        engine.load(path)
    assert equal(engine.state_dict(), before)


STEP_ZERO_PLANS = {
    "fp32 chunks": {},
    "bf16": {"precision": "bf16"},
    "8-bit moments": {"precision": "bf16", "optimizer": {**OPTIMIZER, "state_dtype": "8bit"}},
    "bf16, disk tier": {"precision": "bf16", "disk": "state"},
}


@pytest.mark.parametrize("options", STEP_ZERO_PLANS.values(), ids=STEP_ZERO_PLANS.keys())
def test_a_checkpoint_saved_before_the_first_step_starts_the_optimizer_again(options, tmp_path):
    """Saved before any update, the optimizer state has no entries: loaded into an engine
    that trained, its moments start from zero as a fresh engine's do (not this run's)."""
    if "disk" in options:
        options = {**options, "disk": str(tmp_path / options["disk"])}
    plan = Plan(**{"optimizer": OPTIMIZER, "device_memory": "auto", "chunk_size": 16384,
                   **options})  # fmt: skip
    runs = []
    for trained in (True, False):  # the second never trained nor loaded
        engine, scheduler = build(plan)
        if trained:
            engine.save(tmp_path / "step0")
            train(engine, scheduler, range(2))
            engine.load(tmp_path / "step0")
        runs.append(train(engine, scheduler, range(2, 4)) + [*engine.state_dict().values()])
        engine.close()
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_another_optimizers_state_is_refused_before_anything_is_restored(tmp_path):
    """SGD's momentum into Adam (or Adam's moments into SGD) would be dropped or misread."""
    sgd, adam = Plan(optimizer={"type": "sgd", "lr": 0.1}), Plan(optimizer=OPTIMIZER)
    for saving, loading in ((sgd, adam), (adam, sgd)):
        engine, scheduler = build(saving)
        train(engine, scheduler, range(1))
        engine.save(tmp_path / "other")
        engine, scheduler = build(loading)
        train(engine, scheduler, range(1))
        before = {k: v.clone() for k, v in engine.state_dict().items()}
        with pytest.raises(fxstar.CheckpointError, match=r"optimizer.state\[0\] holds .* but "
                           "this engine's optimizer is"):  # fmt: skip
            engine.load(tmp_path / "other")
        assert equal(engine.state_dict(), before)  # and the state is whole: it reads
        train(engine, scheduler, range(1, 2))
