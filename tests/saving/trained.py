"""Engines trained and saved for the checkpoint tests (tests/saving/)."""

import json
import shutil
from pathlib import Path

import torch
from conftest import tiny_gpt, tokens
from safetensors import safe_open

import fxstar.saving as ckpt
from fxstar.engine import compile
from fxstar.passes.chunk_layout import nonmodel_peak
from fxstar.plan import Plan
from fxstar.saving import file_format

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


def equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def save_trained(tmp_path_factory) -> tuple:
    """An engine and its checkpoint after two steps (plain plan)."""
    engine, scheduler = build(plan_for("plain"))
    train(engine, scheduler, range(2))
    path = tmp_path_factory.mktemp("saved") / "ckpt"
    engine.save(path)
    return engine, path


def copy_checkpoint(path: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(path, tmp_path / path.name))


def edit_json(path: Path, change) -> None:
    meta = json.loads((path / ckpt.STATE).read_text())
    change(meta)
    (path / ckpt.STATE).write_text(json.dumps(meta))


def reseal(path: Path) -> None:
    """Record every file's size and CRC in the manifest again, as a tool that edits a
    checkpoint knowingly would: then only the values' own checks stand in the way."""
    if not (path / ckpt.MANIFEST).exists():
        return
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    for name, record in manifest["files"].items():
        record.update(file_format.record(path / name))
        if "tensors" in record:
            with safe_open(path / name, "pt") as f:
                keys = f.keys()  # safe_open is not iterable
                record["tensors"] = {k: file_format.tensor_crc(f.get_tensor(k)) for k in keys}
    body = {k: v for k, v in manifest.items() if k != "crc32"}
    (path / ckpt.MANIFEST).write_text(json.dumps({**body, "crc32": file_format.json_crc(body)}))


def users_dirs(directory: Path, *names: str) -> dict[str, str]:
    """Directories of a user's, each with a file in it: {name: the file's text}."""
    for name in names:
        (directory / name).mkdir()
        (directory / name / "notes.txt").write_text(f"mine: {name}")
    return {name: f"mine: {name}" for name in names}


def intact(directory: Path, users: dict[str, str]) -> bool:
    return all((directory / n / "notes.txt").read_text() == text for n, text in users.items())
