"""A training state as training.json holds it: a JSON skeleton with {"__tensor__": key} where
each tensor was, the tensors by key in a safetensors file beside it. Dicts with keys other
than plain strings (torch's optimizer state is keyed by int) and tuples are marked so they
come back as they were. A deferred tensor (runtime/deferred.py) stays one, for the writer to
read."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from fxstar.errors import CheckpointError
from fxstar.runtime.deferred import DeferredTensor


def to_json(obj: Any) -> tuple[Any, dict[str, torch.Tensor | DeferredTensor]]:
    """A JSON-able skeleton of `obj` and its tensors by key (the path where each was found)."""
    tensors: dict[str, torch.Tensor | DeferredTensor] = {}

    def walk(x: Any, path: tuple[str, ...]) -> Any:
        if isinstance(x, torch.Tensor | DeferredTensor):
            key = "/".join(path)
            tensors[key] = x if isinstance(x, DeferredTensor) else x.detach().cpu().contiguous()
            return {"__tensor__": key}
        if isinstance(x, Mapping):
            if all(isinstance(k, str) for k in x) and not any(k.startswith("__") for k in x):
                return {k: walk(v, (*path, k)) for k, v in x.items()}
            return {"__dict__": [[walk(k, (*path, "key")), walk(v, (*path, str(k)))]
                                 for k, v in x.items()]}  # fmt: skip
        if isinstance(x, list):
            return [walk(v, (*path, str(i))) for i, v in enumerate(x)]
        if isinstance(x, tuple):
            return {"__tuple__": [walk(v, (*path, str(i))) for i, v in enumerate(x)]}
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, (np.integer, np.floating, np.bool_)):
            return x.item()
        raise CheckpointError(
            f"cannot save a {type(x).__name__} at {'/'.join(path)}: training state holds "
            "tensors, numbers, strings, lists, tuples and dicts"
        )

    return walk(obj, ()), tensors


def from_json(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(skeleton, list):
        return [from_json(v, tensors) for v in skeleton]
    if not isinstance(skeleton, dict):
        return skeleton
    if "__tensor__" in skeleton:
        return tensors[skeleton["__tensor__"]]
    if "__tuple__" in skeleton:
        return tuple(from_json(v, tensors) for v in skeleton["__tuple__"])
    if "__dict__" in skeleton:
        return {from_json(k, tensors): from_json(v, tensors) for k, v in skeleton["__dict__"]}
    return {k: from_json(v, tensors) for k, v in skeleton.items()}
