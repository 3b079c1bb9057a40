"""What a save may replace and what it leaves: a save failing halfway leaves the previous
checkpoint, killed saves are cleaned up, names are never globs, a user's files and the working
directory are never replaced, links are followed, two writers each leave a whole checkpoint
(fxstar/saving/directory.py)."""

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from trained import (
    build,
    copy_checkpoint,
    equal,
    intact,
    plan_for,
    save_trained,
    train,
    users_dirs,
)

import fxstar
import fxstar.saving as ckpt
from fxstar.saving import directory, file_format

# an engine and its checkpoint after two steps, once per module; tests damage copies of it
saved = pytest.fixture(save_trained, scope="module", name="saved")


def test_a_save_failing_halfway_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    engine, scheduler = build(plan_for("plain"))
    train(engine, scheduler, range(2))
    target = tmp_path / "ckpt"
    engine.save(target)
    saved = {k: v.clone() for k, v in engine.state_dict().items()}
    train(engine, scheduler, range(2, 4))

    real_write = file_format.write_safetensors_streamed

    def second_file_fails(path, layout, values, metadata=None):
        if str(path).endswith(ckpt.TENSORS):
            raise OSError("disk full")
        return real_write(path, layout, values, metadata)

    monkeypatch.setattr(file_format, "write_safetensors_streamed", second_file_fails)
    with pytest.raises(OSError, match="disk full"):
        engine.save(target)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # the half-written one is gone
    assert equal(ckpt.load_parameters(target), saved)
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
    assert checkpoint.step == 2 and equal(checkpoint.parameters, saved)

    engine.save(target)  # the next save works and clears what the crash left aside
    assert fxstar.load(target).step == 4
    assert not [name for name in os.listdir(tmp_path) if ".old-" in name]


def _leftover(directory: Path, of: str, kind: str, host: str, pid: int) -> str:
    """A scratch directory as a save of `of` by process `pid` on `host` leaves it."""
    name = f"{of}.{kind}-{host}-{pid}-abcd1234"
    (directory / name).mkdir()
    marker = {"format": ckpt.FORMAT, "scratch": kind, "of": of, "host": host, "pid": pid}
    (directory / name / ckpt.MARKER).write_text(json.dumps(marker))
    return name


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
    users = users_dirs(tmp_path, f"ckpt.tmp-{directory._host()}-{dead}-abcd1234", "ckpt.old-v1",
                   "ckpt.old-abcd1234")  # fmt: skip
    engine.save(target)
    engine.save(target)  # replacing the checkpoint deletes only what it moved aside
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt", *kept, *users])
    assert intact(tmp_path, users)


@pytest.mark.parametrize("name", ["a[1]", "a*", "a?"])
def test_a_name_with_glob_characters_touches_only_its_own_checkpoint(name, saved, tmp_path):
    engine, _ = saved
    (tmp_path / "a1").mkdir()  # a neighbour caught by an interrupted save: only its backup
    backup = directory.new_scratch(tmp_path / "a1", "old")
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


def test_a_save_never_deletes_what_fxstar_did_not_write(saved, tmp_path):
    """A directory that is no checkpoint, a checkpoint holding a user's file, a file: each
    refused by name, left as it was, nothing beside it."""
    engine, _ = saved
    users = users_dirs(tmp_path, "results")
    inside = copy_checkpoint(saved[1], tmp_path / "ckpts")
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
    assert intact(tmp_path, users) and (inside / "notes.txt").read_text() == "mine"
    assert (tmp_path / "model.pt").read_text() == "a file"
    (tmp_path / "empty").mkdir()  # an empty directory is a fine place for one
    engine.save(tmp_path / "empty")
    assert fxstar.load(tmp_path / "empty").state["step"]["micro_steps"] == engine.step_count


def test_a_save_to_the_working_directory_or_one_holding_it_is_refused(saved, tmp_path,
                                                                       monkeypatch):  # fmt: skip
    engine, _ = saved
    project = copy_checkpoint(saved[1], tmp_path / "project")  # even a checkpoint: it is in use
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
    users = users_dirs(tmp_path, "mine")
    (tmp_path / "link").symlink_to("mine")
    with pytest.raises(fxstar.CheckpointError, match=f"{tmp_path / 'mine'}: it is not an"):
        engine.save(tmp_path / "link")
    assert intact(tmp_path, users)
    assert sorted(os.listdir(tmp_path)) == ["latest", "link", "mine", "next", "run-100", "run-200"]


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
