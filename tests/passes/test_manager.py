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

    def add(name, **options):
        passes.register(FunctionPass(lambda program: program, name=name, **options))
        names.append(name)

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
