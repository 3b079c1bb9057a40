"""Checkpoints: exact resume (plain and chunk engine), weights kept through compile, eager
loading, mismatches listed, a save that fails halfway leaves the previous checkpoint; damaged
or edited files are errors naming them, names are never globs, killed saves are cleaned up,
concurrent writers and tensor-parallel ranks leave one whole checkpoint."""

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import tiny_gpt, tokens
from safetensors import safe_open

import fxstar
import fxstar.saving as ckpt
from fxstar.dist_launch import spawn
from fxstar.engine import compile
from fxstar.models.gpt import GPT, GPTConfig
from fxstar.passes.chunk_layout import nonmodel_peak
from fxstar.plan import Plan
from fxstar.runtime.loss_scale import LossScaler

OPTIMIZER = {"type": "adamw", "lr": 1e-2, "weight_decay": 0.1}


def plan_for(kind: str) -> Plan:
    """'plain', 'chunk' (half the parameters fit) or 'hybrid' (room to keep some chunks and
    their optimizer on the compute tier)."""
    if kind == "plain":
        return Plan(optimizer=OPTIMIZER)
    if kind.startswith("tiled"):  # parameters cut into tiles: loaded by cutting them again
        tiles = {"in_splits": 2, "out_splits": 2, "min_size": 1024}
        return plan_for(kind.removeprefix("tiled").lstrip("+") or "plain").replace(
            tiled_linear=tiles
        )
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

    real_write = ckpt.write_safetensors

    def second_file_fails(path, tensors, metadata=None):
        if str(path).endswith(ckpt.TENSORS):
            raise OSError("disk full")
        return real_write(path, tensors, metadata)

    monkeypatch.setattr(ckpt, "write_safetensors", second_file_fails)
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


# -- damaged, edited and oddly named checkpoints; concurrent and killed saves -------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """An engine and its checkpoint after two steps; tests damage copies of the checkpoint."""
    engine, scheduler = build(plan_for("plain"))
    train(engine, scheduler, range(2))
    path = tmp_path_factory.mktemp("saved") / "ckpt"
    engine.save(path)
    return engine, path


def _copy(path: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(path, tmp_path / path.name))


def test_a_flipped_bit_is_an_error_naming_the_file_and_the_tensor(saved, tmp_path):
    path = _copy(saved[1], tmp_path)
    file = path / ckpt.PARAMETERS
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x40  # an exponent bit, in the middle of the weights
    file.write_bytes(data)
    for read in (fxstar.load, ckpt.load_parameters):
        with pytest.raises(fxstar.CheckpointError, match="does not match the checksum") as info:
            read(path)
        message = str(info.value)
        assert str(file) in message and "save the checkpoint again" in message
        (name,) = re.search(r"tensors whose bytes changed: ([^)]*)\)", message).group(1).split(", ")
        assert name in saved[0].state_dict()


def test_a_truncated_file_is_an_error_naming_it_with_or_without_checksums(saved, tmp_path):
    path = _copy(saved[1], tmp_path)
    file = path / ckpt.TENSORS
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(fxstar.CheckpointError, match="truncated") as info:
        fxstar.load(path)
    assert str(file) in str(info.value)
    # format 1 had no checksums: it still loads (with a warning), and safetensors' own error
    # on a truncated file is named too
    meta = json.loads((path / ckpt.STATE).read_text())
    del meta["files"]
    (path / ckpt.STATE).write_text(json.dumps({**meta, "version": 1}))
    damaged = pytest.raises(fxstar.CheckpointError, match="cannot be read")
    with pytest.warns(UserWarning, match="no checksums"), damaged as info:
        fxstar.load(path)
    assert str(file) in str(info.value)
    shutil.copy(saved[1] / ckpt.TENSORS, file)
    with pytest.warns(UserWarning, match="no checksums"):
        assert fxstar.load(path).step == 2


def _edit(path: Path, change) -> None:
    meta = json.loads((path / ckpt.STATE).read_text())
    change(meta)
    (path / ckpt.STATE).write_text(json.dumps(meta))


EDITS = {
    "invalid JSON": lambda path: (path / ckpt.STATE).write_text('{"format": "fxstar-chec'),
    "missing key": lambda path: _edit(path, lambda meta: meta["state"].pop("step")),
    "missing tensor": lambda path: _edit(
        path, lambda meta: meta["state"]["rng"].update(torch={"__tensor__": "nowhere"})
    ),
    "checksums gone": lambda path: _edit(path, lambda meta: meta.pop("files", None)),
    "relative path": lambda path: _edit(path, lambda meta: meta.update(tensors="../outside")),
    "absolute path": lambda path: _edit(
        path, lambda meta: meta.update(tensors=str(path.parent / "outside"))
    ),
}


