"""checkpoint_regions + checkpoint: regions found from the graph, bitwise parity with eager."""

import pytest
import torch
import torch.nn.functional as F
from conftest import activation_budget, call, example, hf_gpt2, hf_llama, tiny_gpt, tokens
from torch import nn

import fxstar
from fxstar.capture import capture
from fxstar.dump import diff, dump, to_dot
from fxstar.engine import compile
from fxstar.models.gpt import GPT, GPTConfig
from fxstar.passes.activation_checkpoint import REGION_KEY, region_calls
from fxstar.passes.checkpoint_regions import find_regions
from fxstar.passes.chunk_layout import nonmodel_peak
from fxstar.passes.shape_memory import ShapeMemory
from fxstar.plan import Plan, PlanError
from fxstar.testing.live_bytes import step_peak


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
    decision = engine.program.decisions.checkpoint_regions
    assert [r.module for r in decision.chosen] == [f"h.{i}.mlp" for i in range(4)]
    engine = compile(gpt(), Plan(checkpoint="blocks", checkpoint_every=2, verify=True), args)
    decision = engine.program.decisions.checkpoint_regions
    assert [r.module for r in decision.chosen] == ["h.0", "h.2"]
    assert "every 2" in dump(engine)


def test_saved_bytes_of_blocks_are_at_least_4x_smaller():
    args, _ = inputs(gpt)
    plain = compile(gpt(), Plan(passes=["shape_memory"]), args).program.decisions.shape_memory
    engine = compile(gpt(), Plan(checkpoint="blocks"), args)
    ShapeMemory()(engine.program)  # measures the rewritten graph's run: only inputs are saved
    after = engine.program.decisions.shape_memory
    for block in (f"h.{i}" for i in range(4)):
        assert after.blocks[block].saved_bytes * 4 <= plain.blocks[block].saved_bytes


def test_dump_shows_regions_and_their_nodes():
    args, _ = inputs(tiny_gpt)
    engine = compile(tiny_gpt(), Plan(checkpoint="blocks"), args)
    text = dump(engine)
    assert "h_0 = recompute.run_region(checkpoint_0, dropout, p_h_0_ln_1_weight" in text
    assert "\n        layer_norm = aten.layer_norm(dropout, [32]" in text  # the body, indented
    assert "region=checkpoint_0(h.0, " in dump(engine, "checkpoint_regions")
    changed = diff(engine, "capture", "activation_checkpoint", color=False)
    assert "+    h_1 = recompute.run_region(checkpoint_1, h_0" in changed
    dot = to_dot(engine)
    assert '"h_1" -> "output"' not in dot and '"cross_entropy_loss" -> "output"' in dot
    assert "activation checkpoint: blocks: 2 of 2 regions" in engine.report()


def test_auto_chooses_the_fewest_regions_that_fit():
    args, _ = inputs(gpt)
    program = compile(gpt(), Plan(passes=["shape_memory"]), args).program
    report = program.decisions.shape_memory
    plain = report.saved_bytes + report.largest_backward  # the peak at the backward's start
    chosen = {}
    for share in (1.0, 0.8, 0.6):
        budget = int(plain * share)
        engine = compile(gpt(), Plan(checkpoint="auto", activation_memory=budget), args)
        decision = engine.program.decisions.checkpoint_regions
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
    saved = compile(
        gpt(), Plan(passes=["shape_memory"]), args
    ).program.decisions.shape_memory.saved_bytes
    found = None
    for share in (0.97, 0.94, 0.91, 0.88, 0.85, 0.82):
        budget = int(saved * share)
        engine = compile(gpt(), Plan(checkpoint="auto", activation_memory=budget), args)
        decision = engine.program.decisions.checkpoint_regions
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
        estimate = engine.program.decisions.checkpoint_regions.estimate
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
    assert engine.program.decisions.checkpoint_regions.estimate == pytest.approx(measured, rel=0.01)
    assert 0.9 * budget <= measured <= budget


class GatedBlock(nn.Module):
    """A block with a statistic taken under torch.no_grad() in its middle: export makes it a
    higher-order op inside the block's region, run again when the region recomputes."""

    def __init__(self, width: int):
        super().__init__()
        self.ln, self.fc, self.drop = nn.LayerNorm(width), nn.Linear(width, width), nn.Dropout(0.1)

    def forward(self, x):
        h = self.ln(x)
        with torch.no_grad():
            gate = torch.sigmoid(h.mean(-1, keepdim=True))
        return x + self.drop(torch.relu(self.fc(h))) * gate


