"""chunk_schedule: fetch/release placement, aliases, split fetches, the plan and its checks."""

import random
from types import SimpleNamespace

import pytest
import torch
from conftest import (
    activation_budget,
    assert_same_step,
    call,
    check_golden,
    example,
    hf_llama,
    tiny_gpt,
    tokens,
)
from torch import nn

from fxstar.dump import dump
from fxstar.engine import compile
from fxstar.passes.chunk_layout import budget_need
from fxstar.passes.chunk_schedule import BusyChunks, ChunkScheduleError, check_arena
from fxstar.plan import Plan
from fxstar.runtime import ops
from fxstar.runtime.layout import AccessPlan, ChunkLayout, ChunkSpec, ParamSlot


def test_golden_dump_of_the_rewritten_gpt():
    inputs = tokens()
    engine = compile(
        tiny_gpt(),
        Plan(device_memory=activation_budget(tiny_gpt, 0.4, example_inputs=inputs)),
        inputs,
    )
    check_golden("gpt_chunk_schedule.txt", dump(engine, "chunk_schedule"))


def test_tied_embedding_is_fetched_again_for_the_head():
    inputs = tokens()
    engine = compile(
        tiny_gpt(),
        Plan(device_memory=activation_budget(tiny_gpt, 0.4, example_inputs=inputs)),
        inputs,
    )
    graph = engine.program.graph_module.graph
    fetches = [n.args[1] for n in graph.nodes if n.target is ops.fetch]
    head_chunk = engine.chunks.layout.slots()["head.weight"].chunk
    assert fetches.count(head_chunk) == 2 and fetches[0] == head_chunk
    assert not [n for n in graph.nodes if n.op == "placeholder" and n.name.startswith("p_")]


