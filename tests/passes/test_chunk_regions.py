"""The chunk engine with checkpointed regions: a region fetches its own chunks, again when it
recomputes in backward, and keeps them pinned until its gradients are done."""

import pytest
from conftest import assert_same_step, example, hf_gpt2, hf_llama, tiny_gpt, tokens

from fxstar.engine import compile
from fxstar.passes.activation_checkpoint import region_calls
from fxstar.plan import Plan
from fxstar.runtime import ops

FACTORIES = {"gpt": tiny_gpt, "gpt2": hf_gpt2, "llama": hf_llama}


def plan_for(kind, **options) -> Plan:
    """A share of 70% of the parameter bytes, held fixed (the static partition), so chunks are
    evicted and fetched back during backward."""
    ids, targets = tokens()
    param_bytes = compile(
        FACTORIES[kind](), Plan(), **example(kind, ids, targets)
    ).program.param_bytes
    return Plan(device_memory=param_bytes, static_partition=True, warmup_gpu_chunk_mem_ratio=0.7,
                checkpoint="blocks", **options)  # fmt: skip


@pytest.mark.parametrize("offload", [False, True], ids=["checkpoint", "checkpoint+offload"])
@pytest.mark.parametrize("kind", FACTORIES)
def test_regions_with_chunks_are_bitwise_equal_to_eager(kind, offload):
    eager, model = FACTORIES[kind](), FACTORIES[kind]()
    engine = compile(model, plan_for(kind, offload_activations=offload),
                     **example(kind, *tokens()))  # fmt: skip
    engine.chunks.checking = True
    for step in range(3):
        assert_same_step(kind, eager, engine, step)
        eager.zero_grad()
        engine.zero_grad()
    stats = engine.chunks.stats
    assert stats.evictions > 0 and stats.unexpected_accesses == 0


def test_fetches_live_inside_the_regions_and_recomputation_is_planned():
    engine = compile(tiny_gpt(), plan_for("gpt"), example_inputs=tokens())
    call_node, region = region_calls(engine.program.graph_module)[0]
    assert any(n.target is ops.fetch for n in region.graph.nodes)
    assert not any(getattr(a, "op", None) == "placeholder" for a in call_node.args)
    plan = engine.program.decisions.chunk_plan.access
    inside = [n.args[1] for n in region.graph.nodes if n.target is ops.fetch]
    backward = plan.chunks[plan.forward_len :]
    assert all(c in backward for c in inside)  # fetched again for the recomputation
    engine(*tokens()).backward()
    assert engine.chunks._recorded == list(zip(plan.chunks, plan.phases, strict=True))


def test_every_memory_pass_together_passes_verify():
    """checkpoint, offload, cpu_embedding, tiling and the chunk passes in one plan, each stage
    checked against the one before by plan.verify (tiling within its tolerance)."""
    tiles = {"in_splits": 2, "out_splits": 2, "min_size": 1024}
    plan = plan_for("gpt", offload_activations=True, cpu_embedding=True, tiled_linear=tiles)
    engine = compile(tiny_gpt(), plan.replace(verify=True), example_inputs=tokens())
    names = engine.pass_manager.names
    assert names.index("activation_checkpoint") < names.index("chunk_schedule")
    assert {"cpu_embedding", "tiled_linear", "offload_activations"} <= set(names)
    engine(*tokens()).backward()
    assert engine.step()
