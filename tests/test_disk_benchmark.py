"""benchmarks/disk.py end to end on a small GPT: its figures are there and hold together (each
moment byte read and written once a step; the tier's host slots counted), and its JSON is
written."""

import json

from conftest import benchmark


def test_the_disk_benchmark_runs_small(tmp_path, monkeypatch):
    module = benchmark("disk", monkeypatch)
    out = tmp_path / "disk.json"
    code = module.main(["--layers", "1", "--width", "64", "--heads", "2", "--vocab", "256",
                        "--seq-len", "32", "--batch-size", "2", "--rounds", "2",
                        "--dir", str(tmp_path), "--json", str(out)])  # fmt: skip
    assert code == 0
    r = json.loads(out.read_text())["result"]
    assert r["bytes_read_per_step"] + r["bytes_written_per_step"] == r["minimum_per_step"] > 0
    assert r["disk_bytes_per_param"] < r["host_bytes_per_param"]
    assert r["stream_bytes_per_s"] > 0 and r["plain_bytes_per_s"] > 0
    parts = r["disk_part_bytes_per_param"]  # the moments' bytes by state dtype, masters alike
    assert parts["8bit"]["moments"] < parts["bf16"]["moments"] < parts["fp32"]["moments"]
    assert parts["fp32"]["moments"] >= 8 and parts["8bit"]["master"] == parts["fp32"]["master"]
    assert [p.name for p in tmp_path.iterdir()] == ["disk.json"]  # its files removed