class LateTranspose(nn.Module):
    """Reads `a.weight.t()` long after taking it: the release must wait for that read."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(16, 16) for _ in range(4))

    def forward(self, x):
        wt = self.a.weight.t()
        y = self.d(self.c(self.b(x)))
        return (y @ wt).square().mean()


def test_release_waits_for_the_last_alias_use():
    torch.manual_seed(0)
    eager = LateTranspose()
    model = LateTranspose()
    model.load_state_dict(eager.state_dict())
    x = torch.randn(4, 16)
    plan = Plan(
        device_memory=activation_budget(LateTranspose, 0.6, example_inputs=(x,)),
        chunk_size=16 * 16 + 16,
    )
    engine = compile(model, plan, (x,))
    nodes = list(engine.program.graph_module.graph.nodes)
    chunk = engine.chunks.layout.slots()["a.weight"].chunk
    release = next(i for i, n in enumerate(nodes) if n.target is ops.release and n.args[1] == chunk)
    matmul = next(i for i, n in enumerate(nodes) if "matmul" in n.name or n.name.startswith("mm"))
    assert release > matmul
    engine.chunks.checking = True
    for _ in range(3):
        expected = eager(x)
        expected.backward()
        loss = engine(x)
        loss.backward()
        assert torch.equal(loss, expected)
        for p, q in zip(eager.parameters(), engine.parameters(), strict=True):
            assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)
            p.grad = q.grad = None
    assert engine.chunks.stats.evictions > 0


def test_plan_lists_forward_fetches_then_backward_unpacks():
    inputs = tokens()
    engine = compile(
        tiny_gpt(),
        Plan(device_memory=activation_budget(tiny_gpt, 0.4, example_inputs=inputs)),
        inputs,
    )
    plan = engine.program.decisions.chunk_plan.access
    forward = plan.forward_len
    assert plan.phases == ["forward"] * forward + ["backward"] * (len(plan) - forward)
    assert max(plan.nonmodel_bytes) == plan.nonmodel_bytes[forward]  # the turn is the peak
    engine(*inputs).backward()
    assert engine.chunks._recorded == list(zip(plan.chunks, plan.phases, strict=True))


def test_a_moment_that_cannot_fit_stops_the_compile_with_numbers():
    inputs = tokens()
    budget = activation_budget(tiny_gpt, 0.4, example_inputs=inputs)
    # chunks so small that layer norms straddle them; a static share of about one chunk
    plan = Plan(device_memory=budget, chunk_size=4096, static_partition=True,
                warmup_gpu_chunk_mem_ratio=0.05)  # fmt: skip
    with pytest.raises(ChunkScheduleError, match=r"needs \d+ chunks of .* at once"):
        compile(tiny_gpt(), plan, inputs)


def test_static_partition_keeps_chunks_to_the_warmup_share():
    inputs = tokens()
    budget = activation_budget(tiny_gpt, 1.0, example_inputs=inputs)
    plan = Plan(device_memory=budget, static_partition=True, warmup_gpu_chunk_mem_ratio=0.5)
    engine = compile(tiny_gpt(), plan, inputs)
    engine.chunks.checking = True
    engine(*inputs).backward()
    assert engine.chunks.share(0) == int(0.5 * budget)
    assert engine.chunks.arena.stats()["peak_in_use"] <= int(0.5 * budget)


def test_plan_verify_checks_the_chunked_stage_bitwise():
    inputs = tokens()
    plan = Plan(device_memory=activation_budget(tiny_gpt, 0.4, example_inputs=inputs), verify=True)
    engine = compile(tiny_gpt(), plan, inputs)  # raises VerifyError if any stage differs
    assert engine.pass_manager.names[-1] == "chunk_schedule"


def test_an_edited_plan_is_honoured_and_refining_makes_a_new_stage():
    """The ChunkPlan is the runtime's only source: a smaller static share edited between
    compile and run is what the run keeps to (more evictions, the same gradients), and the
    first traced step refines into a new plan and stage, never rewriting the compiled one."""
    import copy

    from fxstar.engine import REFINED_STAGE
    from fxstar.runtime.layout import ChunkPlan

    inputs = tokens()
    budget = activation_budget(tiny_gpt, 1.0, example_inputs=inputs)
    runs = {}
    for share in (None, "edited"):
        eager, model = tiny_gpt(), tiny_gpt()
        engine = compile(model, Plan(device_memory=budget), inputs)
        compiled = engine.program.decisions.chunk_plan
        assert isinstance(compiled, ChunkPlan) and compiled.budget == budget
        if share:
            compiled.static_share = 2 * engine.chunks.layout.chunk_bytes
        before = copy.deepcopy(compiled)
        engine.chunks.checking = True  # every access: resident bytes within the share
        for step in range(3):
            assert_same_step("gpt", eager, engine, step)
            engine.zero_grad()
            eager.zero_grad()
        refined = engine.program.decisions.chunk_plan
        assert refined is not compiled and refined.observed is not None
        assert refined.static_share == compiled.static_share
        assert compiled == before  # the compiled decision is as it was
        assert engine.program.decisions.chunk_observed is refined.observed
        assert [s.name for s in engine.program.stages][-1] == REFINED_STAGE
        assert "refined from a traced step" in engine.report()
        runs[share] = engine.chunks.stats.evictions
    assert runs["edited"] > runs[None]


def test_busy_chunks_counts_other_chunks_read_in_between_as_the_definition():
    """BusyChunks skips runs of one chunk's reads; against counting every other chunk with a
    read strictly inside the stretch, on random reads with repeats and shared positions."""
    rng = random.Random(0)
    for _ in range(200):
        reads = [(rng.randrange(40), rng.randrange(5)) for _ in range(rng.randrange(1, 30))]
        busy = BusyChunks(list(reads))
        for _ in range(20):
            chunk, a = rng.randrange(5), rng.randrange(-1, 41)
            b = rng.randrange(a, 42)
            others = {c for p, c in reads if a < p < b and c != chunk}
            for limit in (1, 2, 3):
                assert busy.between(chunk, a, b, limit) == min(len(others), limit)


def gpt_without_biases(seed: int = 0):
    """The example GPT without biases: an attention key bias's true gradient is zero, and the
    rounding noise autograd gives it makes Adam steps of +-lr that say nothing of the engine."""
    from fxstar.models.gpt import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32,
                         dropout=0.1, bias=False))  # fmt: skip


@pytest.mark.parametrize(("kind", "factory"), [("gpt", gpt_without_biases), ("llama", hf_llama)])
def test_device_memory_auto_gives_a_longer_batch_the_budget_it_needs(kind, factory):
    """'auto' settles on the least budget of the first input (8 tokens); a longer batch (16
    tokens, a capture of its own) gets the least budget it needs beside what HybridAdam keeps,
    in the engine's arena. Both shapes, alternately, step like eager with torch's AdamW: loss
    and gradients (bitwise before the first update, within the kernels' rounding after) and
    the updated parameters."""
    eager, model = factory(), factory()
    plan = Plan(device_memory="auto", optimizer={"type": "adamw", "lr": 1e-3})
    engine = compile(model, plan, **example(kind, *tokens(seq=8)))
    engine.chunks.checking = True
    reference = torch.optim.AdamW(eager.parameters(), lr=1e-3, weight_decay=0.0)
    for group in engine.optimizer.param_groups:  # no decay anywhere, as eager's
        group["weight_decay"] = 0.0
    for step, seq in enumerate([8, 16, 8, 16]):
        ids, targets = tokens(seed=step, seq=seq)
        if step == 1:  # compiled after the first step chose what HybridAdam keeps
            inputs = (
                ((ids, targets), {})
                if kind == "gpt"
                else ((), {"input_ids": ids, "labels": targets})
            )
            later = engine.prepare(*inputs[0], **inputs[1]).decisions.chunk_plan
            first = engine.program.decisions.chunk_plan
            need = budget_need(engine.program, later.access, later.layout).device_memory
            assert first.budget == engine.engine_decisions.auto_budget < need
            assert later.budget == need + engine.engine_decisions.kept_bytes
            assert later.arena_capacity == first.arena_capacity == engine.chunks.planned_capacity
        torch.manual_seed(step)
        expected = call(kind, eager, ids, targets)
        expected.backward()
        torch.manual_seed(step)
        loss = call(kind, engine, ids, targets)
        loss.backward()
        exact = {"rtol": 0, "atol": 0} if step == 0 else {"rtol": 1e-5, "atol": 1e-7}
        torch.testing.assert_close(loss, expected, **exact)
        for (name, p), (_, q) in zip(eager.named_parameters(), engine.named_parameters()):
            torch.testing.assert_close(q.grad, p.grad, **exact, msg=f"{step} {name}")
        reference.step()
        reference.zero_grad()
        engine.step()
    for (name, p), (_, q) in zip(eager.named_parameters(), engine.named_parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)


def test_a_later_auto_capture_counts_the_bytes_hybrid_adam_keeps(monkeypatch):
    engine = compile(gpt_without_biases(), Plan(device_memory="auto"), tokens(seq=8))
    monkeypatch.setattr(engine.chunks, "kept_bytes", lambda: 12_345)
    later = engine.prepare(*tokens(seq=16)).decisions.chunk_plan
    need = budget_need(engine.program, later.access, later.layout).device_memory
    assert engine.engine_decisions.kept_bytes == 12_345 and later.budget == need + 12_345


def arena_case(device: str):
    """A program stand-in on `device`, and a layout of two 256-byte chunks."""
    specs = [ChunkSpec(i, [ParamSlot(f"p{i}", (f"p{i}",), i, 0, (8, 8), True)], 64)
             for i in range(2)]  # fmt: skip
    program = SimpleNamespace(plan=Plan(device_memory="auto"),
                              compute_device=lambda: torch.device(device))  # fmt: skip
    return program, ChunkLayout(64, torch.float32, specs)


def test_a_later_capture_that_outgrows_the_engines_arena_says_so():
    program, layout = arena_case("cpu")
    both = AccessPlan([0, 1], ["forward"] * 2, [100, 100], [1, 2])
    check_arena(program, both, layout, budget=10_000, arena=512)  # two chunks fit
    with pytest.raises(ChunkScheduleError, match="more than the engine's arena") as error:
        check_arena(program, both, layout, budget=10_000, arena=511)
    assert "access 1 (forward, chunk 1)" in str(error.value)
    assert "largest input first" in str(error.value) and "'auto' does" not in str(error.value)
    # a card: chunk blocks share its allocator with activations (arena.PooledBlocks), so a
    # later capture's activations are held to each moment's share (check_budget), not here
    program, layout = arena_case("cuda")
    check_arena(program, both, layout, budget=512, arena=512)
    with pytest.raises(ChunkScheduleError, match="more than the engine's arena"):
        check_arena(program, both, layout, budget=10_000, arena=511)
