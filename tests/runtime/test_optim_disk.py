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
import re
import weakref

import pytest
import torch
from conftest import activation_budget, example, tiny_gpt, tokens

import fxstar
from fxstar import placement
from fxstar.dist_launch import spawn
from fxstar.dump import format_graph
from fxstar.errors import DiskIOError
from fxstar.plan import Plan, PlanError
from fxstar.runtime import disk_tier, optim
from fxstar.runtime.disk_io import aligned_size
from fxstar.runtime.disk_pieces import host_slot_bytes
from fxstar.runtime.disk_tier import DiskTierError

OPT = {"type": "adamw", "lr": 1e-2, "weight_decay": 0.1, "clip_grad_norm": 0.5}
STEPS = 3


def plan(disk=None, masters: bool = True, piece: int | None = None, **options) -> Plan:
    budgets = {"roomy": roomy, "tight": tight}
    if options.get("device_memory") in budgets:
        options["device_memory"] = budgets[options["device_memory"]]()
    if disk is not None and (not masters or piece is not None):
        disk = {"path": str(disk), "masters": masters, **({"piece": piece} if piece else {})}
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
        pieces = getattr(e.optimizer, "_pieces", {})
        out["most_pieces"] = max(map(len, pieces.values()), default=0)  # of one chunk
        starts = {c: {s.offset for s in e.optimizer.chunks.chunk(c).slots} for c in pieces}
        out["split_parameters"] = sum(  # a piece that starts inside a parameter
            p.lo not in starts[c] and p.fragments[0].offset == 0
            for c, chunk_pieces in pieces.items() for p in chunk_pieces
        )  # fmt: skip
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
    # chunks of four pieces: runs split at the pieces' edges, parameters across them
    "fp32, pieces": {"chunk_size": 16384, "piece": 4096},
    "bf16, pieces, accumulation, paged": {
        "precision": "bf16",
        "device_memory": "tight",
        "chunk_size": 16384,
        "piece": 4096,
        "optimizer": {**OPT, "accumulation_steps": 2},
    },
    "bf16 moments, pieces, masters on the host": {
        "precision": "bf16",
        "masters": False,
        "chunk_size": 16384,
        "piece": 4096,
        "optimizer": {**OPT, "state_dtype": "bf16"},
    },  # fmt: skip
    "8-bit moments, whole chunks": {
        "precision": "bf16",
        "chunk_size": 16384,
        "piece": 4096,
        "optimizer": {**OPT, "state_dtype": "8bit"},
    },  # fmt: skip
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
    if CASES[case].get("piece"):  # 8-bit moments: whole chunks (their absmax values' pages)
        quantised = CASES[case].get("optimizer", {}).get("state_dtype") == "8bit"
        assert on_disk["most_pieces"] == 1 if quantised else on_disk["most_pieces"] >= 3
        assert quantised or on_disk["split_parameters"] > 0
    if case == "kept chunks beside":
        assert on_disk["kept"] and not set(on_disk["kept"]) & set(on_disk["on_disk"])
        masters_line = r"fp32 masters take 4 bytes per parameter on the compute tier \([\d,]+ "
        assert re.search(masters_line + r"parameters\) and on the disk tier", on_disk["report"])
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


KILLED_MID_STEP = """
import os, signal, sys
sys.path.insert(0, {tests!r}); sys.path.insert(0, {here!r})
import fxstar
from conftest import example, tiny_gpt, tokens
from fxstar.runtime import disk_pieces
from test_optim_disk import plan, train

with fxstar.compile(tiny_gpt(), plan({state!r}, **{options!r}), **example("gpt", *tokens())) as e:
    train(e, range(2))
    e.save({ckpt!r})
    spans, reached = disk_pieces.PieceStream.spans, []

    def spans_then_die(self, chunk_id, span):
        for piece in spans(self, chunk_id, span):
            yield piece
            reached.append(piece)
            if len(reached) == 3:  # some pieces written back, one read ahead, the rest not
                os.kill(os.getpid(), signal.SIGKILL)

    disk_pieces.PieceStream.spans = spans_then_die
    train(e, range(2, 3))
"""


