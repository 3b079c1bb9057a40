"""checkpoint_regions + checkpoint: regions found from the graph, bitwise parity with eager."""

import pytest
import torch
from conftest import call, example, hf_gpt2, hf_llama, tiny_gpt, tokens

from fxstar.capture import capture
from fxstar.dump import diff, dump, to_dot
from fxstar.engine import compile
from fxstar.live_bytes import step_peak
from fxstar.models.gpt import GPT, GPTConfig
from fxstar.passes.checkpoint import region_calls
from fxstar.passes.checkpoint_regions import DECISION_KEY, find_regions
from fxstar.passes.chunk_layout import nonmodel_peak
from fxstar.passes.shape_memory import META_KEY, ShapeMemory
from fxstar.plan import Plan, PlanError


def gpt(layers: int = 4, dropout: float = 0.1) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=layers, n_head=2, n_embd=32,
                    dropout=dropout)  # fmt: skip
    return GPT(cfg)


def inputs(make):
    ids, targets = tokens()
    if make in (tiny_gpt, gpt):
        return (ids, targets), {}
    return (), {"input_ids": ids, "labels": targets}


MODELS = {"gpt": tiny_gpt, "gpt2": hf_gpt2, "llama": hf_llama}
BLOCKS = {"gpt": "h", "gpt2": "transformer.h", "llama": "model.layers"}


@pytest.mark.parametrize("kind", MODELS)
def test_repeated_blocks_are_found_without_naming_them(kind):
    model = MODELS[kind]()
    args, kwargs = inputs(MODELS[kind])
    regions = find_regions(capture(model, args, kwargs).graph_module.graph)
    assert [r.module for r in regions] == [f"{BLOCKS[kind]}.0", f"{BLOCKS[kind]}.1"]


