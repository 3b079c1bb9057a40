"""The `fxstar` command as a user types it."""

import json

import pytest

from fxstar.cli import main

TINY = "fxstar.models.gpt:tiny"


def test_dump_prints_the_last_stage(capsys):
    assert main(["dump", TINY, "--passes", "shape_memory"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# stage 1: shape_memory (after capture)")
    assert "aten.linear" in out and "out=" in out


def test_dump_named_stage_and_diff(capsys):
    assert main(["dump", TINY, "--stage", "0"]) == 0
    assert capsys.readouterr().out.startswith("# stage 0: capture")
    assert main(["diff", TINY, "capture", "shape_memory", "--passes", "shape_memory"]) == 0
    out = capsys.readouterr().out
    assert "--- stage 0: capture" in out and "+++ stage 1: shape_memory" in out
    assert "\x1b[" not in out  # no colour when not on a terminal


def test_plan_prints_the_estimate(capsys):
    assert main(["plan", TINY]) == 0
    out = capsys.readouterr().out
    for row in ("parameters", "gradients", "optimizer state", "activations saved", "total"):
        assert row in out
    assert "h.1" in out  # the per-block table


def test_plan_file_and_errors(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"fake_dist": True}))
    assert main(["dump", TINY, "--plan", str(plan)]) == 2
    assert "'fake_dist' is not implemented" in capsys.readouterr().err
    plan.write_text(json.dumps({"device_memroy": "1GiB"}))
    assert main(["plan", TINY, "--plan", str(plan)]) == 2
    assert "did you mean 'device_memory'" in capsys.readouterr().err
    assert main(["dump", "fxstar.models.gpt:nothing"]) == 2
    assert "no callable 'nothing'" in capsys.readouterr().err
    assert main(["dump", TINY, "--stage", "nope"]) == 2
    assert "no stage named 'nope'" in capsys.readouterr().err


def test_a_file_target(tmp_path, capsys):
    path = tmp_path / "model.py"
    path.write_text(
        "import torch\n"
        "def make():\n"
        "    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())\n"
        "    return {'model': model, 'example_inputs': (torch.randn(2, 4),)}\n"
    )
    assert main(["dump", f"{path}:make"]) == 0
    assert "aten.linear" in capsys.readouterr().out


def test_train_learns_and_writes_json(tmp_path, capsys):
    out = tmp_path / "train.json"
    args = ["train", "--steps", "25", "--layers", "1", "--width", "32", "--heads", "2",
            "--seq-len", "16", "--no-progress", "--log-every", "5", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "step    20  loss" in printed and "fxstar engine for GPT" in printed
    result = json.loads(out.read_text())
    assert len(result["losses"]) == 25
    assert result["losses"][-1] < result["losses"][0]
    assert result["eval_loss"] == pytest.approx(result["eval_loss"])  # a number, not NaN
    assert result["config"]["steps"] == 25 and result["plan"]["optimizer"]["type"] == "adamw"


def test_train_through_the_chunk_engine_draws_the_timeline(tmp_path, capsys):
    png = tmp_path / "timeline.png"
    args = ["train", "--steps", "3", "--layers", "1", "--width", "32", "--heads", "2",
            "--seq-len", "16", "--no-progress", "--device-memory", "2MiB",
            "--timeline", str(png)]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "passes: shape_memory, chunk_layout, chunk_schedule" in out
    assert "moved host->compute" in out and png.exists()
