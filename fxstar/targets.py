"""`MODULE:FACTORY` strings: how the command line names a model to compile.

MODULE is a dotted module name (`fxstar.models.gpt`) or a path to a Python file
(`examples/my_model.py`). FACTORY is a callable in it, called without arguments, that returns
`(model, example_inputs)`, `(model, example_inputs, plan)`, or a dict with the keys `model`,
`example_inputs` and optionally `plan`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from torch import nn

from fxstar.plan import Plan


@dataclass
class Target:
    model: nn.Module
    example_inputs: tuple
    plan: Plan | None = None


def _module(name: str) -> ModuleType:
    if name.endswith(".py") or os.sep in name:
        path = os.path.abspath(name)
        if not os.path.isfile(path):
            raise ValueError(f"{name!r}: no such file")
        module_name = os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
        return module
    return importlib.import_module(name)


def load_target(spec: str) -> Target:
    """Import MODULE, call FACTORY, and check what it returned."""
    module_name, sep, factory_name = spec.rpartition(":")
    if not sep or not module_name or not factory_name:
        raise ValueError(
            f"{spec!r}: expected MODULE:FACTORY, e.g. fxstar.models.gpt:tiny or "
            "examples/model.py:make"
        )
    module = _module(module_name)
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        found = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        raise ValueError(
            f"{spec!r}: {module_name} has no callable {factory_name!r} "
            f"(callables there: {', '.join(sorted(found)) or 'none'})"
        )
    return _as_target(spec, factory())


def _as_target(spec: str, result: Any) -> Target:
    if isinstance(result, dict):
        unknown = set(result) - {"model", "example_inputs", "plan"}
        if unknown or "model" not in result or "example_inputs" not in result:
            raise ValueError(
                f"{spec}: the factory's dict needs the keys 'model' and 'example_inputs' "
                f"(and optionally 'plan'); got {sorted(result)}"
            )
        result = (result["model"], result["example_inputs"], result.get("plan"))
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise ValueError(
            f"{spec}: the factory must return (model, example_inputs[, plan]); "
            f"got {type(result).__name__}"
        )
    model, inputs, plan = (*result, None)[:3]
    if not isinstance(model, nn.Module):
        raise ValueError(f"{spec}: the factory's model is a {type(model).__name__}, not a Module")
    if plan is not None and not isinstance(plan, Plan):
        plan = Plan.from_dict(plan)
    inputs = tuple(inputs) if isinstance(inputs, list | tuple) else (inputs,)
    return Target(model, inputs, plan)
