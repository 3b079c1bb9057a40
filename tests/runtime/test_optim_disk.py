"""HybridAdam with the disk tier (plan.disk): the host chunks' Adam moments in files, streamed
through each step. Every run is bit for bit the same plan with everything in memory: losses,
parameters, buffers and optimizer state; in fp32, bf16 and 8-bit moments, with chunks kept on
the compute tier, through a checkpoint, and under data parallelism (each rank its own chunks'
state in its own directory)."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from conftest import activation_budget, example, tiny_gpt, tokens

import fxstar
from fxstar.dist_launch import spawn
from fxstar.errors import DiskIOError
from fxstar.plan import Plan, PlanError
from fxstar.runtime.disk_tier import DiskTierError

OPT = {"type": "adamw", "lr": 1e-2, "weight_decay": 0.1, "clip_grad_norm": 0.5}
STEPS = 3


def plan(disk=None, **options) -> Plan:
    if options.get("device_memory") == "roomy":
        options["device_memory"] = roomy()
    base = {"device_memory": "auto", "optimizer": OPT, "hybrid_adam": False}
    return Plan(**{**base, **options, "disk": disk})


def train(engine, steps: range) -> list[torch.Tensor]:
    losses = []
    for step in steps:
        ids, targets = tokens(seed=step)
        torch.manual_seed(step)
        loss = engine(ids, targets)
        loss.backward()
        engine.step()
        losses.append(loss.detach().clone())
    return losses


def snapshot(engine) -> dict:
    """Parameters, buffers and the optimizer's state, as a checkpoint would hold them."""
    state = engine.optimizer.state_dict()
    moments = [v.clone() for entry in state["state"].values() for v in entry.values()
               if torch.is_tensor(v)]  # fmt: skip
    return {"model": [t.detach().clone() for t in engine.state_dict().values()],
            "moments": moments}  # fmt: skip


def assert_same(a: dict, b: dict) -> None:
    assert len(a["losses"]) == len(b["losses"])
    assert all(torch.equal(x, y) for x, y in zip(a["losses"], b["losses"], strict=True))
    for key in ("model", "moments"):
        assert len(a[key]) == len(b[key]) > 0, key
        assert all(torch.equal(x, y) for x, y in zip(a[key], b[key], strict=True)), key


def run(disk, **options) -> dict:
    with fxstar.compile(tiny_gpt(), plan(disk, **options), **example("gpt", *tokens())) as e:
        losses = train(e, range(STEPS))
        out = {"losses": losses, **snapshot(e), "report": e.report()}
        out["on_disk"] = list(getattr(e.optimizer, "on_disk", []))
        out["kept"] = list(e.optimizer.device_chunks)
        disk_tier = e.optimizer.disk
        out["stats"] = None if disk_tier is None else disk_tier.stats
    return out


CASES = {
    "fp32": {},
    "bf16": {"precision": "bf16"},
    "8-bit moments, bf16": {"precision": "bf16", "optimizer": {**OPT, "state_dtype": "8bit"}},
    "kept chunks beside": {"precision": "bf16", "hybrid_adam": True, "device_memory": "roomy"},
}


@functools.cache
def roomy() -> int:
    """The activations' peak and twice the parameter bytes: some chunks are kept."""
    return activation_budget(tiny_gpt, 2.0, **example("gpt", *tokens()))


@pytest.mark.parametrize("case", CASES)
def test_bitwise_against_the_host(case, tmp_path):
    directory = tmp_path / "state"
    on_disk = run(directory, **CASES[case])
    assert_same(on_disk, run(None, **CASES[case]))
    stats = on_disk["stats"]
    assert on_disk["on_disk"] and stats.bytes_read > 0 and stats.bytes_written > 0
    assert "on the disk tier" in on_disk["report"]
    if case == "kept chunks beside":
        assert on_disk["kept"] and not set(on_disk["kept"]) & set(on_disk["on_disk"])
    assert not directory.exists()  # close removed what the tier made