class FrozenTeacher(nn.Module):
    """h.0 and h.1 are a frozen teacher run under torch.no_grad() (its output read back in h.1's
    module stack, so it looks like a block); h.2 and h.3 a student trained on its features and
    against them."""

    def __init__(self, width: int = 16, classes: int = 4):
        super().__init__()
        self.h = nn.ModuleList(GatedBlock(width) for _ in range(4))
        self.head = nn.Linear(width, classes)
        self.h[:2].requires_grad_(False)

    def forward(self, x, y):
        with torch.no_grad():
            teacher = x
            for block in self.h[:2]:
                teacher = block(teacher)
        student = teacher
        for block in self.h[2:]:
            student = block(student)
        loss = F.cross_entropy(self.head(student).flatten(0, 1), y.flatten())
        return loss + F.mse_loss(student, teacher)


def frozen_teacher() -> FrozenTeacher:
    torch.manual_seed(0)
    return FrozenTeacher()


def assert_trains_like_eager(make, plan: Plan, args: tuple = (), kwargs=None) -> fxstar.Engine:
    """Two SGD steps of `make()` compiled under `plan` and of `make()` in eager: the loss and
    every gradient (None for frozen parameters) bitwise equal, dropout drawn from one seed."""
    kwargs = kwargs or {}
    eager = make()
    engine = compile(make(), plan.replace(optimizer={"type": "sgd", "lr": 0.1}), args, kwargs)
    trained = [p for p in eager.parameters() if p.requires_grad]
    reference = torch.optim.SGD(trained, lr=0.1, momentum=0.9)  # sgd's momentum is betas[0]
    for step in range(2):
        losses = []
        for model in (eager, engine):
            torch.manual_seed(step)
            out = model(*args, **kwargs)
            losses.append(out if isinstance(out, torch.Tensor) else out.loss)
            losses[-1].backward()
        assert torch.equal(*losses), step
        for (name, p), (_, q) in zip(eager.named_parameters(), engine.named_parameters()):
            assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad), name
        reference.step()
        reference.zero_grad()
        engine.step()
    return engine


FROZEN_ARGS = (torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1)),
               torch.randint(0, 4, (2, 8), generator=torch.Generator().manual_seed(2)))  # fmt: skip
BLOCKS_2_3 = ["h.2", "h.3"]


@pytest.mark.parametrize(
    ("options", "regions"),
    [({"checkpoint": "blocks"}, BLOCKS_2_3),
     ({"checkpoint": "blocks", "offload_activations": True}, BLOCKS_2_3),
     ({"checkpoint": "auto", "activation_memory": 1}, BLOCKS_2_3),
     ({"checkpoint": ["h.*.fc"]}, ["h.2.fc", "h.3.fc"])],
    ids=["blocks", "offload", "auto", "patterns"],
)  # fmt: skip
@pytest.mark.filterwarnings("ignore:checkpoint='auto'.*cannot be met:UserWarning")  # 1 byte
def test_a_no_grad_block_in_forward_is_no_region_and_trains_like_eager(options, regions):
    engine = assert_trains_like_eager(frozen_teacher, Plan(**options), FROZEN_ARGS)
    calls = region_calls(engine.program.graph_module)
    assert [region.meta[REGION_KEY] for _, region in calls] == regions
    if options["checkpoint"] == "blocks":  # the no_grad op inside each block is inside its region
        assert "wrap_with_set_grad_enabled" in calls[0][1].code


def vit() -> nn.Module:
    """A transformers ViT whose blocks call one dropout module twice, around their MLP."""
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        image_size=16, patch_size=4, num_labels=3, hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.ViTForImageClassification(config)


def test_auto_refines_past_a_child_module_that_cannot_be_a_region():
    g = torch.Generator().manual_seed(1)
    images = {"pixel_values": torch.randn(2, 3, 16, 16, generator=g),
              "labels": torch.randint(0, 3, (2,), generator=g)}  # fmt: skip
    graph = capture(vit(), (), images).graph_module.graph
    with pytest.raises(ValueError, match="interleave"):  # 'dropout' spans 'mlp'
        find_regions(graph, ("vit.layers.0.*",))
    children = [r.module for r in find_regions(graph, ("vit.layers.0.*",), skip_conflicts=True)]
    assert "vit.layers.0.mlp" in children and "vit.layers.0.dropout" not in children
    program = compile(vit(), Plan(passes=["shape_memory"]), example_kwargs=images).program
    budget = int(program.decisions.shape_memory.saved_bytes * 0.9)  # part of one block is enough
    engine = assert_trains_like_eager(vit, Plan(checkpoint="auto", activation_memory=budget),
                                      kwargs=images)  # fmt: skip
    chosen = [r.module for r in engine.program.decisions.checkpoint_regions.chosen]
    assert len(chosen) == 1 and chosen[0].startswith("vit.layers.0.")
    engine = assert_trains_like_eager(vit, Plan(checkpoint="blocks"), kwargs=images)
    assert len(region_calls(engine.program.graph_module)) == 2


