"""Engines are freed when dropped, and at once by close(): no thread, arena or host chunk
outlives them (autograd hooks and the sampler thread hold the manager weakly)."""

import gc
import threading
import weakref

import pytest
import torch
from conftest import tiny_gpt, tokens

from fxstar.engine import compile
from fxstar.errors import EngineStateError
from fxstar.plan import Plan
from fxstar.runtime.arena import ArenaBuffer
from fxstar.runtime.chunks import ChunkManager


def live(kind: type) -> int:
    gc.collect()
    return sum(type(o) is kind for o in gc.get_objects())


def monitor_threads() -> int:
    return sum(t.name == "fxstar-mem-monitor" and t.is_alive() for t in threading.enumerate())


def plan() -> Plan:
    param_bytes = compile(tiny_gpt(), Plan(), example_inputs=tokens()).program.param_bytes
    return Plan(device_memory=param_bytes, static_partition=True, warmup_gpu_chunk_mem_ratio=0.7,
                checkpoint="blocks", offload_activations=True, async_mem_monitor=True,
                optimizer={"type": "adamw", "lr": 1e-3})  # fmt: skip


def test_ten_dropped_engines_are_freed():
    p = plan()
    managers, arenas, threads = live(ChunkManager), live(ArenaBuffer), monitor_threads()
    refs = []
    for seed in range(10):
        engine = compile(tiny_gpt(seed=seed), p, example_inputs=tokens())
        engine(*tokens()).backward()
        engine.step()
        refs.append((weakref.ref(engine), weakref.ref(engine.chunks)))
        del engine
    gc.collect()
    assert all(e() is None and m() is None for e, m in refs)
    assert live(ChunkManager) == managers and live(ArenaBuffer) == arenas
    for _ in range(100):  # the sampler threads end at their next tick
        if monitor_threads() == threads:
            break
        threading.Event().wait(0.01)
    assert monitor_threads() == threads


def test_close_releases_at_once_and_the_model_keeps_its_values():
    model = tiny_gpt()
    with compile(model, plan(), example_inputs=tokens()) as engine:
        engine(*tokens()).backward()
        engine.step()
        trained = {k: v.clone() for k, v in engine.state_dict().items()}
        manager = weakref.ref(engine.chunks)
    assert manager() is None or not manager().monitor.running
    for key, value in model.state_dict().items():
        assert torch.equal(value, trained[key]), key
    with pytest.raises(EngineStateError, match="closed"):
        engine(*tokens())
    again = compile(model, plan(), example_inputs=tokens())  # the model is free again
    eager = tiny_gpt()
    eager.load_state_dict(trained)
    torch.manual_seed(3)
    expected = eager(*tokens())
    torch.manual_seed(3)
    assert torch.equal(again(*tokens()), expected)