def test_a_run_killed_mid_step_resumes_from_its_last_checkpoint_bitwise(tmp_path):
    """The process dies inside a step's stream (its files half stepped, its lock left): an
    engine on the same directory loads the last checkpoint and continues as the run that
    was not killed does."""
    import subprocess
    import sys

    options = {"precision": "bf16", "chunk_size": 16384, "piece": 4096}
    state, ckpt = tmp_path / "state", tmp_path / "ckpt"
    script = KILLED_MID_STEP.format(tests=os.path.dirname(os.path.dirname(__file__)),
                                    here=os.path.dirname(__file__), state=str(state),
                                    options=options, ckpt=str(ckpt))  # fmt: skip
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert any(state.glob("*-moments.bin"))  # what it left
    with fxstar.compile(tiny_gpt(), plan(state, **options), **example("gpt", *tokens())) as e:
        train(e, range(2))
        expected = {"losses": train(e, range(2, 4)), **snapshot(e)}
    with fxstar.compile(tiny_gpt(1), plan(state, **options), **example("gpt", *tokens())) as e:
        e.load(ckpt)
        got = {"losses": train(e, range(2, 4)), **snapshot(e)}
    assert_same(got, expected)
    assert not any(state.iterdir())  # the killed run's files too: the tier made them again


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


def test_a_meta_built_model_is_initialised_into_the_mapped_masters(tmp_path, monkeypatch):
    """weights='init' writes each module's values through the masters' mappings, the pages
    given back after each module (Engine.release_mapped_pages); the run equals the host's."""
    from fxstar.engine import Engine

    releases = []
    release = Engine.release_mapped_pages
    monkeypatch.setattr(Engine, "release_mapped_pages",
                        lambda self: releases.append(1) or release(self))  # fmt: skip
    results = []
    for disk in (tmp_path / "state", None):
        with torch.device("meta"):
            model = tiny_gpt()
        torch.manual_seed(0)
        with fxstar.compile(model, plan(disk, precision="bf16", chunk_size=4096),
                            **example("gpt", *tokens()), weights="init") as e:  # fmt: skip
            results.append({"losses": train(e, range(2)), **snapshot(e)})
        if disk is not None:
            modules = sum(1 for m in model.modules() if hasattr(m, "reset_parameters"))
            assert len(releases) >= modules  # after each module's init at least
    assert_same(*results)


def test_the_dump_report_and_host_budget_say_where_the_masters_are(tmp_path):
    """Each fetch notes its chunk's parts' tiers; the report names the masters' tier; the
    host budget counts no masters on the host when the disk holds them, only its slots."""
    needs = {}
    for masters in (True, False):
        p = plan(tmp_path / f"s{masters}", masters=masters, precision="bf16", chunk_size=4096)
        with fxstar.compile(tiny_gpt(), p, **example("gpt", *tokens())) as e:
            train(e, range(1))
            program = e.programs[next(iter(e.programs))]
            text = format_graph(program)
            where = "disk" if masters else "host"
            assert f"tiers=payload host, fp32 master {where}, moments disk" in text
            assert f"fp32 masters take 4 bytes per parameter on the {where} tier" in e.report()
            needs[masters] = placement.host_need(p, program.decisions.chunk_plan, [])[0]
            layout = program.decisions.chunk_plan.layout
    masters_bytes = sum(c.used for c in layout.chunks) * 4
    slots = 3 * max(c.used for c in layout.chunks if c.trainable) * 4
    assert needs[False] - needs[True] >= masters_bytes - slots - 4096 * len(layout.chunks)
    assert needs[True] < needs[False]


def test_plans_the_disk_tier_cannot_serve_are_refused_by_name():
    with pytest.raises(PlanError, match="disk: .*optimizer.type 'sgd'"):
        Plan(device_memory="auto", optimizer={"type": "sgd"}, disk="/tmp/x")
    with pytest.raises(PlanError, match="disk: .*no chunks"):
        Plan(disk="/tmp/x")


