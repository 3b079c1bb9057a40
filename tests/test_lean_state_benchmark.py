"""benchmarks/lean_state.py end to end on a small GPT: each state dtype trains, its moments'
bytes per parameter are what the format takes, the paired Adam-step ratios are ordered, and
its JSON is written."""

import json

from conftest import benchmark


def test_each_state_dtype_trains_and_is_counted(tmp_path, monkeypatch, capsys):
    module = benchmark("lean_state", monkeypatch)
    out = tmp_path / "lean.json"
    code = module.main(["--steps", "25", "--layers", "1", "--width", "64", "--heads", "2",
                        "--seq-len", "16", "--batch-size", "2", "--adam-size", "64K",
                        "--rounds", "2", "--json", str(out)])  # fmt: skip
    assert code == 0
    rows = {r["state_dtype"]: r for r in json.loads(out.read_text())["rows"]}
    assert [rows[s]["bytes_per_param"] for s in ("fp32", "bf16")] == [8.0, 4.0]
    assert 2.0 < rows["8bit"]["bytes_per_param"] < 2.1
    assert all(r["tier"] == "host" and 0 < r["final_loss"] < 10 for r in rows.values())
    assert rows["fp32"]["loss_vs_fp32"] == 0 and rows["fp32"]["adam_vs_fp32"] is None
    low, median, high = rows["8bit"]["adam_vs_fp32"]
    assert 0 < low <= median <= high
    printed = capsys.readouterr().out
    assert "8bit state's final loss" in printed and "bf16 state's final loss" in printed
