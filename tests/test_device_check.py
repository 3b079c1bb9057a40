"""benchmarks/device_check.py, the script a session lent a GPU runs first, works here on the
CPU (its device-only facts skipped), so it is ready when a device is."""

import json

from conftest import benchmark


def device_check(monkeypatch):
    return benchmark("device_check", monkeypatch)


def test_every_check_passes_on_the_cpu(tmp_path, capsys, monkeypatch):
    module = device_check(monkeypatch)
    out = tmp_path / "check.json"
    code = module.main(["--device", "cpu", "--layers", "4", "--width", "256", "--heads", "4",
                        "--vocab", "2048", "--seq-len", "128", "--batch-size", "2",
                        "--steps", "2", "--json", str(out)])  # fmt: skip
    checks = {c["name"]: c for c in json.loads(out.read_text())["checks"]}
    assert code == 0, capsys.readouterr().out
    assert set(checks) == {"chunks", "overlap", "hybrid", "offload", "meta"}
    assert checks["hybrid"]["facts"]["kept chunks"] != "0/1"
    assert "gradient copies hidden" in checks["overlap"]["facts"]
    assert {c["facts"]["chunk blocks"] for c in checks.values()} == {"ArenaBuffer"}


def test_every_check_passes_on_the_simulated_device(tmp_path, capsys, monkeypatch):
    """Every check end to end with its copies between the tiers on worker threads
    (fxstar.testing.SimulatedDevice): prefetch and overlapped copies on, as on a card."""
    module = device_check(monkeypatch)
    out = tmp_path / "check.json"
    code = module.main(["--device", "simulated", "--layers", "2", "--width", "64", "--heads",
                        "2", "--vocab", "256", "--seq-len", "32", "--batch-size", "2",
                        "--steps", "2", "--json", str(out)])  # fmt: skip
    assert code == 0, capsys.readouterr().out
    checks = {c["name"]: c for c in json.loads(out.read_text())["checks"]}
    assert set(checks) == {"chunks", "overlap", "hybrid", "offload", "meta"}
    assert checks["hybrid"]["facts"]["kept chunks"] != "0/7"
    assert all("gradient copies hidden" in c["facts"] for c in checks.values())
    # dynamic partition: chunk blocks from the allocator activations use, as on a card
    assert {c["facts"]["chunk blocks"] for c in checks.values()} == {"PooledBlocks"}