def _data_parallel(rank: int, world: int, root: str, precision: str) -> dict:
    out = {}
    # bf16: chunks of four pieces, so each rank's runs split at the pieces' edges
    sizes = {"chunk_size": 4096} if precision == "fp32" else {"chunk_size": 16384, "piece": 4096}
    for name, disk in (("host", None), ("disk", f"{root}/state")):
        with fxstar.compile(tiny_gpt(), plan(disk, precision=precision, **sizes),
                            **example("gpt", *tokens())) as e:  # fmt: skip
            losses = train(e, range(STEPS))
            owned = sorted(c.id for c in e.chunks.step_chunks.own_trainable())
            pieces = max(map(len, e.optimizer._pieces.values()), default=0)  # of one chunk
            out[name] = {"losses": losses, **snapshot(e), "owned": owned,
                         "on_disk": sorted(getattr(e.optimizer, "on_disk", [])),
                         "most_pieces": pieces}  # fmt: skip
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
        assert disk["most_pieces"] >= (3 if precision == "bf16" else 1)
        assert len([f for f in disk["files"] if f.endswith("-moments.bin")]) == len(disk["owned"])
        masters = [f for f in disk["files"] if f.endswith("-master.bin")]
        # sharded payloads: a rank has homes, and masters, of its own chunks only
        assert len(masters) == (len(disk["owned"]) if precision == "bf16" else 0)
    assert not set(results[0]["disk"]["owned"]) & set(results[1]["disk"]["owned"])
    with contextlib.suppress(FileNotFoundError):
        assert not any((tmp_path / "state").iterdir())


class MomentBuffers:
    """The most bytes of moment buffers alive at once while it is entered: every host buffer
    the disk tier (its reads, writes and stream slots) and HybridAdam allocate, each counted
    until its memory is freed (its storage, which views keep alive)."""

    SITES = ((disk_tier, "aligned_buffer"), (optim, "host_empty"))

    def __init__(self):
        self.live = self.peak = 0

    def __enter__(self) -> MomentBuffers:
        self.saved = [(module, name, getattr(module, name)) for module, name in self.SITES]
        for module, name, make in self.saved:
            setattr(module, name, self._counted(make))
        return self

    def __exit__(self, *exc) -> None:
        for module, name, make in self.saved:
            setattr(module, name, make)

    def _counted(self, make):
        def counted(nbytes, **options):
            buffer = make(nbytes, **options)
            self.live += buffer.nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(buffer.untyped_storage(), self._freed, buffer.nbytes)
            return buffer

        return counted

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes


def one_chunk(engine) -> int:
    """The bytes of the largest disk-homed chunk's moments (a stream slot's, aligned); the
    engine has several, which together hold far more."""
    optimizer = engine.optimizer
    sizes = [aligned_size(optimizer.disk.sizes[(c, optim.MOMENTS)]) for c in optimizer.on_disk]
    assert len(sizes) >= 4 and sum(sizes) > 3 * max(sizes), sizes
    return max(sizes)


def test_a_save_and_a_load_hold_one_chunks_moments_at_a_time(tmp_path):
    with fxstar.compile(tiny_gpt(), plan(tmp_path / "a"), **example("gpt", *tokens())) as e:
        train(e, range(1))
        largest = one_chunk(e)
        with MomentBuffers() as saving:
            e.save(tmp_path / "ckpt")
        with MomentBuffers() as loading:  # into the engine that saved it
            e.load(tmp_path / "ckpt")
    assert 0 < saving.peak <= largest and 0 < loading.peak <= largest
    with fxstar.compile(tiny_gpt(1), plan(tmp_path / "b"), **example("gpt", *tokens())) as e:
        with MomentBuffers() as loading:  # into a fresh one, its parts made by the load
            e.load(tmp_path / "ckpt")
        assert 0 < loading.peak <= one_chunk(e)


