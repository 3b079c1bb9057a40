"""The layouts ranks save together by: the data-parallel save replaces only what a save may;
tensor-parallel ranks resume bit for bit, each from its own training state
(fxstar/saving/layouts/)."""

import contextlib
import os
import shutil

import pytest
import torch
from conftest import tiny_gpt, tokens
from trained import (
    OPTIMIZER,
    build,
    copy_checkpoint,
    edit_json,
    equal,
    intact,
    reseal,
    save_trained,
    train,
    users_dirs,
)

import fxstar
import fxstar.saving as ckpt
from fxstar.dist_launch import spawn
from fxstar.engine import compile
from fxstar.plan import Plan
from fxstar.saving import collective, view_of
from fxstar.saving.layouts import DataParallelRanks
from fxstar.saving.verified_reads import read_rank_state

# an engine and its checkpoint after two steps, once per module; tests damage copies of it
saved = pytest.fixture(save_trained, scope="module", name="saved")


class _OneRank:
    """torch.distributed as a data-parallel save of one rank sees it: the collectives pass
    every object through, so the data-parallel layout's save runs whole in this process."""

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
    monkeypatch.setattr(collective, "dist", _OneRank())
    monkeypatch.setattr(collective, "process_group", lambda group: None)
    monkeypatch.setattr(collective, "guard", lambda *args, **kwargs: contextlib.nullcontext())
    users = users_dirs(tmp_path, "results")
    with pytest.raises(fxstar.CheckpointError, match="results: it is not an fxstar checkpoint"):
        DataParallelRanks().write(view_of(engine), tmp_path / "results")
    monkeypatch.chdir(tmp_path / "results")
    with pytest.raises(fxstar.CheckpointError, match="working directory"):
        DataParallelRanks().write(view_of(engine), ".")
    assert intact(tmp_path, users) and sorted(os.listdir(tmp_path)) == ["results"]
    shutil.copytree(saved[1], tmp_path / "run-1")
    (tmp_path / "latest").symlink_to("run-1")
    assert DataParallelRanks().write(view_of(engine), tmp_path / "latest") == tmp_path / "run-1"
    assert sorted(os.listdir(tmp_path)) == ["latest", "results", "run-1"]
    assert equal(ckpt.load_parameters(tmp_path / "latest"), engine.state_dict())


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
        "same_state": equal(engine.state_dict(), final),
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
                            ckpt.rank_tensors_file(1)])  # fmt: skip
    model = tiny_gpt(5)
    checkpoint = fxstar.load(path, model)  # the full weights, not rank 0's shards
    assert checkpoint.meta["ranks"] == 2
    assert equal(model.state_dict(), results[0]["saved"])
    # each rank's training state is checked like the others: its own checksums
    assert set(checkpoint.meta["files"]) == {
        ckpt.PARAMETERS,
        ckpt.TENSORS,
        ckpt.rank_tensors_file(1),
    }
    ranked = read_rank_state(checkpoint.path, checkpoint.meta, 1)
    assert ranked["step"] == checkpoint.state["step"]
    assert not torch.equal(ranked["rng"]["torch"], checkpoint.state["rng"]["torch"])
    damaged = copy_checkpoint(path, tmp_path / "damaged")
    file = damaged / ckpt.rank_tensors_file(1)
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(fxstar.CheckpointError, match="truncated"):
        read_rank_state(damaged, fxstar.load(damaged).meta, 1)
    # one process resumes it (every mesh: tests/saving/test_reshard.py), but not from a
    # checkpoint that does not record how tensor parallelism split the parameters (an older
    # fxstar's): refused, naming both worlds
    older = copy_checkpoint(path, tmp_path / "older")
    edit_json(older, lambda meta: meta.pop(ckpt.file_format.TENSOR_SPLITS))
    reseal(older)
    engine, _ = build(Plan(optimizer=OPTIMIZER))
    with pytest.raises(fxstar.CheckpointError, match="2 tensor-parallel ranks.*did not record.*"
                                                     "runs on 1"):  # fmt: skip
        engine.load(older)
    engine.load(path)
    assert equal(engine.state_dict(), results[0]["saved"])
