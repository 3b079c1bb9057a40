import pytest
import torch
from conftest import tiny_gpt, tokens
from torch import nn

from fxstar import passes
from fxstar.capture import capture
from fxstar.dump import dump
from fxstar.errors import IRError, PassOrderError
from fxstar.passes import FunctionPass, Pass, PassError, PassManager
from fxstar.plan import PlanError


@pytest.fixture
def registry():
    """Register throwaway passes and remove them afterwards."""
    names = []

    def add(name, fn=lambda program: program, **options):
        names.append(name)
        passes.register(FunctionPass(fn, name=name, **options))

    yield add
    for name in names:
        passes.unregister(name)


def test_register_forms(registry):
    @passes.register
    class Mine(Pass):
        name = "t_mine"

        def __call__(self, program):
            return program

    @passes.register(name="t_fn", after=("t_mine",))
    def anything(program):
        return None

    try:
        assert isinstance(passes.get("t_mine"), Mine)
        assert passes.get("t_fn").after == ("t_mine",)
        assert "shape_memory" in passes.registered()
        with pytest.raises(ValueError, match="already registered"):
            passes.register(Mine)
        passes.register(Mine, replace=True)
    finally:
        passes.unregister("t_mine")
        passes.unregister("t_fn")


def test_order_follows_constraints_and_keeps_given_order(registry):
    registry("t_a")
    registry("t_b", after=("t_c",))
    registry("t_c")
    registry("t_d", before=("t_a",))
    assert PassManager(["t_a", "t_b", "t_c", "t_d"]).names == ["t_c", "t_b", "t_d", "t_a"]
    assert PassManager(["t_c", "t_a"]).names == ["t_c", "t_a"]


def test_requires_pulls_passes_in(registry):
    registry("t_base")
    registry("t_top", requires=("t_base",))
    assert PassManager(["t_top"]).names == ["t_base", "t_top"]


def test_cycles_unknown_names_and_duplicates_are_rejected(registry):
    registry("t_x", after=("t_y",))
    registry("t_y", after=("t_x",))
    with pytest.raises(PassOrderError, match="cycle: .*t_x.*t_y|cycle: .*t_y.*t_x"):
        PassManager(["t_x", "t_y"])
    with pytest.raises(PassOrderError, match="unknown pass name.*no_such_pass"):
        PassManager(["no_such_pass"])
    registry("t_needs", requires=("t_missing",))
    with pytest.raises(PassOrderError, match="t_needs.*t_missing"):
        PassManager(["t_needs"])
    with pytest.raises(PassOrderError, match="listed twice"):
        PassManager(["shape_memory", "shape_memory"])


def test_run_records_stages_and_calls_check(registry):
    registry("t_one")
    seen = []
    program = capture(tiny_gpt(), tokens())
    out = PassManager(["t_one", "shape_memory"]).run(
        program, check=lambda p, prog: seen.append(p.name)
    )
    assert [s.name for s in out.stages] == ["capture", "t_one", "shape_memory"]
    assert out.stages[2].after == ("capture", "t_one")
    assert seen == ["t_one", "shape_memory"]


def test_rewrite_passes_refuse_symbolic_trace_programs(registry):
    registry("t_rewrite")
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    program = capture(model, (torch.randn(2, 4),), method="symbolic_trace")
    with pytest.raises(IRError, match="t_rewrite.*export IR"):
        PassManager(["t_rewrite"]).run(program)
    assert PassManager(["shape_memory"]).run(program).stages[-1].name == "shape_memory"


def test_plan_options_enable_built_in_passes():
    class Seeded(Pass):
        name = "t_seeded"

        def enabled_by(self, plan):
            return plan.seed == 123

        def __call__(self, program):
            return program

    from fxstar.plan import Plan

    passes.register(Seeded)
    try:
        assert "t_seeded" not in passes.passes_for(Plan())
        assert passes.passes_for(Plan(seed=123, passes=["shape_memory"])) == [
            "shape_memory",
            "t_seeded",
        ]
        assert passes.passes_for(Plan(seed=123, passes=["t_seeded"])) == ["t_seeded"]
    finally:
        passes.unregister("t_seeded")


def test_a_crash_inside_a_pass_names_the_pass_and_the_node():
    def scale_linears(program):
        for node in program.graph_module.graph.nodes:
            if node.name == "linear":
                node.meta["scale"] = 1 / 0  # a bug, while looking at this node

    def refuse(program):
        raise PlanError("checkpoint: a message that explains itself")

    program = capture(tiny_gpt(), tokens())
    with pytest.raises(PassError) as info:
        PassManager([FunctionPass(scale_linears)]).run(program)
    error = info.value
    assert isinstance(error.__cause__, ZeroDivisionError)
    assert (error.pass_name, error.node, error.program) == ("scale_linears", "linear", program)
    message = str(error)
    assert message.startswith("pass 'scale_linears' failed: ZeroDivisionError: division by zero")
    assert "at node: linear (aten.linear @h.0.attn.c_attn)" in message
    assert "given: stage 'capture'" in message and "without 'scale_linears'" in message
    assert dump(error.program).startswith("# stage 0: capture")  # the graph the pass got
    with pytest.raises(PlanError, match="explains itself"):  # passes through unchanged
        PassManager([FunctionPass(refuse)]).run(program)


