"""Checkpoints: exact resume (plain and chunk engine), weights kept through compile, eager
loading, mismatches listed, a save that fails halfway leaves the previous checkpoint; damaged
or edited files are errors naming them, names are never globs, killed saves are cleaned up,
concurrent writers and tensor-parallel ranks leave one whole checkpoint."""

import contextlib
import json
import os
import re
import shutil
import socket
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
    (path / ckpt.MANIFEST).unlink()  # format 1: no manifest and no records in training.json
    meta = json.loads((path / ckpt.STATE).read_text())
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


def _reseal(path: Path) -> None:
    """Record every file's size and CRC in the manifest again, as a tool that edits a
    checkpoint knowingly would: then only the values' own checks stand in the way."""
    if not (path / ckpt.MANIFEST).exists():
        return
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    for name, record in manifest["files"].items():
        record.update(ckpt._record(path / name))
        if "tensors" in record:
            with safe_open(path / name, "pt") as f:
                keys = f.keys()  # safe_open is not iterable
                record["tensors"] = {k: ckpt._tensor_crc(f.get_tensor(k)) for k in keys}
    body = {k: v for k, v in manifest.items() if k != "crc32"}
    (path / ckpt.MANIFEST).write_text(json.dumps({**body, "crc32": ckpt._json_crc(body)}))


EDITS = {
    "invalid JSON": lambda path: (path / ckpt.STATE).write_text('{"format": "fxstar-chec'),
    "missing key": lambda path: _edit(path, lambda meta: meta["state"].pop("step")),
    "missing tensor": lambda path: _edit(
        path, lambda meta: meta["state"]["rng"].update(torch={"__tensor__": "nowhere"})
    ),
    "checksums gone": lambda path: (path / ckpt.MANIFEST).unlink(),
    "relative path": lambda path: _edit(path, lambda meta: meta.update(tensors="../outside")),
    "absolute path": lambda path: _edit(
        path, lambda meta: meta.update(tensors=str(path.parent / "outside"))
    ),
}


@pytest.mark.parametrize("resealed", [False, True], ids=["checksum", "resealed"])
@pytest.mark.parametrize("edit", EDITS)
def test_an_edited_training_json_is_an_error_naming_it(edit, resealed, saved, tmp_path):
    """Caught by the manifest's checksum; and, with the checksums written again, by the
    checks of what training.json holds."""
    path = _copy(saved[1], tmp_path)
    shutil.copy(path / ckpt.TENSORS, tmp_path / "outside")  # what the path edits point at
    EDITS[edit](path)
    if resealed:
        _reseal(path)
    with pytest.raises(fxstar.CheckpointError) as info:
        fxstar.load(path)
    message = str(info.value)
    assert str(path / ckpt.STATE) in message and "save the checkpoint again" in message
    if not resealed:
        changed = "does not match the checksum manifest.json|but was saved with|is missing"
        assert re.search(changed, message)
    elif "path" in edit:
        assert "not a file in" in message or "must be the name of a file" in message


def test_loss_scaler_state_sets_only_the_scaler_s_fields(tmp_path):
    scaler = LossScaler()
    with pytest.raises(fxstar.CheckpointError, match="unknown fields 'update'"):
        scaler.load_state_dict({"scale": 8.0, "update": None})  # would shadow the method
    assert scaler.scale == 2.0**16 and callable(scaler.update)
    engine = compile(tiny_gpt(), Plan(optimizer=OPTIMIZER), tokens())
    engine.scaler = LossScaler()
    engine.save(tmp_path / "ckpt")
    _edit(tmp_path / "ckpt", lambda meta: meta["state"]["loss_scaler"].update(update=None))
    _reseal(tmp_path / "ckpt")
    with pytest.raises(fxstar.CheckpointError, match="unknown fields 'update'"):
        engine.load(tmp_path / "ckpt")
    assert callable(engine.scaler.update)


def _leftover(directory: Path, of: str, kind: str, host: str, pid: int) -> str:
    """A scratch directory as a save of `of` by process `pid` on `host` leaves it."""
    name = f"{of}.{kind}-{host}-{pid}-abcd1234"
    (directory / name).mkdir()
    marker = {"format": ckpt.FORMAT, "scratch": kind, "of": of, "host": host, "pid": pid}
    (directory / name / ckpt.MARKER).write_text(json.dumps(marker))
    return name


