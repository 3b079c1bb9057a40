import sys

import pytest
import torch
from conftest import check_golden as _check_golden
from conftest import tiny_gpt, tokens

from fxstar.capture import capture
from fxstar.dump import diff, draw, dump, to_dot
from fxstar.engine import compile
from fxstar.passes import PassManager
from fxstar.plan import Plan


@pytest.fixture(scope="module")
def engine():
    model = tiny_gpt()
    return compile(model, Plan(passes=["shape_memory"]), example_inputs=tokens())


def test_golden_capture(engine):
    _check_golden("gpt_capture.txt", dump(engine, "capture"))


def test_golden_shape_memory(engine):
    _check_golden("gpt_shape_memory.txt", dump(engine, "shape_memory"))


def test_golden_diff(engine):
    _check_golden("gpt_diff.txt", diff(engine, "capture", "shape_memory", color=False))


def test_header_names_the_stage_and_what_came_before(engine):
    assert dump(engine).splitlines()[0] == "# stage 1: shape_memory (after capture)"
    assert dump(engine.program, 0).splitlines()[0] == "# stage 0: capture"
    assert "@h.0.attn.c_attn" in dump(engine, 0)


def test_noise_is_hidden_by_default():
    program = capture(tiny_gpt(), tokens())
    graph = program.graph_module.graph
    idx = next(n for n in graph.nodes if n.name == "idx")
    with graph.inserting_after(idx):
        graph.call_function(torch.ops.aten._assert_tensor_metadata.default, (idx,),
                            {"dtype": torch.int64})  # fmt: skip
    program.record("noisy")
    assert "_assert_tensor_metadata" not in dump(program)
    assert "_assert_tensor_metadata" in dump(program, show_noise=True)
    assert diff(program, "capture", "noisy") == ""


def test_colour_only_when_asked_or_on_a_terminal(engine, monkeypatch):
    assert "\033[" in diff(engine, 0, 1, color=True)
    assert "\033[" not in diff(engine, 0, 1, color=False)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False, raising=False)
    assert "\033[" not in diff(engine, 0, 1)
    assert diff(engine, 0, 1).startswith("--- stage 0: capture\n+++ stage 1: shape_memory")


def test_to_dot_has_nodes_and_edges(engine):
    dot = to_dot(engine, "capture")
    assert dot.startswith("digraph fxstar {")
    assert '"layer_norm" -> "linear";' in dot
    assert '"cross_entropy_loss" -> "output";' in dot


def test_draw_without_graphviz_names_the_extra(engine, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "graphviz", None)
    with pytest.raises(ImportError, match=r"pip install fxstar\[viz\].*dot"):
        draw(engine, "capture", tmp_path / "g.svg")


def test_draw_writes_svg(engine, tmp_path):
    graphviz = pytest.importorskip("graphviz")
    try:
        graphviz.Source("digraph { a }").pipe(format="svg")
    except graphviz.ExecutableNotFound:
        pytest.skip("Graphviz `dot` is not installed")
    path = draw(engine, "capture", tmp_path / "g.svg")
    with open(path, encoding="utf-8") as file:
        assert "<svg" in file.read()


def test_dump_rejects_other_objects():
    with pytest.raises(TypeError, match="Engine or a Program"):
        dump(object())


def test_dump_of_a_program_run_through_the_manager():
    program = PassManager(["shape_memory"]).run(capture(tiny_gpt(), tokens()))
    assert dump(program) == dump(program, "shape_memory")