def test_phases_order_passes_before_constraints(registry):
    registry("t_late", phase="schedule")
    registry("t_early", phase="shard")
    registry("t_mid", phase="restructure")
    registry("t_mid2", phase="restructure", before=("t_mid",))
    assert PassManager(["t_late", "t_mid", "t_early", "t_mid2"]).names == [
        "t_early", "t_mid2", "t_mid", "t_late"
    ]  # fmt: skip
    assert passes.PHASES == ("shard", "analyse", "restructure", "place", "schedule")
    registry("t_against", phase="shard", after=("t_mid",))
    with pytest.raises(PassOrderError, match="'t_against' \\(phase shard\\).*after 't_mid'"):
        PassManager(["t_mid", "t_against"])
    registry("t_needs_later", phase="shard", requires=("t_late",))
    with pytest.raises(PassOrderError, match="'t_needs_later'.*requires 't_late'.*later"):
        PassManager(["t_needs_later"])
    with pytest.raises(ValueError, match="phase 'sometime' is not one of"):
        registry("t_bad_phase", phase="sometime")


def _gelu_to_relu(program):
    """A rewrite that leaves linting and recompiling to the manager."""
    for node in program.graph_module.graph.nodes:
        if node.target is torch.ops.aten.gelu.default:
            node.target = torch.ops.aten.relu.default
    return program


def test_a_stale_analysis_is_rerun_before_a_pass_that_requires_it_fresh(registry):
    seen = []
    registry("t_relu", phase="restructure", rewrites=True, fn=_gelu_to_relu)
    registry("t_reader", phase="place", requires_fresh=("shape_memory",),
             fn=lambda program: seen.append(program.decisions.shape_memory))  # fmt: skip
    registry("t_second", phase="place", requires_fresh=("shape_memory",), after=("t_reader",))
    program = capture(tiny_gpt(), tokens())
    out = PassManager(["shape_memory", "t_relu", "t_reader", "t_second"]).run(program)
    # measured in its phase, again after the rewrite, not again for t_second: still fresh
    assert [s.name for s in out.stages] == [
        "capture", "shape_memory", "t_relu", "shape_memory", "t_reader", "t_second"
    ]  # fmt: skip
    assert seen == [out.decisions.shape_memory]
    # the manager finalised the rewrite: the generated code runs relu, not gelu
    code = out.graph_module.code
    assert "aten.relu.default" in code and "aten.gelu" not in code
    assert passes.is_fresh(out, "shape_memory")
    # not asked for at all: the pass that needs it gets it
    program = capture(tiny_gpt(), tokens())
    names = [s.name for s in PassManager(["t_reader"]).run(program).stages]
    assert names == ["capture", "shape_memory", "t_reader"]


def test_built_in_passes_declare_phases_and_what_they_implement():
    declared = {name: (p.phase, p.rewrites) for name, p in passes.registered().items()}
    assert declared["shape_memory"] == ("analyse", False)
    assert declared["tp_sharding"] == ("shard", False)
    assert declared["tensor_parallel"] == ("shard", True)
    assert declared["checkpoint_regions"] == ("restructure", False)
    assert declared["activation_checkpoint"] == ("restructure", True)
    assert declared["chunk_layout"] == ("place", False)
    assert declared["chunk_schedule"] == ("schedule", True)
    assert "cpu_embedding" in passes.get("cpu_embedding").implements
    assert {"device_memory", "chunk_size"} <= set(passes.get("chunk_layout").implements)
    assert "device_memory" in passes.implemented_options()


def test_the_custom_pass_docs_group_nodes_by_block_through_nn_module_stack():
    """examples/custom_pass.py documents node.meta["nn_module_stack"] with the stack of the
    reference GPT's first linear, and groups its FLOPs per block by it: the documented stack is
    the real one, and each block's FLOPs are its own linears' (from the modules, apart)."""
    import ast
    import importlib.util
    import os
    import re
    import sys

    from fxstar.models.gpt import tiny

    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "custom_pass.py")
    spec = importlib.util.spec_from_file_location("example_custom_pass_stack", path)
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example  # its dataclass looks its module up
    spec.loader.exec_module(example)
    try:
        model, inputs = tiny()
        program = capture(model, inputs)
        linears = [n for n in program.graph_module.graph.nodes
                   if n.target is torch.ops.aten.linear.default]  # fmt: skip
        documented = re.search(r"\n    (\{'L__self__'.*?\})\n", example.__doc__, re.S).group(1)
        assert dict(linears[0].meta["nn_module_stack"]) == ast.literal_eval(documented)
        PassManager(["linear_flops"]).run(program)
        flops = program.decisions.custom["linear_flops"]
        tokens = inputs[0].numel()
        expected: dict[str, int] = {}
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                block = ".".join(name.split(".")[:2]) if name.startswith("h.") else name
                expected[block] = expected.get(block, 0) + 2 * tokens * module.weight.numel()
        assert flops.per_block == expected and flops.total == sum(expected.values())
        assert example.block_of(next(iter(program.graph_module.graph.nodes))) == "(root)"
    finally:
        passes.unregister("linear_flops")
        sys.modules.pop(spec.name, None)