def _users(directory: Path, *names: str) -> dict[str, str]:
    """Directories of a user's, each with a file in it: {name: the file's text}."""
    for name in names:
        (directory / name).mkdir()
        (directory / name / "notes.txt").write_text(f"mine: {name}")
    return {name: f"mine: {name}" for name in names}


def _intact(directory: Path, users: dict[str, str]) -> bool:
    return all((directory / n / "notes.txt").read_text() == text for n, text in users.items())


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
    host = socket.gethostname()
    dead = json.loads((tmp_path / left / ckpt.MARKER).read_text())["pid"]
    kept = [_leftover(tmp_path, "ckpt", "tmp", host, os.getpid()),  # a live writer's
            _leftover(tmp_path, "ckpt", "tmp", "elsewhere", dead),  # another host's
            _leftover(tmp_path, "ckpt2", "tmp", host, dead)]  # another checkpoint's  # fmt: skip
    # named like leftovers, but a user's: no marker of fxstar's in them
    users = _users(tmp_path, f"ckpt.tmp-{ckpt._host()}-{dead}-abcd1234", "ckpt.old-v1",
                   "ckpt.old-abcd1234")  # fmt: skip
    engine.save(target)
    engine.save(target)  # replacing the checkpoint deletes only what it moved aside
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt", *kept, *users])
    assert _intact(tmp_path, users)


@pytest.mark.parametrize("name", ["a[1]", "a*", "a?"])
def test_a_name_with_glob_characters_touches_only_its_own_checkpoint(name, saved, tmp_path):
    engine, _ = saved
    (tmp_path / "a1").mkdir()  # a neighbour caught by an interrupted save: only its backup
    backup = ckpt._scratch(tmp_path / "a1", "old")
    shutil.copytree(saved[1], backup / "a1")
    engine.save(tmp_path / name)
    engine.save(tmp_path / name)  # the second moves the first aside and deletes it
    assert sorted(os.listdir(tmp_path)) == sorted([name, "a1", backup.name])
    assert fxstar.load(tmp_path / name).path == tmp_path / name
    (tmp_path / "a1").rmdir()
    with pytest.warns(UserWarning, match="interrupted save"):
        assert fxstar.load(tmp_path / "a1").path == backup / "a1"


def test_load_never_takes_a_user_s_old_directory_for_an_interrupted_save(saved, tmp_path):
    shutil.copytree(saved[1], tmp_path / "run.old-v1")  # a checkpoint the user renamed
    with pytest.raises(fxstar.CheckpointError, match="no fxstar checkpoint"):
        fxstar.load(tmp_path / "run")


# -- what a save may replace --------------------------------------------------------------------


def test_a_save_never_deletes_what_fxstar_did_not_write(saved, tmp_path):
    """A directory that is no checkpoint, a checkpoint holding a user's file, a file: each
    refused by name, left as it was, nothing beside it."""
    engine, _ = saved
    users = _users(tmp_path, "results")
    inside = _copy(saved[1], tmp_path / "ckpts")
    (inside / "notes.txt").write_text("mine")
    (tmp_path / "model.pt").write_text("a file")
    for target, named in ((tmp_path / "results", "not an fxstar checkpoint.*notes.txt"),
                          (inside, "fxstar checkpoint but holds files .*notes.txt"),
                          (tmp_path / "model.pt", "is a file")):  # fmt: skip
        listing = sorted(os.listdir(target.parent))
        with pytest.raises(fxstar.CheckpointError, match=named) as info:
            engine.save(target)
        assert str(target) in str(info.value)
        assert sorted(os.listdir(target.parent)) == listing  # no scratch directory left
    assert _intact(tmp_path, users) and (inside / "notes.txt").read_text() == "mine"
    assert (tmp_path / "model.pt").read_text() == "a file"
    (tmp_path / "empty").mkdir()  # an empty directory is a fine place for one
    engine.save(tmp_path / "empty")
    assert fxstar.load(tmp_path / "empty").state["step"]["micro_steps"] == engine.step_count


def test_a_save_to_the_working_directory_or_one_holding_it_is_refused(saved, tmp_path,
                                                                       monkeypatch):  # fmt: skip
    engine, _ = saved
    project = _copy(saved[1], tmp_path / "project")  # even a checkpoint: it is in use
    (project / "train.py").write_text("source")
    monkeypatch.chdir(project)
    for target in (".", "..", project, tmp_path, Path("/")):
        with pytest.raises(fxstar.CheckpointError, match="working directory") as info:
            engine.save(target)
        assert str(Path(target).absolute()) in str(info.value)
    assert (project / "train.py").read_text() == "source"
    assert sorted(os.listdir(tmp_path)) == ["project"]