def test_a_checkpoint_moves_between_disk_and_host_engines(tmp_path):
    """Saved from a disk-tier engine, loaded into a host one and the other way round: each
    continues as the engine that saved it would have."""
    options = {"precision": "bf16"}
    for saver, loader in ((tmp_path / "a", None), (None, tmp_path / "b")):
        with fxstar.compile(tiny_gpt(), plan(saver, **options), **example("gpt", *tokens())) as e:
            train(e, range(2))
            e.save(tmp_path / "ckpt")
            expected = {"losses": train(e, range(2, 4)), **snapshot(e)}
        with fxstar.compile(tiny_gpt(1), plan(loader, **options),
                            **example("gpt", *tokens())) as e:  # fmt: skip
            e.load(tmp_path / "ckpt")
            got = {"losses": train(e, range(2, 4)), **snapshot(e)}
        assert_same(got, expected)


def test_the_directory_belongs_to_one_engine_and_user_files_stay(tmp_path):
    directory = tmp_path / "mine"
    directory.mkdir()
    (directory / "notes.txt").write_text("keep me")
    with fxstar.compile(tiny_gpt(), plan(directory), **example("gpt", *tokens())) as first:
        train(first, range(1))
        with pytest.raises(DiskTierError, match="in use by another engine"):
            fxstar.compile(tiny_gpt(), plan(directory), **example("gpt", *tokens()))
    assert [p.name for p in directory.iterdir()] == ["notes.txt"]
    kept = tmp_path / "kept"
    with fxstar.compile(tiny_gpt(), plan({"path": str(kept), "keep": True}),
                        **example("gpt", *tokens())) as e:  # fmt: skip
        train(e, range(1))
    assert any(p.name.endswith("-moments.bin") for p in kept.iterdir())


def test_a_damaged_part_is_a_named_error_at_the_step_and_the_checkpoint_survives(tmp_path):
    directory = tmp_path / "state"
    with fxstar.compile(tiny_gpt(), plan(directory), **example("gpt", *tokens())) as e:
        train(e, range(1))
        e.save(tmp_path / "ckpt")
        victim = next(directory.glob("*-moments.bin"))
        victim.write_bytes(b"")  # the disk lost it
        with pytest.raises(DiskIOError, match=victim.name):
            train(e, range(1, 2))
    with fxstar.compile(tiny_gpt(), plan(tmp_path / "again"), **example("gpt", *tokens())) as e:
        e.load(tmp_path / "ckpt")  # the last checkpoint is whole
        train(e, range(1, 2))


def test_plans_the_disk_tier_cannot_serve_are_refused_by_name():
    with pytest.raises(PlanError, match="disk: .*optimizer.type 'sgd'"):
        Plan(device_memory="auto", optimizer={"type": "sgd"}, disk="/tmp/x")
    with pytest.raises(PlanError, match="disk: .*no chunks"):
        Plan(disk="/tmp/x")


def _data_parallel(rank: int, world: int, root: str) -> dict:
    out = {}
    for name, disk in (("host", None), ("disk", f"{root}/state")):
        with fxstar.compile(tiny_gpt(), plan(disk, chunk_size=4096),
                            **example("gpt", *tokens())) as e:  # fmt: skip
            losses = train(e, range(STEPS))
            owned = sorted(c.id for c in e.chunks.step_chunks.own_trainable())
            out[name] = {"losses": losses, **snapshot(e), "owned": owned,
                         "on_disk": sorted(getattr(e.optimizer, "on_disk", []))}  # fmt: skip
            if disk is not None:
                files = sorted(p.name for p in e.optimizer.disk.directory.iterdir())
                out[name]["files"] = files
    return out


def test_data_parallel_each_rank_keeps_its_own_chunks_state(tmp_path):
    results = spawn(_data_parallel, 2, str(tmp_path))
    for rank in (0, 1):
        host, disk = results[rank]["host"], results[rank]["disk"]
        assert_same(disk, host)
        assert disk["on_disk"] == disk["owned"] and disk["owned"]
        assert len([f for f in disk["files"] if f.endswith("-moments.bin")]) == len(disk["owned"])
    assert not set(results[0]["disk"]["owned"]) & set(results[1]["disk"]["owned"])
    with contextlib.suppress(FileNotFoundError):
        assert not any((tmp_path / "state").iterdir())