def test_the_host_budget_holds_the_slots_of_a_step_and_of_a_checkpoint(tmp_path):
    """One slot of a chunk's whole moments (a save, a load) can be more than a step's `depth`
    slots of a piece: the host budget counts whichever is more, and neither goes past it."""
    for depth, piece in ((2, 4096), (3, 16384)):  # the checkpoint's slot the more; the step's
        p = plan(tmp_path / "state", chunk_size=16384, piece=piece)
        p = p.replace(disk={**p.disk.to_dict(), "depth": depth})
        with fxstar.compile(tiny_gpt(), p, **example("gpt", *tokens())) as e:
            train(e, range(1))
            stepped = e.optimizer.disk.stats.peak_staging_bytes
            e.save(tmp_path / "ckpt")
            e.load(tmp_path / "ckpt")
            held = e.optimizer.disk.stats.peak_staging_bytes
            layout = e.programs[next(iter(e.programs))].decisions.chunk_plan.layout
            slots = host_slot_bytes(
                "fp32", [(c.used, [q.numel for q in c.params]) for c in layout.chunks
                         if c.trainable], piece, depth, masters=False,
            )  # fmt: skip
        assert held <= slots, (depth, stepped, held, slots)
        assert stepped < held if piece == 4096 else stepped == held, (depth, stepped, held)


ROUND_TRIPS = {
    "disk to disk, fp32": ("disk", "disk", {}, {}),
    "disk to disk, 8-bit moments": ("disk", "disk", CASES["8-bit moments, bf16"], {}),
    "disk to disk, kept chunks beside": ("disk", "disk", CASES["kept chunks beside"], {}),
    "host fp32 to disk 8-bit": (None, "disk", {}, {"optimizer": {**OPT, "state_dtype": "8bit"}}),
}


@pytest.mark.parametrize("case", ROUND_TRIPS)
def test_a_checkpoint_resumes_bitwise_through_the_disk_tier(case, tmp_path):
    """Saved by one engine and loaded by another (with or without a disk tier, in the same
    state dtype or another): the loading engine continues as the same load into a host
    engine does, and, in the same options, as the engine that saved it."""
    saver, loader, options, loader_options = ROUND_TRIPS[case]

    def where(tier, name):
        return None if tier is None else tmp_path / name

    with fxstar.compile(tiny_gpt(), plan(where(saver, "a"), **options),
                        **example("gpt", *tokens())) as e:  # fmt: skip
        train(e, range(2))
        e.save(tmp_path / "ckpt")
        expected = {"losses": train(e, range(2, 4)), **snapshot(e)}
    results = []
    for tier, name in ((loader, "b"), (None, "c")):
        with fxstar.compile(tiny_gpt(1), plan(where(tier, name), **options, **loader_options),
                            **example("gpt", *tokens())) as e:  # fmt: skip
            e.load(tmp_path / "ckpt")
            results.append({"losses": train(e, range(2, 4)), **snapshot(e)})
            assert bool(getattr(e.optimizer, "on_disk", [])) == (tier is not None)
    assert_same(results[0], results[1])
    if not loader_options:
        assert_same(results[0], expected)


def _data_parallel_checkpoint(rank: int, world: int, root: str) -> dict:
    options = {"chunk_size": 4096}
    with fxstar.compile(tiny_gpt(), plan(f"{root}/a", **options),
                        **example("gpt", *tokens())) as e:  # fmt: skip
        train(e, range(2))
        with MomentBuffers() as saving:
            e.save(f"{root}/ckpt")
        expected = {"losses": train(e, range(2, 4)), **snapshot(e)}
    with fxstar.compile(tiny_gpt(1), plan(f"{root}/b", **options),
                        **example("gpt", *tokens())) as e:  # fmt: skip
        with MomentBuffers() as loading:
            e.load(f"{root}/ckpt")
        got = {"losses": train(e, range(2, 4)), **snapshot(e)}
        largest = one_chunk(e)
    return {"expected": expected, "got": got, "peaks": (saving.peak, loading.peak),
            "largest": largest}  # fmt: skip


def test_data_parallel_ranks_save_and_load_their_own_chunks_state(tmp_path):
    for result in spawn(_data_parallel_checkpoint, 2, str(tmp_path)):
        assert_same(result["got"], result["expected"])
        assert all(0 < peak <= result["largest"] for peak in result["peaks"]), result["peaks"]
