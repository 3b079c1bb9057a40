"""benchmarks/dynamic_partition.py end to end on a small GPT: its figures keep their order
(a Belady-optimal cache moves no more than the per-moment shares, which move no more than
the fixed arena) and its JSON is written."""

import json

from conftest import benchmark


def test_per_moment_shares_move_no_more_than_the_fixed_arena(tmp_path, monkeypatch):
    module = benchmark("dynamic_partition", monkeypatch)
    out = tmp_path / "dp.json"
    code = module.main(["--layers", "2", "--width", "64", "--heads", "2", "--vocab", "256",
                        "--seq-len", "32", "--batch-size", "2", "--steps", "2",
                        "--json", str(out)])  # fmt: skip
    assert code == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert 0 < row["belady_bytes"] <= row["dynamic_bytes"] <= row["fixed_bytes"], row
