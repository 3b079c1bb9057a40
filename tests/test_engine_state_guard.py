"""A step or a load stopped halfway (Ctrl-C, a disk's I/O error) leaves some parameters and
their optimizer state written and others not: the engine refuses to train on it, read it or
save it (a save would write it over the last good checkpoint) until a load replaces it; after
that load the run goes on bit for bit as one that loaded the checkpoint fresh. What stopped
before anything was written leaves the state whole and usable."""

from __future__ import annotations

import errno
import hashlib
import warnings

import pytest
import torch
from conftest import example, tiny_gpt, tokens

import fxstar
from fxstar.errors import DiskIOError, EngineStateError
from fxstar.runtime import disk_pieces, moments
from fxstar.saving import checkpoint

ADAMW = {"type": "adamw", "lr": 1e-2, "weight_decay": 0.1, "clip_grad_norm": 0.5}


def plan(tmp_path, kind: str) -> fxstar.Plan:
    base = {"device_memory": "auto", "hybrid_adam": False, "chunk_size": 16384}
    if kind == "sgd":  # a torch optimizer over fp32 chunks
        return fxstar.Plan(**base, optimizer={"type": "sgd", "lr": 0.1})
    disk = {"path": str(tmp_path / "state"), "piece": 4096} if kind == "disk" else None
    return fxstar.Plan(**base, precision="bf16", optimizer=ADAMW, disk=disk)


def train_step(engine, step: int) -> torch.Tensor:
    ids, targets = tokens(seed=step)
    torch.manual_seed(step)
    loss = engine(ids, targets)
    loss.backward()
    engine.step()
    return loss.detach()


def digest(directory) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}  # fmt: skip


def stop_halfway(monkeypatch, engine, kind: str) -> type[BaseException]:
    """Make the next optimizer step raise after it wrote part of the state; the error's type."""
    if kind == "disk":  # the disk fails under a piece, some pieces written back

        def failing(self, chunk_id, span, spans=disk_pieces.PieceStream.spans, seen=[]):  # noqa: B006
            for piece in spans(self, chunk_id, span):
                seen.append(piece)
                if len(seen) == 3:
                    raise DiskIOError("the disk failed", operation="read", path="part",
                                      offset=0, nbytes=1, failed_at=0, errno=errno.EIO,
                                      strerror="EIO")  # fmt: skip
                yield piece

        monkeypatch.setattr(disk_pieces.PieceStream, "spans", failing)
        return DiskIOError
    if kind == "sgd":  # Ctrl-C inside torch's step, one parameter updated

        def interrupted(*args, **kwargs):
            with torch.no_grad():
                next(iter(engine.parameters())).add_(1.0)
            raise KeyboardInterrupt

        monkeypatch.setattr(engine.optimizer, "step", interrupted)
        return KeyboardInterrupt
    calls, step = [], moments.AdamMoments.step

    def ctrl_c_at_the_third_run(self, *args, **kwargs):
        calls.append(None)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step(self, *args, **kwargs)

    monkeypatch.setattr(moments.AdamMoments, "step", ctrl_c_at_the_third_run)
    return KeyboardInterrupt


