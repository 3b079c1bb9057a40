"""offload_activations: region inputs on the host tier until backward, bitwise parity."""

import pytest
import torch
from conftest import hf_gpt2, hf_llama, inputs, tiny_gpt

from fxstar.dump import dump
from fxstar.engine import compile
from fxstar.models.gpt import GPT, GPTConfig
from fxstar.plan import Plan, PlanError
from fxstar.runtime.offload import ActivationOffload

MODELS = {"gpt": tiny_gpt, "gpt2": hf_gpt2, "llama": hf_llama}
PLAN = Plan(checkpoint="blocks", offload_activations=True, seed=0)


@pytest.mark.parametrize("kind", MODELS)
def test_offload_is_bitwise_equal_to_eager(kind):
    make = MODELS[kind]
    args, kwargs = inputs(make)
    engine = compile(make(), PLAN.replace(verify=True), args, kwargs)  # bitwise, every grad
    offload = engine.program.decisions.offload_activations
    assert isinstance(offload, ActivationOffload)
    assert offload.stats.to_host_bytes > 0
    assert offload.stats.to_device_bytes == offload.stats.to_host_bytes
    assert "= offload.offload_region(activation_offload, 1, checkpoint_1, " in dump(engine)


def test_at_most_two_regions_resident_in_backward():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=6, n_head=2, n_embd=32))
    args, _ = inputs(tiny_gpt)
    engine = compile(model, PLAN, args)
    offload = engine.program.decisions.offload_activations
    offload.reset_stats()
    engine(*args).backward()
    region_input = 2 * 16 * 32 * 4  # each block keeps its input x
    stats = offload.stats
    assert stats.to_host_bytes == 6 * region_input == stats.to_device_bytes
    assert stats.prefetched == 5  # every region but the last one recomputed
    assert stats.peak_resident_regions == 2
    assert stats.peak_resident_bytes <= 2 * region_input
    report = engine.report()
    assert "activation offload: 24KiB to host, 24KiB back" in report
    assert "peak resident in backward 8KiB in 2 region(s)" in report


def test_inputs_live_on_the_host_between_forward_and_backward():
    args, _ = inputs(tiny_gpt)
    engine = compile(tiny_gpt(), PLAN, args)
    offload = engine.program.decisions.offload_activations
    loss = engine(*args)
    handles = [h for hs in offload._regions.values() for h in hs]
    assert len(handles) == 2 and all(h.restored is None for h in handles)
    assert all(h.host.shape == (2, 16, 32) for h in handles)
    loss.backward()


def test_offload_without_checkpoint_is_a_clear_error():
    args, _ = inputs(tiny_gpt)
    with pytest.raises(PlanError, match="set plan.checkpoint"):
        compile(tiny_gpt(), Plan(offload_activations=True), args)
