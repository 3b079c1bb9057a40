"""init_from_env: a torchrun rank joins its group on its own card."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fxstar.dist_launch import init_from_env


def test_under_torchrun_with_nccl_the_local_ranks_card_is_current_before_the_group(monkeypatch):
    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(("card", index)))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(
        dist, "init_process_group", lambda backend: calls.append(("group", backend))
    )
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    init_from_env()
    assert calls == [("card", 3), ("group", "nccl")]


def test_without_a_gpu_the_group_is_gloo(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", calls.append)
    monkeypatch.setenv("WORLD_SIZE", "2")
    init_from_env()
    monkeypatch.setenv("WORLD_SIZE", "1")  # not launched as several ranks: nothing to join
    init_from_env()
    assert calls == ["gloo"]
