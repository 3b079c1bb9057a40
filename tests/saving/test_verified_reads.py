"""Every byte and every value read back is checked: a flipped bit, a truncated or an edited file
is an error naming it, the manifest checks itself, values of the wrong type or range are refused
by field, and weights= on a damaged checkpoint is refused (fxstar/saving/verified_reads.py)."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import tiny_gpt, tokens
from trained import (
    OPTIMIZER,
    copy_checkpoint,
    edit_json,
    equal,
    reseal,
    save_trained,
)

import fxstar
import fxstar.saving as ckpt
from fxstar.engine import compile
from fxstar.plan import Plan

# an engine and its checkpoint after two steps, once per module; tests damage copies of it
saved = pytest.fixture(save_trained, scope="module", name="saved")


def test_a_flipped_bit_is_an_error_naming_the_file_and_the_tensor(saved, tmp_path):
    path = copy_checkpoint(saved[1], tmp_path)
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
    path = copy_checkpoint(saved[1], tmp_path)
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


EDITS = {
    "invalid JSON": lambda path: (path / ckpt.STATE).write_text('{"format": "fxstar-chec'),
    "missing key": lambda path: edit_json(path, lambda meta: meta["state"].pop("step")),
    "missing tensor": lambda path: edit_json(
        path, lambda meta: meta["state"]["rng"].update(torch={"__tensor__": "nowhere"})
    ),
    "checksums gone": lambda path: (path / ckpt.MANIFEST).unlink(),
    "relative path": lambda path: edit_json(path, lambda meta: meta.update(tensors="../outside")),
    "absolute path": lambda path: edit_json(
        path, lambda meta: meta.update(tensors=str(path.parent / "outside"))
    ),
}


@pytest.mark.parametrize("resealed", [False, True], ids=["checksum", "resealed"])
@pytest.mark.parametrize("edit", EDITS)
def test_an_edited_training_json_is_an_error_naming_it(edit, resealed, saved, tmp_path):
    """Caught by the manifest's checksum; and, with the checksums written again, by the
    checks of what training.json holds."""
    path = copy_checkpoint(saved[1], tmp_path)
    shutil.copy(path / ckpt.TENSORS, tmp_path / "outside")  # what the path edits point at
    EDITS[edit](path)
    if resealed:
        reseal(path)
    with pytest.raises(fxstar.CheckpointError) as info:
        fxstar.load(path)
    message = str(info.value)
    assert str(path / ckpt.STATE) in message and "save the checkpoint again" in message
    if not resealed:
        changed = "does not match the checksum manifest.json|but was saved with|is missing"
        assert re.search(changed, message)
    elif "path" in edit:
        assert "not a file in" in message or "must be the name of a file" in message


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
    path = copy_checkpoint(saved[1], tmp_path)
    _flip_digit_after(path, *keys)
    for load in (fxstar.load, saved[0].load):
        with pytest.raises(fxstar.CheckpointError, match="does not match the checksum") as info:
            load(path)
        assert str(path / ckpt.STATE) in str(info.value)


def test_the_manifest_checks_itself(saved, tmp_path):
    path = copy_checkpoint(saved[1], tmp_path)
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
    path = copy_checkpoint(saved[1], tmp_path)
    change, named = VALUES[edit]
    _deeply_nested(path) if change is None else edit_json(path, change)
    reseal(path)
    before = {k: v.clone() for k, v in engine.state_dict().items()}
    lr, steps = engine.optimizer.param_groups[0]["lr"], engine.step_count
    with pytest.raises(fxstar.CheckpointError, match=named) as info:
        engine.load(path)
    assert str(path / ckpt.STATE) in str(info.value)
    assert equal(engine.state_dict(), before)
    assert engine.optimizer.param_groups[0]["lr"] == lr and engine.step_count == steps


@pytest.mark.parametrize("damaged", [ckpt.PARAMETERS, ckpt.STATE])
def test_weights_from_an_fxstar_checkpoint_are_verified(damaged, saved, tmp_path):
    """compile(meta model, weights=checkpoint): its checksums are checked before it is read."""
    path = copy_checkpoint(saved[1], tmp_path)
    with torch.device("meta"):
        model = tiny_gpt()
    plan = Plan(optimizer=OPTIMIZER, device_memory="auto")
    engine = compile(model, plan, tokens(), weights=path)  # whole: it loads
    assert equal(engine.state_dict(), ckpt.load_parameters(path))
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
