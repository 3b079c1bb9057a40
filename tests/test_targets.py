"""MODULE:FACTORY strings."""

import pytest
import torch

from fxstar.plan import Plan
from fxstar.targets import load_target


def test_module_factory():
    target = load_target("fxstar.models.gpt:tiny")
    assert type(target.model).__name__ == "GPT"
    assert len(target.example_inputs) == 2 and target.plan is None


def test_factory_may_return_a_plan(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "import torch\n"
        "def make():\n"
        "    return torch.nn.Linear(2, 2), torch.randn(1, 2), {'optimizer': {'lr': 0.5}}\n"
    )
    target = load_target(f"{path}:make")
    assert isinstance(target.plan, Plan) and target.plan.optimizer.lr == 0.5
    assert isinstance(target.example_inputs[0], torch.Tensor)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no-colon", "expected MODULE:FACTORY"),
        ("fxstar.models.gpt:", "expected MODULE:FACTORY"),
        ("fxstar.models.gpt:GPTConfig_missing", "no callable"),
        ("missing/file.py:make", "no such file"),
    ],
)
def test_bad_specs(spec, message):
    with pytest.raises(ValueError, match=message):
        load_target(spec)


def test_bad_factory_result(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text("def make():\n    return 3\n")
    with pytest.raises(ValueError, match="must return"):
        load_target(f"{path}:make")