def test_a_save_through_a_symbolic_link_replaces_what_it_points_to(saved, tmp_path):
    """`latest -> run-100`: the checkpoint is written at run-100 and the link kept; a link to
    a user's directory is refused by the directory's name; nothing is left beside either."""
    engine, _ = saved
    shutil.copytree(saved[1], tmp_path / "run-100")
    (tmp_path / "latest").symlink_to("run-100")
    engine.step_count += 3  # tell the new checkpoint from the old one
    try:
        assert engine.save(tmp_path / "latest") == str(tmp_path / "run-100")
        assert fxstar.load(tmp_path / "latest").state["step"]["micro_steps"] == engine.step_count
    finally:
        engine.step_count -= 3
    assert os.readlink(tmp_path / "latest") == "run-100"
    assert sorted(os.listdir(tmp_path)) == ["latest", "run-100"]
    (tmp_path / "next").symlink_to("run-200")  # to nothing yet: made there
    engine.save(tmp_path / "next")
    assert fxstar.load(tmp_path / "run-200").state["step"]["micro_steps"] == engine.step_count
    users = _users(tmp_path, "mine")
    (tmp_path / "link").symlink_to("mine")
    with pytest.raises(fxstar.CheckpointError, match=f"{tmp_path / 'mine'}: it is not an"):
        engine.save(tmp_path / "link")
    assert _intact(tmp_path, users)
    assert sorted(os.listdir(tmp_path)) == ["latest", "link", "mine", "next", "run-100", "run-200"]


class _OneRank:
    """torch.distributed as a data-parallel save of one rank sees it: the collectives pass
    every object through, so `_save_data_parallel` runs whole in this process."""

    def get_rank(self, group=None) -> int:
        return 0

    def get_world_size(self, group=None) -> int:
        return 1

    def gather_object(self, obj, gathered, group=None, group_dst=0) -> None:
        gathered[0] = obj

    def broadcast_object_list(self, objects, group=None, group_src=0) -> None:
        pass


def test_the_data_parallel_save_replaces_only_what_a_save_may(saved, tmp_path, monkeypatch):
    engine, _ = saved
    monkeypatch.setattr(ckpt, "dist", _OneRank())
    monkeypatch.setattr(ckpt.tp, "process_group", lambda group: None)
    monkeypatch.setattr(ckpt.tp, "guard", lambda *args, **kwargs: contextlib.nullcontext())
    users = _users(tmp_path, "results")
    with pytest.raises(fxstar.CheckpointError, match="results: it is not an fxstar checkpoint"):
        ckpt._save_data_parallel(engine, tmp_path / "results")
    monkeypatch.chdir(tmp_path / "results")
    with pytest.raises(fxstar.CheckpointError, match="working directory"):
        ckpt._save_data_parallel(engine, ".")
    assert _intact(tmp_path, users) and sorted(os.listdir(tmp_path)) == ["results"]
    shutil.copytree(saved[1], tmp_path / "run-1")
    (tmp_path / "latest").symlink_to("run-1")
    assert ckpt._save_data_parallel(engine, tmp_path / "latest") == tmp_path / "run-1"
    assert sorted(os.listdir(tmp_path)) == ["latest", "results", "run-1"]
    assert _equal(ckpt.load_parameters(tmp_path / "latest"), engine.state_dict())


def test_load_of_a_glob_pattern_reads_no_other_checkpoint(saved, tmp_path):
    shutil.copytree(saved[1], tmp_path / "best1.old-abcd1234")  # best1's interrupted save
    with pytest.raises(fxstar.CheckpointError, match="no fxstar checkpoint"):
        fxstar.load(tmp_path / "best*")