@pytest.mark.parametrize("edit", EDITS)
def test_an_edited_training_json_is_an_error_naming_it(edit, saved, tmp_path):
    path = _copy(saved[1], tmp_path)
    shutil.copy(path / ckpt.TENSORS, tmp_path / "outside")  # what the path edits point at
    EDITS[edit](path)
    with pytest.raises(fxstar.CheckpointError) as info:
        fxstar.load(path)
    message = str(info.value)
    assert str(path / ckpt.STATE) in message and "save the checkpoint again" in message
    if "path" in edit:
        assert "not a file in" in message


def test_loss_scaler_state_sets_only_the_scaler_s_fields(tmp_path):
    scaler = LossScaler()
    with pytest.raises(fxstar.CheckpointError, match="unknown fields 'update'"):
        scaler.load_state_dict({"scale": 8.0, "update": None})  # would shadow the method
    assert scaler.scale == 2.0**16 and callable(scaler.update)
    engine = compile(tiny_gpt(), Plan(optimizer=OPTIMIZER), tokens())
    engine.scaler = LossScaler()
    engine.save(tmp_path / "ckpt")
    _edit(tmp_path / "ckpt", lambda meta: meta["state"]["loss_scaler"].update(update=None))
    with pytest.raises(fxstar.CheckpointError, match="unknown fields 'update'"):
        engine.load(tmp_path / "ckpt")
    assert callable(engine.scaler.update)


def test_a_save_removes_what_killed_saves_of_its_path_left(saved, tmp_path):
    engine, _ = saved
    target = tmp_path / "ckpt"
    subprocess.run(  # a save killed while writing: its tmp dir stays behind
        [sys.executable, "-c", "import os, sys, fxstar.saving as c\n"
         "c.write_atomically(sys.argv[1], lambda tmp: os._exit(0))", str(target)],
        check=True,
    )  # fmt: skip
    (left,) = os.listdir(tmp_path)
    assert left.startswith("ckpt.tmp-")
    host, dead = ckpt._host(), left.split("-")[-2]
    kept = [f"ckpt.tmp-{host}-{os.getpid()}-live0000", f"ckpt.tmp-elsewhere-{dead}-abcd1234",
            f"ckpt2.tmp-{host}-{dead}-abcd1234"]  # fmt: skip
    for name in kept:  # a live writer's, another host's, another checkpoint's
        (tmp_path / name).mkdir()
    engine.save(target)
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt", *kept])


@pytest.mark.parametrize("name", ["a[1]", "a*", "a?"])
def test_a_name_with_glob_characters_touches_only_its_own_checkpoint(name, saved, tmp_path):
    engine, _ = saved
    (tmp_path / "a1").mkdir()  # a neighbour caught by an interrupted save: only its backup
    backup = Path(shutil.copytree(saved[1], tmp_path / "a1.old-abcd1234"))
    engine.save(tmp_path / name)
    engine.save(tmp_path / name)  # the second moves the first aside and deletes it
    assert sorted(os.listdir(tmp_path)) == sorted([name, "a1", backup.name])
    assert fxstar.load(tmp_path / name).path == tmp_path / name
    (tmp_path / "a1").rmdir()
    with pytest.warns(UserWarning, match="interrupted save"):
        assert fxstar.load(tmp_path / "a1").path == backup


def test_load_of_a_glob_pattern_reads_no_other_checkpoint(saved, tmp_path):
    shutil.copytree(saved[1], tmp_path / "best1.old-abcd1234")  # best1's interrupted save
    with pytest.raises(fxstar.CheckpointError, match="no fxstar checkpoint"):
        fxstar.load(tmp_path / "best*")