@pytest.mark.parametrize("kind", MODELS)
def test_checkpoint_is_bitwise_equal_to_eager_with_dropout(kind):
    make = MODELS[kind]
    args, kwargs = inputs(make)
    # plan.verify checks loss and every gradient bitwise after each pass
    engine = compile(make(), Plan(checkpoint="blocks", verify=True, seed=0), args, kwargs)
    assert len(region_calls(engine.program.graph_module)) == 2
    # and the same by hand, on the model's own tensors, with dropout drawing masks
    eager = make()
    torch.manual_seed(5)
    out = eager(*args, **kwargs)
    (out if isinstance(out, torch.Tensor) else out.loss).backward()
    engine.model.zero_grad()
    torch.manual_seed(5)
    got = engine(*args, **kwargs)
    (got if isinstance(got, torch.Tensor) else got.loss).backward()
    for (name, p), q in zip(eager.named_parameters(), engine.model.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_patterns_and_every_k():
    args, kwargs = inputs(gpt)
    engine = compile(gpt(), Plan(checkpoint=["h.*.mlp"], verify=True, seed=0), args)
    decision = engine.program.meta[DECISION_KEY]
    assert [r.module for r in decision.chosen] == [f"h.{i}.mlp" for i in range(4)]
    engine = compile(gpt(), Plan(checkpoint="blocks", checkpoint_every=2, verify=True), args)
    decision = engine.program.meta[DECISION_KEY]
    assert [r.module for r in decision.chosen] == ["h.0", "h.2"]
    assert "every 2" in dump(engine)


def test_saved_bytes_of_blocks_are_at_least_4x_smaller():
    args, _ = inputs(gpt)
    plain = compile(gpt(), Plan(passes=["shape_memory"]), args).program.meta[META_KEY]
    engine = compile(gpt(), Plan(checkpoint="blocks"), args)
    ShapeMemory()(engine.program)  # measures the rewritten graph's run: only inputs are saved
    after = engine.program.meta[META_KEY]
    for block in (f"h.{i}" for i in range(4)):
        assert after.blocks[block].saved_bytes * 4 <= plain.blocks[block].saved_bytes


def test_dump_shows_regions_and_their_nodes():
    args, _ = inputs(tiny_gpt)
    engine = compile(tiny_gpt(), Plan(checkpoint="blocks"), args)
    text = dump(engine)
    assert "h_0 = checkpoint.run_region(checkpoint_0, dropout, p_h_0_ln_1_weight" in text
    assert "\n        layer_norm = aten.layer_norm(dropout, [32]" in text  # the body, indented
    assert "region=checkpoint_0(h.0, " in dump(engine, "checkpoint_regions")
    changed = diff(engine, "capture", "checkpoint", color=False)
    assert "+    h_1 = checkpoint.run_region(checkpoint_1, h_0" in changed
    dot = to_dot(engine)
    assert '"h_1" -> "output"' not in dot and '"cross_entropy_loss" -> "output"' in dot
    assert "activation checkpoint: blocks: 2 of 2 regions" in engine.report()


def test_auto_chooses_the_fewest_regions_that_fit():
    args, _ = inputs(gpt)
    program = compile(gpt(), Plan(passes=["shape_memory"]), args).program
    report = program.meta[META_KEY]
    plain = report.saved_bytes + report.largest_backward  # the peak at the backward's start
    chosen = {}
    for share in (1.0, 0.8, 0.6):
        budget = int(plain * share)
        engine = compile(gpt(), Plan(checkpoint="auto", activation_memory=budget), args)
        decision = engine.program.meta[DECISION_KEY]
        assert decision.mode == "auto" and decision.budget == budget
        assert decision.estimate <= budget
        assert len(region_calls(engine.program.graph_module)) == len(decision.chosen)
        chosen[share] = [r.module for r in decision.chosen]
    assert chosen[1.0] == [] and 0 < len(chosen[0.8]) < len(chosen[0.6]) <= 4
    assert chosen[0.8] == [f"h.{i}" for i in range(len(chosen[0.8]))]  # earliest first
    assert f"auto: {len(chosen[0.6])} of 4 regions" in dump(engine)
    compile(gpt(), Plan(checkpoint="auto", activation_memory=budget, verify=True), args)
    with pytest.raises(PlanError, match="activation_memory"):
        compile(gpt(), Plan(checkpoint="auto"), args)


def test_checkpointed_engine_trains_like_eager():
    args, _ = inputs(gpt)
    eager, model = gpt(), gpt()
    engine = compile(model, Plan(checkpoint="blocks", optimizer={"type": "sgd", "lr": 0.1}))
    reference = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        ids, targets = tokens(seed=step)
        torch.manual_seed(step)
        expected = eager(ids, targets)
        expected.backward()
        reference.step()
        reference.zero_grad()
        torch.manual_seed(step)
        loss = engine(ids, targets)
        loss.backward()
        engine.step()
        assert torch.equal(loss, expected)
    for key, value in eager.state_dict().items():
        assert torch.equal(engine.state_dict()[key], value), key


def test_regions_run_plainly_without_grad():
    args, _ = inputs(tiny_gpt)
    engine = compile(tiny_gpt(dropout=0.0), Plan(checkpoint="blocks"), args)
    with torch.no_grad():
        assert torch.equal(engine(*args), engine(*args).detach())


def test_auto_checkpoints_part_of_the_last_block_when_that_is_enough():
    args, _ = inputs(gpt)
    saved = compile(gpt(), Plan(passes=["shape_memory"]), args).program.meta[META_KEY].saved_bytes
    found = None
    for share in (0.97, 0.94, 0.91, 0.88, 0.85, 0.82):
        budget = int(saved * share)
        engine = compile(gpt(), Plan(checkpoint="auto", activation_memory=budget), args)
        decision = engine.program.meta[DECISION_KEY]
        assert decision.estimate <= budget
        modules = [r.module for r in decision.chosen]
        if modules and modules[-1].count(".") == 2:  # a child of a block, e.g. 'h.0.mlp'
            found = budget
            break
    assert found is not None
    plan = Plan(checkpoint="auto", activation_memory=found, verify=True)  # bitwise vs eager
    compile(gpt(), plan, args)


# Small tensors autograd holds besides (masks, bias gradients in flight) are a few KiB: on the
# tiny test models that is a few percent, on a realistic width (below) nothing.
SMALL_TENSORS = 16 * 1024


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("checkpoint", [None, "blocks", "auto", "blocks+offload"])
def test_the_backward_peak_estimate_matches_a_measured_step(kind, checkpoint):
    """The estimate auto plans with is the peak a real step allocates (LiveBytes): saved
    activations, recomputation, what each gradient allocates at once, and (offload) only the
    inputs of the regions in use on the compute tier."""
    make = MODELS[kind]
    ids, targets = tokens()
    plain = compile(make(), Plan(passes=["shape_memory"]), **example(kind, ids, targets))
    estimate = nonmodel_peak(plain.program)
    budget = estimate * 3 // 4
    engine = plain
    if checkpoint is not None:
        offload = checkpoint.endswith("+offload")
        plan = Plan(checkpoint=checkpoint.removesuffix("+offload"), passes=["shape_memory"],
                    offload_activations=offload)  # fmt: skip
        plan = plan.replace(activation_memory=budget) if checkpoint == "auto" else plan
        engine = compile(make(), plan, **example(kind, ids, targets))
        estimate = engine.program.meta[DECISION_KEY].estimate
    measured = step_peak(lambda: call(kind, engine, ids, targets), engine.parameters(), ())
    assert estimate == pytest.approx(measured, rel=0.03, abs=SMALL_TENSORS)
    if checkpoint == "auto":
        assert measured <= budget + SMALL_TENSORS


def test_auto_lands_within_ten_percent_of_its_budget_at_a_realistic_width():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=2048, block_size=128, n_layer=4, n_head=4, n_embd=256, dropout=0)
    ids, targets = (torch.randint(0, 2048, (2, 128)) for _ in range(2))
    plain = compile(GPT(cfg), Plan(passes=["shape_memory"]), (ids, targets))
    assert nonmodel_peak(plain.program) == pytest.approx(
        step_peak(plain, plain.parameters(), (ids, targets)), rel=0.01
    )
    budget = nonmodel_peak(plain.program) // 2
    engine = compile(GPT(cfg), Plan(checkpoint="auto", activation_memory=budget), (ids, targets))
    measured = step_peak(engine, engine.parameters(), (ids, targets))
    assert engine.program.meta[DECISION_KEY].estimate == pytest.approx(measured, rel=0.01)
    assert 0.9 * budget <= measured <= budget