def test_two_writers_of_one_path_each_leave_a_whole_checkpoint(tmp_path):
    target, errors = tmp_path / "ckpt", []

    def writer(tag: str) -> None:
        try:
            for i in range(30):
                ckpt.write_atomically(target, lambda tmp, i=i: (tmp / ckpt.STATE).write_text(
                    json.dumps({"format": ckpt.FORMAT, "who": f"{tag}{i}"})
                ))  # fmt: skip
        except Exception as error:
            errors.append(error)

    threads = [threading.Thread(target=writer, args=(tag,)) for tag in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert os.listdir(tmp_path) == ["ckpt"]
    assert json.loads((target / ckpt.STATE).read_text())["who"] in ("a29", "b29")


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
    assert files == sorted([ckpt.PARAMETERS, ckpt.TENSORS, ckpt.STATE, ckpt.MANIFEST,
                            ckpt._rank_file(1)])  # fmt: skip
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


# -- every byte read back is checked; every value read back is checked ----------------------------


def _flip_digit_after(path: Path, *keys: str) -> None:
    """Flip the lowest bit of the first digit after `keys` (each found after the one before)
    in training.json: still valid JSON, another number."""
    file = path / ckpt.STATE
    data = bytearray(file.read_bytes())
    at = 0
    for key in keys:
        at = data.index(f'"{key}"'.encode(), at)
    at = next(i for i in range(at, len(data)) if chr(data[i]) in "123456789")
    before = json.loads(data)
    data[at] ^= 0x01
    assert json.loads(data) != before  # the same JSON, one value changed
    file.write_bytes(data)


@pytest.mark.parametrize(
    "keys", [("param_groups", "lr"), ("step", "micro_steps")], ids=["lr", "micro_steps"]
)
def test_a_flipped_bit_in_training_json_is_an_error_naming_it(keys, saved, tmp_path):
    path = _copy(saved[1], tmp_path)
    _flip_digit_after(path, *keys)
    for load in (fxstar.load, saved[0].load):
        with pytest.raises(fxstar.CheckpointError, match="does not match the checksum") as info:
            load(path)
        assert str(path / ckpt.STATE) in str(info.value)


def test_the_manifest_checks_itself(saved, tmp_path):
    path = _copy(saved[1], tmp_path)
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    assert set(manifest["files"]) == {ckpt.PARAMETERS, ckpt.TENSORS, ckpt.STATE}
    manifest["files"][ckpt.STATE]["crc32"] = "00000000"  # as an edit of training.json would
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(fxstar.CheckpointError, match="checksum it holds of itself") as info:
        fxstar.load(path)
    assert str(path / ckpt.MANIFEST) in str(info.value)
    for hostile in ("[" * 100_000 + "]" * 100_000, "[1, 2]", '{"format": 7'):
        (path / ckpt.MANIFEST).write_text(hostile)
        with pytest.raises(fxstar.CheckpointError) as info:
            fxstar.load(path)
        assert str(path / ckpt.MANIFEST) in str(info.value)


def _nested(depth: int) -> list:
    nested: list = []
    for _ in range(depth):
        nested = [nested]
    return nested


def _deeply_nested(path: Path) -> None:
    """training.json with a value nested past what json's decoder recurses into."""
    file = path / ckpt.STATE
    text = file.read_text()
    file.write_text(text.replace('"state": {', '"state": {"extra": ' + "[" * 100_000
                                 + "]" * 100_000 + ", ", 1))  # fmt: skip


def _group(meta: dict) -> dict:
    return meta["state"]["optimizer"]["param_groups"][0]


VALUES = {  # edit of training.json -> what the error names
    "lr < 0": (lambda m: _group(m).update(lr=-1.0), r"param_groups\[0\]\.lr: must be in \[0, 10\]"),
    "lr a str": (lambda m: _group(m).update(lr="0.01"), r"\.lr: must be a number"),
    "beta2 1.5": (lambda m: _group(m).update(betas=[0.9, 1.5]), r"\.betas\[1\]: must be in"),
    "eps 0": (lambda m: _group(m).update(eps=0), r"\.eps: must be in"),
    "weight_decay nan": (lambda m: _group(m).update(weight_decay=float("nan")), "weight_decay"),
    "amsgrad 1": (lambda m: _group(m).update(amsgrad=1), r"\.amsgrad: must be a bool"),
    "negative steps": (
        lambda m: m["state"]["step"].update(micro_steps=-3),
        r"step\.micro_steps: must be >= 0",
    ),  # fmt: skip
    "fractional steps": (
        lambda m: m["state"]["step"].update(micro_steps=1.5),
        r"step\.micro_steps: must be an int",
    ),  # fmt: skip
    "more optimizer steps": (
        lambda m: m["state"]["step"].update(optimizer_steps=99),
        "optimizer_steps: must be at most",
    ),  # fmt: skip
    "python rng cut": (
        lambda m: m["state"]["rng"]["python"]["__tuple__"][1]["__tuple__"].pop(),
        r"rng\.python\[1\]: must be a list of 625",
    ),  # fmt: skip
    "ranks a str": (lambda m: m.update(ranks="two"), "ranks: must be an int"),
    "version a str": (lambda m: m.update(version="3"), "version must be an int"),
    "scheduler lr": (
        lambda m: m["state"]["scheduler"].update(base_lrs=[-1.0, 0.01]),
        r"scheduler\.base_lrs\[0\]: must be in",
    ),  # fmt: skip
    "deeply nested": (None, "RecursionError"),
}


@pytest.mark.parametrize("edit", VALUES)
def test_every_value_read_back_is_checked_before_it_reaches_torch(edit, saved, tmp_path):
    """training.json edited and its checksums written again: a value of the wrong type or out
    of range is a CheckpointError naming the field and the file; the engine is left as it was."""
    engine, _ = saved
    path = _copy(saved[1], tmp_path)
    change, named = VALUES[edit]
    _deeply_nested(path) if change is None else _edit(path, change)
    _reseal(path)
    before = {k: v.clone() for k, v in engine.state_dict().items()}
    lr, steps = engine.optimizer.param_groups[0]["lr"], engine.step_count
    with pytest.raises(fxstar.CheckpointError, match=named) as info:
        engine.load(path)
    assert str(path / ckpt.STATE) in str(info.value)
    assert _equal(engine.state_dict(), before)
    assert engine.optimizer.param_groups[0]["lr"] == lr and engine.step_count == steps


def test_loss_scaler_values_are_checked(tmp_path):
    engine = compile(tiny_gpt(), Plan(optimizer=OPTIMIZER), tokens())
    engine.scaler = LossScaler()
    engine.save(tmp_path / "ckpt")
    for field, value, named in (("window", 0, "window: must be >= 1"),
                                ("scale", float("inf"), "scale: must be in"),
                                ("dynamic", "yes", "dynamic: must be a bool")):  # fmt: skip
        path = _copy(tmp_path / "ckpt", tmp_path / field)
        _edit(path, lambda meta, f=field, v=value: meta["state"]["loss_scaler"].update({f: v}))
        _reseal(path)
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
    path = _copy(saved[1], tmp_path)
    with safe_open(path / ckpt.TENSORS, "pt") as f:
        keys = f.keys()  # safe_open is not iterable
        tensors = {k: f.get_tensor(k).clone() for k in keys}  # not the mapped file: rewritten
        metadata = f.metadata()
    key = next(k for k in tensors if k.endswith("/exp_avg") and tensors[k].dim() == 2)
    tensors[key] = tensors[key][:1].clone()  # broadcastable to the parameter's shape
    write_safetensors(path / ckpt.TENSORS, tensors, metadata)
    _reseal(path)
    before = {k: v.clone() for k, v in engine.state_dict().items()}
    with pytest.raises(fxstar.CheckpointError, match=r"exp_avg: must have its parameter's shape"):
        engine.load(path)
    assert _equal(engine.state_dict(), before)


@pytest.mark.parametrize("damaged", [ckpt.PARAMETERS, ckpt.STATE])
def test_weights_from_an_fxstar_checkpoint_are_verified(damaged, saved, tmp_path):
    """compile(meta model, weights=checkpoint): its checksums are checked before it is read."""
    path = _copy(saved[1], tmp_path)
    with torch.device("meta"):
        model = tiny_gpt()
    plan = Plan(optimizer=OPTIMIZER, device_memory="auto")
    engine = compile(model, plan, tokens(), weights=path)  # whole: it loads
    assert _equal(engine.state_dict(), ckpt.load_parameters(path))
    if damaged == ckpt.STATE:
        _flip_digit_after(path, "param_groups", "lr")
    else:
        data = bytearray((path / damaged).read_bytes())
        data[len(data) // 2] ^= 0x40
        (path / damaged).write_bytes(data)
    for weights in (path, path / ckpt.PARAMETERS):
        with torch.device("meta"):
            model = tiny_gpt()
        with pytest.raises(fxstar.CheckpointError, match="does not match the checksum") as info:
            compile(model, plan, tokens(), weights=weights)
        assert str(path / damaged) in str(info.value)
