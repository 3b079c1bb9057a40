"""MODULE:FACTORY strings."""

import json
import sys

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


KWARGS_MODEL = """
import torch


class Tagger(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, input_ids, labels=None):
        logits = self.fc(input_ids)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def batch():
    return {"input_ids": torch.randn(16, 8), "labels": torch.randint(0, 4, (16,))}


def as_batch():
    torch.manual_seed(0)
    return Tagger(), batch()


def as_dict():
    torch.manual_seed(0)
    b = batch()
    return {"model": Tagger(), "example_inputs": (b["input_ids"],),
            "example_kwargs": {"labels": b["labels"]}}
"""


def test_a_file_named_like_a_module_does_not_replace_it(tmp_path):
    for name in ("json.py", "numpy.py"):
        (tmp_path / name).write_text(KWARGS_MODEL)
    before = sys.modules["json"], sys.modules.get("numpy")
    target = load_target(f"{tmp_path / 'json.py'}:as_batch")
    load_target(f"{tmp_path / 'numpy.py'}:as_batch")
    assert (sys.modules["json"], sys.modules.get("numpy")) == before
    assert json.dumps([1]) == "[1]"
    assert type(target.model).__module__.startswith("_fxstar_target_")


def test_a_failing_file_leaves_no_module_behind(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('broken on import')\n")
    modules = set(sys.modules)
    with pytest.raises(RuntimeError, match="broken on import"):
        load_target(f"{path}:make")
    assert set(sys.modules) == modules


def test_keyword_inputs_a_batch_dict_or_example_kwargs(tmp_path):
    path = tmp_path / "tagger.py"
    path.write_text(KWARGS_MODEL)
    batch = load_target(f"{path}:as_batch")
    assert batch.example_inputs == () and set(batch.example_kwargs) == {"input_ids", "labels"}
    mixed = load_target(f"{path}:as_dict")
    assert len(mixed.example_inputs) == 1 and set(mixed.example_kwargs) == {"labels"}
    loss = mixed.model(*mixed.example_inputs, **mixed.example_kwargs)["loss"]
    assert loss.dim() == 0


def test_bad_example_kwargs(tmp_path):
    path = tmp_path / "bad_kwargs.py"
    path.write_text(
        "import torch\n"
        "def make():\n"
        "    return {'model': torch.nn.Linear(2, 2), 'example_inputs': (),\n"
        "            'example_kwargs': [torch.randn(1, 2)]}\n"
    )
    with pytest.raises(ValueError, match="example_kwargs must be a dict"):
        load_target(f"{path}:make")
