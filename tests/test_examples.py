"""The examples run as a user would run them."""

import contextlib
import importlib.util
import os
import sys

import pytest

from fxstar import passes

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def _load(name):
    spec = importlib.util.spec_from_file_location(
        f"example_{name}", os.path.join(EXAMPLES, f"{name}.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_gpt_example_trains(capsys):
    _load("gpt").main()
    losses = [float(line.split()[-1]) for line in capsys.readouterr().out.splitlines()]
    assert len(losses) == 5 and losses[-1] < losses[0]


def test_hf_trainer_example_trains_and_evaluates(capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    _load("hf_trainer").main(steps=10)
    lines = capsys.readouterr().out.splitlines()
    losses = [float(line.split("loss ")[1].split(",")[0]) for line in lines if ": loss " in line]
    assert len(losses) == 2 and losses[-1] < losses[0]
    assert any(": eval loss " in line for line in lines)


@contextlib.contextmanager
def _run_pass_example(name: str, pass_name: str, capsys):
    """Run examples/<name>.py's main(); its output; the pass it registers removed after."""
    module = _load(name)
    try:
        module.main()
        yield capsys.readouterr().out
    finally:
        passes.unregister(pass_name)


def test_custom_pass_shows_in_dump_and_diff(capsys):
    with _run_pass_example("custom_pass", "linear_flops", capsys) as out:
        assert passes.get("linear_flops").after == ("shape_memory",)
        assert "# stage 2: linear_flops (after capture, shape_memory)" in out
        assert "+++ stage 2: linear_flops" in out
        assert "flops=131,072 @head" in out
        assert "linear FLOPs per forward: 1,703,936" in out
        assert passes.get("linear_flops").phase == "analyse"


def test_rewrite_pass_is_ordered_by_phase_and_verified(capsys):
    with _run_pass_example("rewrite_pass", "tanh_gelu", capsys) as out:
        assert "passes: tanh_gelu, checkpoint_regions, activation_checkpoint" in out
        # the rewrite made shape_memory stale: the manager measured again before the regions
        assert "stages: capture, tanh_gelu, shape_memory, checkpoint_regions, " in out
        assert "+    gelu = aten.gelu(linear_2, approximate='tanh')" in out
        assert "rewritten: 2 GELUs" in out