@pytest.mark.parametrize("kind", ["host", "disk", "sgd"])
def test_a_step_stopped_halfway_is_refused_until_a_load(kind, tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    with fxstar.compile(tiny_gpt(), plan(tmp_path, kind), **example("gpt", *tokens())) as e:
        train_step(e, 0)
        e.save(ckpt)
        saved = digest(ckpt)
        before = [p.detach().clone() for p in e.parameters()]
        error = stop_halfway(monkeypatch, e, kind)
        with pytest.raises(error):
            train_step(e, 1)
        monkeypatch.undo()
        changed = [not torch.equal(a, p) for a, p in zip(before, e.parameters(), strict=True)]
        assert any(changed) and not all(changed)  # halfway indeed
        refusals = {
            "engine.save": lambda: e.save(ckpt),
            "engine.state_dict": e.state_dict,
            "engine.training_state": e.training_state,
            "engine.gradients": e.gradients,
            "engine.export_state_dict": lambda: e.export_state_dict(tmp_path / "out.safetensors"),
            "engine forward": lambda: e(*tokens()),
            "engine.step": e.step,
        }
        for action, call in refusals.items():
            with pytest.raises(EngineStateError, match=f"{action}: the training state is half"):
                call()
        assert digest(ckpt) == saved  # the last good checkpoint is as it was
        assert not (tmp_path / "out.safetensors").exists()
        e.load(ckpt)
        got = [train_step(e, step) for step in (1, 2)] + [*e.state_dict().values()]
    with fxstar.compile(tiny_gpt(7), plan(tmp_path, kind), **example("gpt", *tokens())) as e:
        e.load(ckpt)
        want = [train_step(e, step) for step in (1, 2)] + [*e.state_dict().values()]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_the_optimizer_stepped_directly_refuses_too(tmp_path, monkeypatch):
    with fxstar.compile(tiny_gpt(), plan(tmp_path, "host"), **example("gpt", *tokens())) as e:
        train_step(e, 0)
        stop_halfway(monkeypatch, e, "host")
        e(*tokens()).backward()
        with pytest.raises(KeyboardInterrupt):
            e.optimizer.step()
        monkeypatch.undo()
        with pytest.raises(EngineStateError, match="HybridAdam.step: .*optimizer step 2 "):
            e.optimizer.step()
        with pytest.raises(EngineStateError, match="engine.save"):
            e.save(tmp_path / "ckpt")


def test_a_load_stopped_halfway_is_refused_until_a_load_finishes(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    with fxstar.compile(tiny_gpt(), plan(tmp_path, "host"), **example("gpt", *tokens())) as e:
        train_step(e, 0)
        e.save(ckpt)

        def restore_interrupted(*args, **kwargs):
            raise KeyboardInterrupt

        monkeypatch.setattr(checkpoint, "restore", restore_interrupted)
        with pytest.raises(KeyboardInterrupt):
            e.load(ckpt)  # the parameters copied, the optimizer state not
        monkeypatch.undo()
        with pytest.raises(EngineStateError, match=r"engine.load of .*ckpt stopped halfway"):
            e(*tokens())
        e.load(ckpt)
        train_step(e, 1)


def test_what_stopped_before_writing_leaves_the_state_whole(tmp_path, monkeypatch):
    """An error before the step writes (the clip norm's decision) or a checkpoint a load
    refuses: nothing changed, nothing is refused."""
    with fxstar.compile(tiny_gpt(), plan(tmp_path, "host"), **example("gpt", *tokens())) as e:
        train_step(e, 0)
        before = [p.detach().clone() for p in e.parameters()]

        def norm_fails(*args, **kwargs):
            raise RuntimeError("the norm's collective failed")

        monkeypatch.setattr(e.optimizer.norm, "decide", norm_fails)
        with pytest.raises(RuntimeError, match="collective failed"):
            train_step(e, 1)
        monkeypatch.undo()
        assert all(torch.equal(a, p) for a, p in zip(before, e.parameters(), strict=True))
        e.save(tmp_path / "ckpt")
        sgd = plan(tmp_path, "sgd")
        with fxstar.compile(tiny_gpt(), sgd, **example("gpt", *tokens())) as other:
            train_step(other, 0)
            other.save(tmp_path / "other")  # another optimizer's state
        with pytest.raises(fxstar.CheckpointError, match="this engine's optimizer is HybridAdam"):
            e.load(tmp_path / "other")
        e.zero_grad()
        train_step(e, 1)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_step_retried_after_an_error_before_writing_steps_as_one_not_stopped(
    accumulation, tmp_path, monkeypatch
):
    """The update raised before it wrote (a collective of the clip norm failed): the step is
    not counted, so calling engine.step() again takes it with the gradients summed so far."""
    options = {"optimizer": {**ADAMW, "accumulation_steps": accumulation}}
    runs = []
    for fail in (True, False):
        p = plan(tmp_path, "host").replace(**options)
        with fxstar.compile(tiny_gpt(), p, **example("gpt", *tokens())) as e:
            for step in range(2 * accumulation):
                ids, targets = tokens(seed=step)
                torch.manual_seed(step)
                e(ids, targets).backward()
                boundary = (step + 1) % accumulation == 0
                if fail and boundary and step == accumulation - 1:
                    with monkeypatch.context() as patch:
                        patch.setattr(e.optimizer.norm, "decide", norm_fails)
                        with pytest.raises(RuntimeError, match="collective failed"):
                            e.step()
                assert e.step() == boundary
            runs.append([e.step_count, *e.state_dict().values()])
    assert runs[0][0] == runs[1][0] == 2 * accumulation
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1:], runs[1][1:], strict=True))


def norm_fails(*args, **kwargs):
    raise RuntimeError("the norm's collective failed")


def test_compiling_a_model_a_closed_engine_left_half_written_warns(tmp_path, monkeypatch):
    """The engine refuses its half-written state; once closed, the model still holds it: a
    compile of that model says so (a load into the engine made it whole: no warning)."""
    model = tiny_gpt()
    with fxstar.compile(model, plan(tmp_path, "host"), **example("gpt", *tokens())) as e:
        train_step(e, 0)
        e.save(tmp_path / "ckpt")
        stop_halfway(monkeypatch, e, "host")
        with pytest.raises(KeyboardInterrupt):
            train_step(e, 1)
        monkeypatch.undo()
    left = "GPT's parameters were left half written by the engine that trained them: the "
    with pytest.warns(UserWarning, match=left + "optimizer step 2 stopped halfway"):
        e = fxstar.compile(model, plan(tmp_path, "host"), **example("gpt", *tokens()))
    with e:
        e.load(tmp_path / "ckpt")
        stop_halfway(monkeypatch, e, "host")
        with pytest.raises(KeyboardInterrupt):
            train_step(e, 1)
        monkeypatch.undo()
        e.load(tmp_path / "ckpt")  # whole again
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*half written")
        fxstar.compile(model, plan(tmp_path, "host"), **example("gpt", *tokens())).close()
