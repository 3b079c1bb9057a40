"""The host budget: what the chunk engine allocates on the host is known before it allocates,
and a model that would not fit is a clear error at compile (host_memory, or
overall_cpu_mem_ratio of the machine's memory shared by the node's processes)."""

import pytest
import torch
from conftest import activation_budget, example, tiny_gpt, tokens

from fxstar import HostMemoryError, placement
from fxstar.engine import compile
from fxstar.plan import Plan
from fxstar.sizes import format_size

OPT = {"type": "adamw", "lr": 1e-3}


def engine_host_bytes(engine) -> int:
    """What the engine's chunk manager and optimizer really hold on the host."""
    manager = engine.chunks
    storages = {}
    for chunk in manager.chunks:
        for t in (chunk.payload, chunk.master, chunk.grad):
            if t is not None and t.device.type == "cpu":
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    for state in engine.optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            storage = state[key].untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values()) + manager.planned_capacity  # the arena rounds it down


@pytest.mark.parametrize("precision,grads_in_host", [("fp32", True), ("bf16", True),
                                                     ("bf16", False)])  # fmt: skip
def test_the_need_is_what_the_engine_allocates(precision, grads_in_host):
    plan = Plan(precision=precision, device_memory="auto", optimizer=OPT,
                grads_in_host=grads_in_host, hybrid_adam=False)  # fmt: skip
    engine = compile(tiny_gpt(), plan, **example("gpt", *tokens()))
    engine(*tokens()).backward()
    engine.step()  # HybridAdam makes its moments at the first step
    need = placement.check_host_budget(plan, engine.program.decisions.chunk_plan)
    assert need == engine_host_bytes(engine)
    params = sum(p.numel() for p in engine.parameters())
    per_param = {"fp32": 16, "bf16": 14 if grads_in_host else 16}[precision]
    arena = engine.chunks.planned_capacity
    assert per_param * params <= need - arena <= per_param * params * 1.05  # alignment only


def test_a_model_over_host_memory_is_refused_at_compile():
    plan = Plan(device_memory="auto", optimizer=OPT, host_memory="256KiB")
    with pytest.raises(
        HostMemoryError, match=r"over the host budget of 256KiB \(plan.host_memory\)"
    ):
        compile(tiny_gpt(), plan, **example("gpt", *tokens()))


def test_without_host_memory_the_ratio_of_the_machine_shared_by_the_node(monkeypatch):
    monkeypatch.setattr(placement, "physical_memory", lambda: 2**20)
    plan = Plan(device_memory="auto", optimizer=OPT, overall_cpu_mem_ratio=0.5)
    budget, source = placement.host_budget(plan)
    assert budget == 2**19 and "overall_cpu_mem_ratio 0.5 of 1MiB" in source
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    budget, source = placement.host_budget(plan)
    assert budget == 2**17 and "/ 4 processes" in source
    with pytest.raises(HostMemoryError, match="overall_cpu_mem_ratio"):
        compile(tiny_gpt(), plan, **example("gpt", *tokens()))


def test_a_fitting_model_compiles_under_its_exact_need():
    plan = Plan(device_memory="auto", optimizer=OPT, hybrid_adam=False)
    engine = compile(tiny_gpt(), plan, **example("gpt", *tokens()))
    need = placement.check_host_budget(plan, engine.program.decisions.chunk_plan)
    homes, arena = placement.host_need(plan, engine.program.decisions.chunk_plan)
    assert homes + arena == need
    line = f"host memory: {format_size(homes)} for chunk homes and optimizer state and "
    assert line + f"{format_size(arena)} for the arena, of a host budget" in engine.report()
    exact = Plan(device_memory="auto", optimizer=OPT, hybrid_adam=False, host_memory=need)
    torch.manual_seed(0)
    compile(tiny_gpt(), exact, **example("gpt", *tokens()))(*tokens()).backward()
    with pytest.raises(HostMemoryError):
        too_small = Plan(device_memory="auto", optimizer=OPT, host_memory=need - 1)
        compile(tiny_gpt(), too_small, **example("gpt", *tokens()))


def test_chunks_forecast_kept_on_the_compute_tier_leave_the_host_need_and_are_checked_again(
    monkeypatch,
):
    """HybridAdam's device half gives the host homes of the chunks it keeps back: compile
    counts the ones the access plan forecasts, and the first step, before it makes the
    moments, checks the budget again with the ones it kept: a step that kept fewer than the
    budget was granted for stops there, by name."""
    budget = activation_budget(tiny_gpt, 2.0, **example("gpt", *tokens()))
    plan = Plan(precision="bf16", device_memory=budget, optimizer=OPT)
    engine = compile(tiny_gpt(), plan, **example("gpt", *tokens()))
    chunk_plan = engine.program.decisions.chunk_plan
    forecast = placement.forecast_kept(plan, chunk_plan)
    assert forecast
    with_forecast = sum(placement.host_need(plan, chunk_plan))
    assert with_forecast < sum(placement.host_need(plan, chunk_plan, kept=[]))
    assert f"(but the {len(forecast)} chunks kept on the compute tier)" in engine.report()
    engine(*tokens()).backward()
    engine.step()
    assert len(engine.optimizer.kept) == len(forecast)  # the traced step agreed
    assert placement.check_host_budget(plan, chunk_plan, kept=engine.optimizer.kept) <= (
        with_forecast
    )
    granted = plan.replace(host_memory=with_forecast)  # fits with the forecast only
    engine = compile(tiny_gpt(), granted, **example("gpt", *tokens()))
    monkeypatch.setattr(engine.chunks.step_chunks, "margin", lambda ratio: 0)  # keeps none
    engine(*tokens()).backward()
    with pytest.raises(
        HostMemoryError,
        match=f"HybridAdam kept 0 chunks on the compute tier at the first step, where compile "
        f"forecast {len(forecast)}",
    ):
        engine.step()
    assert not engine.optimizer.state  # no moments were made
