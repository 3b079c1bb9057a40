import torch
from conftest import tiny_gpt, tokens

from fxstar.capture import capture
from fxstar.dump import dump
from fxstar.passes import PassManager
from fxstar.passes.shape_memory import META_KEY, MemoryReport, NodeMemory


def _run():
    program = capture(tiny_gpt(), tokens())
    return PassManager(["shape_memory"]).run(program)


def test_per_node_output_and_saved_bytes():
    program = _run()
    nodes = {n.name: n for n in program.graph_module.graph.nodes}
    linear = nodes["linear"].meta[META_KEY]
    assert isinstance(linear, NodeMemory)
    assert linear.out_bytes == 2 * 16 * 96 * 4
    assert linear.saved_bytes == 2 * 16 * 32 * 4  # its input; the weight counts apart
    assert linear.saved_param_bytes > 0
    assert nodes["gelu"].meta[META_KEY].saved_bytes == 2 * 16 * 128 * 4
    assert nodes["linear"].meta["fxstar_notes"]["out"] == "12KiB"
    assert "out=12KiB saved=4KiB" in dump(program)


def test_totals_and_blocks():
    program = _run()
    report = program.decisions.shape_memory
    assert isinstance(report, MemoryReport)
    mems = [n.meta[META_KEY] for n in program.graph_module.graph.nodes if META_KEY in n.meta]
    assert report.out_bytes == sum(m.out_bytes for m in mems)
    assert report.saved_bytes == sum(b.saved_bytes for b in report.blocks.values())
    assert {"h.0", "h.1", "wte", "head"} <= set(report.blocks)
    assert report.blocks["h.0"].saved_bytes == report.blocks["h.1"].saved_bytes
    assert "total" in report.format()


def test_measuring_leaves_rng_and_model_untouched():
    program = capture(tiny_gpt(), tokens())
    state = torch.random.get_rng_state()
    PassManager(["shape_memory"]).run(program)
    assert torch.equal(state, torch.random.get_rng_state())
    assert all(p.grad is None for p in program.model.parameters())


def test_backward_bytes_count_every_gradient_one_op_holds():
    """cross_entropy saves its log-softmax inside: its backward holds that gradient and the
    logits' at once; a linear's holds its output's and its input's gradient."""
    program = _run()
    nodes = {n.name: n.meta[META_KEY] for n in program.graph_module.graph.nodes
             if META_KEY in n.meta}  # fmt: skip
    logits = 2 * 16 * 64 * 4  # batch 2, sequence 16, vocabulary 64, fp32
    assert nodes["cross_entropy_loss"].backward_bytes == 2 * logits + 4  # + the loss' own
    linear = nodes["linear"]
    assert linear.backward_bytes == linear.out_bytes + 2 * 16 * 32 * 4
    assert program.decisions.shape_memory.largest_backward == max(
        m.backward_bytes for m in nodes.values()
    )


def test_backward_peak_walks_kept_bytes_back_with_recomputation():
    from fxstar.passes.shape_memory import BackwardStep, backward_peak

    steps = [BackwardStep(10, 5), BackwardStep(20, 1), BackwardStep(0, 30)]
    assert backward_peak(steps) == 30 + 30  # the last node's gradient, all kept
    region = [BackwardStep(4, 2, frees=10), BackwardStep(0, 3, back=16, frees=10)]
    assert backward_peak([BackwardStep(1, 0), *region]) == 1 + 4 + 16 + 3


class CountingNorm(torch.nn.Module):
    """BatchNorm (running statistics updated in forward) and a counter bumped in forward."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.head = torch.nn.Linear(8, 1)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x, y):
        self.calls.add_(1)
        return (self.head(torch.relu(self.norm(self.lin(x)))) - y).square().mean()


def test_measuring_leaves_every_buffer_and_parameter_as_it_was():
    """The training IR updates buffers in place; the measurement (a forward on fake tensors,
    on real ones where fake tensors cannot go) must write none of the model's."""
    from fxstar.engine import compile
    from fxstar.plan import Plan

    torch.manual_seed(0)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    plans = [
        Plan(passes=["shape_memory"]),
        Plan(device_memory="1MiB"),
        Plan(checkpoint="auto", activation_memory="1KiB"),
        Plan(passes=["shape_memory"], verify=True),
    ]
    for plan in plans:
        model = CountingNorm()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        compile(model, plan, example_inputs=(x, y))
        for key, value in model.state_dict().items():
            assert torch.equal(value, before[key]), (plan.describe(), key)
    model = CountingNorm()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    program = capture(model, (x, y), method="symbolic_trace")
    PassManager(["shape_memory"]).run(program)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), ("symbolic_trace", key)


def _saved_params(program) -> dict[str, tuple[str, ...]]:
    return {n.name: m.saved_params for n in program.graph_module.graph.nodes
            if (m := n.meta.get(META_KEY)) is not None and m.saved_params}  # fmt: skip


def test_a_later_capture_names_the_parameters_each_node_saves():
    """Once the chunks hold the parameters, every one is a view of one host storage: a saved
    view is named by where in it it lies, node for node as the first capture names it (the
    chunk plan's backward fetches, which data-parallel ranks must derive alike)."""
    from fxstar.engine import compile
    from fxstar.plan import Plan

    engine = compile(tiny_gpt(dropout=0.0), Plan(chunk_size=4096, device_memory="auto"), tokens())
    engine(*tokens(seq=8)).backward()
    first, later = engine.programs.values()
    names = _saved_params(first)
    assert len(set(sum(names.values(), ()))) > 10  # every block's weights and norms
    assert _saved_params(later) == names
