"""PatrickStar configs budget the card as PatrickStar does (fxstar/patrickstar.py); the key
mapping itself is tested with the rest of Plan in test_plan.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fxstar.passes.chunk_layout import auto_budget
from fxstar.placement import place
from fxstar.plan import Plan, PlanError

CONFIG = {
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "use_hybrid_adam": True}},
    "fp16": {"enabled": True},
    "client": {"mem_tracer": {"overall_gpu_mem_ratio": 0.5}},
}


@pytest.fixture
def one_card(monkeypatch):
    """torch.cuda as on a machine with one 10 GiB card."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(total_memory=10 * 2**30))  # fmt: skip
    monkeypatch.delenv("LOCAL_RANK", raising=False)


def test_a_config_without_device_memory_budgets_the_card_times_overall_gpu_mem_ratio(one_card):
    plan = Plan.from_patrickstar(CONFIG)
    assert plan.device_memory == "auto"
    # the card computes (chunks paged to it), not the host the model was built on
    assert place(nn.Linear(4, 4), plan) == torch.device("cuda", 0)
    program = SimpleNamespace(plan=plan, compute_device=lambda: torch.device("cuda", 0))
    assert auto_budget(program, smallest=None) == int(10 * 2**30 * 0.5)


def test_a_config_that_names_device_memory_keeps_it():
    assert Plan.from_patrickstar({**CONFIG, "device_memory": "2GiB"}).device_memory == 2 * 2**30
    assert Plan.from_patrickstar({**CONFIG, "device_memory": None}).device_memory is None


def test_a_warmup_share_outside_static_partition_is_refused_by_name():
    def tracer(**options):
        return {**CONFIG, "client": {"mem_tracer": options}}

    with pytest.raises(PlanError, match="warmup_gpu_chunk_mem_ratio=0.3 is read only with "
                       "static_partition=True"):  # fmt: skip
        Plan.from_patrickstar(tracer(warmup_gpu_chunk_mem_ratio=0.3))
    plan = Plan.from_patrickstar(tracer(warmup_gpu_chunk_mem_ratio=0.3, with_static_partition=True))
    assert plan.static_partition and plan.warmup_gpu_chunk_mem_ratio == 0.3
    assert Plan.from_patrickstar(tracer(warmup_gpu_chunk_mem_ratio=0.1)).notes == []