def test_two_writers_of_one_path_each_leave_a_whole_checkpoint(tmp_path):
    target, errors = tmp_path / "ckpt", []

    def writer(tag: str) -> None:
        try:
            for i in range(30):
                ckpt.write_atomically(
                    target, lambda tmp, i=i: (tmp / "who").write_text(f"{tag}{i}")
                )
        except Exception as error:
            errors.append(error)

    threads = [threading.Thread(target=writer, args=(tag,)) for tag in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert os.listdir(tmp_path) == ["ckpt"] and (target / "who").read_text() in ("a29", "b29")


def _resume_tensor_parallel(rank: int, world: int, path: str) -> dict:
    """Train 3 steps, save, train 3 more; then a fresh engine (other weights, other RNG) loads
    the checkpoint and trains the same 3 steps. Every rank saves and loads its own state."""
    plan = Plan(tensor_parallel={"size": world, "sequence_parallel": True}, optimizer=OPTIMIZER)

    def build_tp(seed: int):
        engine = compile(tiny_gpt(seed), plan, tokens())
        scheduler = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=2, gamma=0.7)
        engine.attach_scheduler(scheduler)
        return engine, scheduler

    engine, scheduler = build_tp(0)
    torch.manual_seed(1234 + rank)  # the ranks' RNGs differ: each must get its own back
    train(engine, scheduler, range(3))
    saved = {k: v.clone() for k, v in engine.state_dict().items()}
    returned = engine.save(path)  # every rank calls it: the parameters are gathered
    expected = train(engine, scheduler, range(3, 6))
    final = {k: v.clone() for k, v in engine.state_dict().items()}

    torch.manual_seed(999)  # the resumed run must not depend on the RNG it finds
    engine, scheduler = build_tp(5)  # other weights: the load must overwrite them
    engine.load(path)
    got = train(engine, scheduler, range(3, 6))
    return {
        "returned": returned,
        "listing": sorted(os.listdir(os.path.dirname(path))),
        "saved": saved,
        "same_losses": all(torch.equal(a, b) for a, b in zip(got, expected)),
        "losses": (got, expected),
        "same_state": _equal(engine.state_dict(), final),
    }


def test_a_tensor_parallel_run_resumes_bitwise_on_every_rank(tmp_path):
    path = tmp_path / "ckpt"
    results = spawn(_resume_tensor_parallel, 2, str(path))
    for rank, result in enumerate(results):
        assert result["returned"] == str(path) and result["listing"] == ["ckpt"]
        assert result["same_losses"], (rank, result["losses"])
        assert result["same_state"], rank
    files = sorted(os.listdir(path))
    assert files == sorted([ckpt.PARAMETERS, ckpt.TENSORS, ckpt.STATE, ckpt._rank_file(1)])
    model = tiny_gpt(5)
    checkpoint = fxstar.load(path, model)  # the full weights, not rank 0's shards
    assert checkpoint.meta["ranks"] == 2
    assert _equal(model.state_dict(), results[0]["saved"])
    # each rank's training state is checked like the others: its own checksums
    assert set(checkpoint.meta["files"]) == {ckpt.PARAMETERS, ckpt.TENSORS, ckpt._rank_file(1)}
    ranked = ckpt._rank_state(checkpoint.path, checkpoint.meta, 1)
    assert ranked["step"] == checkpoint.state["step"]
    assert not torch.equal(ranked["rng"]["torch"], checkpoint.state["rng"]["torch"])
    damaged = _copy(path, tmp_path / "damaged")
    file = damaged / ckpt._rank_file(1)
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(fxstar.CheckpointError, match="truncated"):
        ckpt._rank_state(damaged, fxstar.load(damaged).meta, 1)
    # another world size (here: one process) is refused, naming both
    engine = compile(tiny_gpt(), Plan(optimizer=OPTIMIZER), tokens())
    with pytest.raises(fxstar.CheckpointError, match="2 tensor-parallel ranks.*runs on 1"):
        engine.load(path)


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
    monkeypatch.setattr(ckpt, "_parameters", None)  # the eager path would fail here
    engine.load(tmp_path / "ckpt")
    with WeightSource(tmp_path / "ckpt" / ckpt.PARAMETERS) as source:
        assert len(live) == len(source.names())  # every stored tensor, each read once
    assert _equal(engine.state_dict(), saved)


def test_write_safetensors_round_trips_every_dtype_and_its_checksums(tmp_path):
    import zlib

    from fxstar.weights import write_safetensors

    tensors = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16), "i64": torch.arange(7),
        "flag": torch.tensor([True, False, True]), "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4), "view": torch.randn(6, 6)[:, 1],
    }  # fmt: skip
    crcs = write_safetensors(tmp_path / "t.safetensors", tensors, {"format": "pt", "k": "v"})
    with safe_open(tmp_path / "t.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt", "k": "v"}
        for name, t in tensors.items():
            read = f.get_tensor(name)
            assert read.dtype == t.dtype and torch.equal(read, t), name
            data = read.reshape(-1).view(torch.uint8).numpy().tobytes() if read.numel() else b""
            assert crcs[name] == zlib.crc32(data), name
