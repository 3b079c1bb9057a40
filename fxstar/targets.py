"""`MODULE:FACTORY` strings: how the command line names a model to compile.

MODULE is a dotted module name (`fxstar.models.gpt`) or a path to a Python file
(`examples/my_model.py`). FACTORY is a callable in it, called without arguments, that returns
`(model, example_inputs)`, `(model, example_inputs, plan)`, or a dict with the keys `model`,
`example_inputs` and optionally `example_kwargs` and `plan`. Example inputs given as a dict
are keyword inputs, as a transformers batch is passed: `model(**batch)` (`labels` included).

A target that cannot be used is a TargetError (a ValueError, an FxstarError); what the user's
module or factory raises passes through unchanged.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from torch import nn

from fxstar.errors import TargetError
from fxstar.plan import Plan

_DICT_KEYS = ("model", "example_inputs", "example_kwargs", "plan")


@dataclass
class Target:
    model: nn.Module
    example_inputs: tuple
    plan: Plan | None = None
    example_kwargs: dict[str, Any] = field(default_factory=dict)


def _module(name: str) -> ModuleType:
    if name.endswith(".py") or os.sep in name:
        return _file_module(name)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        # the target itself (or a package above it) is missing: a typo, not a broken import
        # inside the user's module, whose traceback stays
        if error.name is None or not (name == error.name or name.startswith(error.name + ".")):
            raise
        raise TargetError(
            f"{name!r}: no module named {error.name!r} (MODULE is a dotted module name or a "
            "path to a .py file)"
        ) from None


def _file_module(name: str) -> ModuleType:
    """Run a .py file as a module of a private name: a file called numpy.py or json.py must
    not replace that module in sys.modules for everything imported after it."""
    path = os.path.abspath(name)
    if not os.path.isfile(path):
        raise TargetError(f"{name!r}: no such file")
    stem = os.path.splitext(os.path.basename(path))[0]
    module_name = f"_fxstar_target_{zlib.crc32(path.encode()):08x}_{stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module


def load_target(spec: str) -> Target:
    """Import MODULE, call FACTORY, and check what it returned."""
    module_name, sep, factory_name = spec.rpartition(":")
    if not sep or not module_name or not factory_name:
        raise TargetError(
            f"{spec!r}: expected MODULE:FACTORY, e.g. fxstar.models.gpt:tiny or "
            "examples/model.py:make"
        )
    module = _module(module_name)
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        found = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        raise TargetError(
            f"{spec!r}: {module_name} has no callable {factory_name!r} "
            f"(callables there: {', '.join(sorted(found)) or 'none'})"
        )
    return _as_target(spec, factory())


def _as_target(spec: str, result: Any) -> Target:
    kwargs: Any = {}
    if isinstance(result, dict):
        unknown = set(result) - set(_DICT_KEYS)
        if unknown or "model" not in result or "example_inputs" not in result:
            raise TargetError(
                f"{spec}: the factory's dict needs the keys 'model' and 'example_inputs' "
                f"(and optionally 'example_kwargs', 'plan'); got {sorted(result)}"
            )
        kwargs = result.get("example_kwargs") or {}
        result = (result["model"], result["example_inputs"], result.get("plan"))
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise TargetError(
            f"{spec}: the factory must return (model, example_inputs[, plan]); "
            f"got {type(result).__name__}"
        )
    model, inputs, plan = (*result, None)[:3]
    if not isinstance(model, nn.Module):
        raise TargetError(f"{spec}: the factory's model is a {type(model).__name__}, not a Module")
    if plan is not None and not isinstance(plan, Plan):
        plan = Plan.from_dict(plan)
    if isinstance(inputs, Mapping):  # a batch of keyword inputs
        inputs, kwargs = (), {**inputs, **kwargs}
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise TargetError(f"{spec}: example_kwargs must be a dict of name -> input, got {kwargs!r}")
    inputs = tuple(inputs) if isinstance(inputs, list | tuple) else (inputs,)
    return Target(model, inputs, plan, dict(kwargs))