def test_a_no_grad_block_under_the_chunk_engine_trains_like_eager():
    budget = activation_budget(frozen_teacher, 0.5, example_inputs=FROZEN_ARGS)
    plan = Plan(checkpoint="blocks", offload_activations=True, device_memory=budget)
    engine = assert_trains_like_eager(frozen_teacher, plan, FROZEN_ARGS)
    gm = engine.program.graph_module
    teacher = [n for n in gm.graph.nodes if "wrap_with_set_grad_enabled" in str(n.target)]
    for node in teacher:  # no regions: their chunks are fetched outside them
        assert "fetch" not in getattr(gm, node.args[1].target).code
    assert teacher and "fetch" in gm.code


class AutocastBlock(nn.Module):
    """A block that starts with a part under torch.autocast: export makes it a higher-order op
    before the block's first node of its own; the op's results land in the block."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = self.a(x)
        return x + self.b(x) * low.float()


class AutocastStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.h = nn.ModuleList(AutocastBlock() for _ in range(3))

    def forward(self, x):
        for block in self.h:
            x = block(x)
        return x.pow(2).mean()


def autocast_stack() -> nn.Module:
    torch.manual_seed(0)
    return AutocastStack()


def test_an_autocast_block_is_checkpointed_with_the_block_it_starts():
    engine = assert_trains_like_eager(autocast_stack, Plan(checkpoint="blocks"), FROZEN_ARGS[:1])
    calls = region_calls(engine.program.graph_module)
    assert [region.meta[REGION_KEY] for _, region in calls] == ["h.0", "h.1", "h.2"]
    assert all("wrap_with_autocast" in region.code for _, region in calls)


def test_auto_warns_when_its_budget_cannot_be_met():
    """Said only in the decision's summary before: a user never saw it."""
    from fxstar.engine import compile

    with pytest.warns(UserWarning, match=r"activation_memory 1KiB cannot be met"):
        compile(tiny_gpt(), Plan(checkpoint="auto", activation_memory="1KiB"),
                example_inputs=tokens())  # fmt: skip


class Counting(nn.Module):
    """Writes buffers in place as models do: BatchNorm (its kernel updates the running
    statistics without saying so in its schema), a counter, a write through a view, and a
    frozen BatchNorm run under torch.no_grad() (a higher-order op)."""

    def __init__(self, width: int = 4):
        super().__init__()
        self.bn, self.frozen = nn.BatchNorm1d(width), nn.BatchNorm1d(width, affine=False)
        self.fc = nn.Linear(width, width)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("seen", torch.zeros(2))

    def forward(self, x, decay):
        self.count += 1
        self.seen[1:].add_(1)
        with torch.no_grad():
            x = x + self.frozen(x)
        return self.bn(self.fc(x)) * decay


class CountingStack(nn.Module):
    """Two Counting blocks reading `decay`, which the model updates after them."""

    def __init__(self):
        super().__init__()
        self.h = nn.ModuleList(Counting() for _ in range(2))
        self.register_buffer("decay", torch.ones(()))

    def forward(self, x):
        for block in self.h:
            x = block(x, self.decay)
        self.decay.mul_(0.9)
        return x.square().mean()


def counting_stack(train: bool = True) -> CountingStack:
    torch.manual_seed(0)
    return CountingStack().train(train)


COUNTING_X = torch.randn(6, 4, generator=torch.Generator().manual_seed(3))
COUNTING_WRITES = {"h.0." + n for n in ("count", "seen", "frozen.running_mean",
                                        "frozen.running_var", "frozen.num_batches_tracked",
                                        "bn.running_mean", "bn.running_var",
                                        "bn.num_batches_tracked")}  # fmt: skip


def test_regions_record_the_buffers_they_write_in_place():
    program = capture(counting_stack(), (COUNTING_X,))
    fed = program.placeholder_kinds()
    regions = find_regions(program.graph_module.graph)
    assert [r.module for r in regions] == ["h.0", "h.1"]
    assert {fed[n].target for n in regions[0].writes} == COUNTING_WRITES
    # `decay` is only read in the region, but written after it: recomputed from a copy too
    assert {fed[n].target for n in regions[0].copied} == COUNTING_WRITES | {"decay"}
    assert all(r.writes for r in regions)


def test_regions_in_eval_mode_write_no_running_statistics():
    program = capture(counting_stack(train=False), (COUNTING_X,))
    fed = program.placeholder_kinds()
    regions = find_regions(program.graph_module.graph)
    assert {fed[n].target for n in regions[0].writes} == {"h.0.count", "h.0.seen"}


def test_the_dump_names_the_buffers_a_region_writes():
    engine = compile(counting_stack(), Plan(checkpoint="blocks"), (COUNTING_X,))
    call = dump(engine).split("h_1 = recompute.run_region(")[1].splitlines()[0]
    assert "writes=h.1.count, h.1.seen, h.1.frozen.num_batches_tracked" in call
    summary = engine.program.decisions.checkpoint_regions.summary()
    assert summary.endswith("16 tensors written in place (recomputed on copies)")
