"""HybridAdam with the disk tier (plan.disk): the host chunks' Adam moments and (bf16/fp16) fp32
masters in files, streamed through each step, the stable parameters mapping the masters'
files. Every run is bit for bit the same plan with everything in memory: losses, parameters,
buffers and optimizer state; in fp32, bf16, fp16 and 8-bit moments, with masters on the host
too, with chunks kept on the compute tier, under accumulation with paged chunks (forwards read
the masters of chunks whose gradients hold the payload's room), after a user wrote the
parameters between steps, through a checkpoint, and under data parallelism (each rank its own
chunks' state in its own directory)."""

from __future__ import annotations

import contextlib
import functools
import os

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


def plan(disk=None, masters: bool = True, **options) -> Plan:
    budgets = {"roomy": roomy, "tight": tight}
    if options.get("device_memory") in budgets:
        options["device_memory"] = budgets[options["device_memory"]]()
    if disk is not None and not masters:
        disk = {"path": str(disk), "masters": False}
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
        out["masters_on_disk"] = disk_tier is not None and e.chunks.masters_on_disk
        out["master_parts"] = [] if disk_tier is None else sorted(
            item for item, part in disk_tier.files if part == "master"
        )  # fmt: skip
    return out


CASES = {
    "fp32": {},
    "bf16": {"precision": "bf16"},
    "8-bit moments, bf16": {"precision": "bf16", "optimizer": {**OPT, "state_dtype": "8bit"}},
    "kept chunks beside": {"precision": "bf16", "hybrid_adam": True, "device_memory": "roomy"},
    "fp16": {"precision": "fp16"},
    "bf16, accumulation, paged": {
        "precision": "bf16",
        "device_memory": "tight",
        "chunk_size": 4096,
        "optimizer": {**OPT, "accumulation_steps": 2},
    },
    "bf16, masters on the host": {"precision": "bf16", "masters": False},
}


@functools.cache
def roomy() -> int:
    """The activations' peak and twice the parameter bytes: some chunks are kept."""
    return activation_budget(tiny_gpt, 2.0, **example("gpt", *tokens()))


@functools.cache
def tight() -> int:
    """The activations' peak and a tenth of the parameter bytes: small chunks are paged, and
    a forward of an accumulation window loads some whose gradients hold their room."""
    return activation_budget(tiny_gpt, 0.1, **example("gpt", *tokens()))


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
    low_precision = CASES[case].get("precision") in ("bf16", "fp16")
    masters = low_precision and CASES[case].get("masters", True)
    assert on_disk["masters_on_disk"] == masters
    # every chunk's master has a file (frozen and kept ones too), whatever the step streams
    assert (set(on_disk["on_disk"]) <= set(on_disk["master_parts"])) if masters \
        else not on_disk["master_parts"]  # fmt: skip
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


def test_parameters_written_between_steps_reach_the_streamed_masters(tmp_path):
    """A user's in-place write to the stable parameters goes through the masters' mappings;
    the next step's stream reads it (and the payload is rounded from it), as on the host."""
    results = []
    for disk in (tmp_path / "state", None):
        with fxstar.compile(tiny_gpt(), plan(disk, precision="bf16", chunk_size=4096),
                            **example("gpt", *tokens())) as e:  # fmt: skip
            losses = train(e, range(1))
            with torch.no_grad():
                for p in e.parameters():
                    p.mul_(0.5)
            losses += train(e, range(1, 3))
            results.append({"losses": losses, **snapshot(e)})
    assert_same(*results)


def test_closing_keeps_the_models_values_without_a_copy(tmp_path):
    """With the masters on the disk tier, close removes the files; the model's parameters
    keep mapping them, with the trained values."""
    values = []
    for disk in (tmp_path / "state", None):
        model = tiny_gpt()
        with fxstar.compile(model, plan(disk, precision="bf16"), **example("gpt", *tokens())) as e:
            train(e, range(2))
        values.append([p.detach().clone() for p in model.parameters()])
    assert not (tmp_path / "state").exists()
    assert all(torch.equal(a, b) for a, b in zip(*values, strict=True))


def test_a_master_file_cut_short_is_named_before_its_pages_are_touched(tmp_path):
    directory = tmp_path / "state"
    with fxstar.compile(tiny_gpt(), plan(directory, precision="bf16"),
                        **example("gpt", *tokens())) as e:  # fmt: skip
        train(e, range(1))
        e.save(tmp_path / "ckpt")
        victim = next(directory.glob("*-master.bin"))
        os.truncate(victim, 0)  # the disk lost it: a touched page would be SIGBUS
        with pytest.raises(DiskIOError, match=victim.name):
            train(e, range(1, 2))
    with fxstar.compile(tiny_gpt(), plan(tmp_path / "again", precision="bf16"),
                        **example("gpt", *tokens())) as e:  # fmt: skip
        e.load(tmp_path / "ckpt")  # the last checkpoint is whole
        train(e, range(1, 2))


def test_plans_the_disk_tier_cannot_serve_are_refused_by_name():
    with pytest.raises(PlanError, match="disk: .*optimizer.type 'sgd'"):
        Plan(device_memory="auto", optimizer={"type": "sgd"}, disk="/tmp/x")
    with pytest.raises(PlanError, match="disk: .*no chunks"):
        Plan(disk="/tmp/x")


def _data_parallel(rank: int, world: int, root: str, precision: str) -> dict:
    out = {}
    for name, disk in (("host", None), ("disk", f"{root}/state")):
        with fxstar.compile(tiny_gpt(), plan(disk, chunk_size=4096, precision=precision),
                            **example("gpt", *tokens())) as e:  # fmt: skip
            losses = train(e, range(STEPS))
            owned = sorted(c.id for c in e.chunks.step_chunks.own_trainable())
            out[name] = {"losses": losses, **snapshot(e), "owned": owned,
                         "on_disk": sorted(getattr(e.optimizer, "on_disk", []))}  # fmt: skip
            if disk is not None:
                files = sorted(p.name for p in e.optimizer.disk.directory.iterdir())
                out[name]["files"] = files
    return out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_data_parallel_each_rank_keeps_its_own_chunks_state(precision, tmp_path):
    results = spawn(_data_parallel, 2, str(tmp_path), precision)
    for rank in (0, 1):
        host, disk = results[rank]["host"], results[rank]["disk"]
        assert_same(disk, host)
        assert disk["on_disk"] == disk["owned"] and disk["owned"]
        assert len([f for f in disk["files"] if f.endswith("-moments.bin")]) == len(disk["owned"])
        masters = [f for f in disk["files"] if f.endswith("-master.bin")]
        # sharded payloads: a rank has homes, and masters, of its own chunks only
        assert len(masters) == (len(disk["owned"]) if precision == "bf16" else 0)
    assert not set(results[0]["disk"]["owned"]) & set(results[1]["disk"]["owned"])
    with contextlib.suppress(FileNotFoundError):
        assert not any((tmp_path / "state").iterdir())
