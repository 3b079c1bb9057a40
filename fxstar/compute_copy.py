"""What an engine's graph runs on and is fed, against the model the user holds.

For bf16/fp16 capture traces a copy of the model in that precision (a graph traced in fp32
bakes fp32 into its casts) while the model keeps the fp32 masters: the graph's inputs are cast
to the compute dtype, what forward changes in the copy's buffers is mirrored into the model's,
and under fp16 the loss sends its gradient back scaled.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from fxstar.runtime.loss_scale import scale_gradients

__all__ = ["COMPUTE_DTYPES", "builds_cache", "graph_inputs", "low_precision_copy",
           "mirror_buffers", "scale_loss"]  # fmt: skip

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def low_precision_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    return copy.deepcopy(model).to(dtype)


def builds_cache(model: nn.Module) -> bool:
    """A transformers model that returns a KV cache unless told `use_cache=False`."""
    config = getattr(model, "config", None)
    try:
        takes = "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return takes and bool(getattr(config, "use_cache", False))


def graph_inputs(
    args: tuple,
    kwargs: Mapping[str, Any],
    *,
    no_cache: bool,
    dtype: torch.dtype | None,
    device: torch.device | None,
) -> tuple[tuple, dict]:
    """What the graph is called with. A transformers model whose config builds a KV cache
    (`no_cache`: `use_cache=True`, the default) is asked not to: training never reads it, and
    a cache object is no tensor a graph can return. With a low-precision `dtype`,
    floating-point inputs in it, as the model traced in it expects (integer inputs, token
    ids, as they are). Tensors go to `device` when one is set."""
    kwargs = dict(kwargs)
    if no_cache and "use_cache" not in kwargs:
        kwargs["use_cache"] = False
    if dtype is None and device is None:
        return args, kwargs

    def convert(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if dtype is not None and x.is_floating_point() and x.dtype != dtype:
            x = x.to(dtype)
        return x if device is None else x.to(device, non_blocking=True)

    return pytree.tree_map(convert, (tuple(args), dict(kwargs)))


def mirror_buffers(model: nn.Module, traced: nn.Module, last: dict[str, torch.Tensor]) -> None:
    """What forward changed in the low-precision copy's buffers (BatchNorm's running
    statistics, in place or as a mutation) shows in the model's own, so `model.state_dict()`
    is the trained model. Compared by value with `last` (the values last mirrored, updated):
    batch_norm updates its running statistics without bumping their version, and a buffer
    nothing changed (RoPE's fp32 inv_freq) must not come back rounded."""
    own = dict(model.named_buffers(remove_duplicate=False))
    with torch.no_grad():
        for name, buffer in traced.named_buffers(remove_duplicate=False):
            previous = last.get(name)
            if name in own and (previous is None or not torch.equal(previous, buffer)):
                own[name].copy_(buffer)
                last[name] = buffer.clone()


def scale_loss(output: Any, scale: float) -> Any:
    """fp16: the loss the user calls backward on sends its gradient back multiplied by the
    loss scale (its value stays unscaled)."""
    if isinstance(output, torch.Tensor):
        return scale_gradients(output, scale)
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        output["loss"] = scale_gradients(output["loss"], scale)
        return output
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return (scale_gradients(output[0], scale), *output[1:])
    raise TypeError("precision 'fp16' needs the model to return its loss (or a 'loss' entry)")
