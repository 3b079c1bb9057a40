"""What compile may change on a user's model, put back when compile raises.

Compile changes the model it is given: a meta model's buffers get storage, buffers move to
the compute device, the engine marks the model as its own, the chunk engine rebinds the
parameters to views of its chunk homes and writes the weights there, hooks are registered. A
compile that raises must leave none of it: a model left bound to the zeroed homes of an
engine that no longer exists would train from zeros at the next compile, without a word.

A snapshot is shallow, so a model larger than the host fits it: per module its attributes
and the contents of its containers (parameters, buffers, submodules, hooks: one level deep),
per parameter and buffer the tensor itself, its data, requires_grad, gradient and own
attributes. No value is copied: compile writes into no tensor it was given (it reads them
into homes of its own), so the tensors put back hold the values they held.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["AttributeState", "ModelSnapshot"]

_CONTAINERS = (dict, set, list)


class AttributeState:
    """One object's attributes, and a one-level copy of each container among them."""

    def __init__(self, obj: Any):
        self.obj = obj
        self.attrs = dict(obj.__dict__)
        self.contents = {
            key: _copy(value) for key, value in self.attrs.items() if isinstance(value, _CONTAINERS)
        }

    def restore(self) -> None:
        current = self.obj.__dict__
        for key in [k for k in current if k not in self.attrs]:
            del current[key]
        for key, value in self.attrs.items():
            current[key] = value  # the same object: hook handles hold their dict weakly
            if key in self.contents:
                _refill(value, self.contents[key])


class _TensorState:
    def __init__(self, t: torch.Tensor):
        self.tensor = t
        self.data = t.detach()  # the same storage, kept alive: `t.data = ...` is undone
        self.requires_grad = t.requires_grad
        self.grad = t.grad
        self.attrs = AttributeState(t)

    def restore(self) -> None:
        t = self.tensor
        with torch.no_grad():
            if not _same_data(t, self.data):
                t.data = self.data
        if t.is_leaf and t.requires_grad != self.requires_grad:
            t.requires_grad_(self.requires_grad)
        if t.grad is not self.grad:
            t.grad = self.grad
        self.attrs.restore()


class ModelSnapshot:
    """The state of `models` (and every submodule, parameter and buffer) now, for `restore`."""

    def __init__(self, *models: nn.Module):
        modules = {id(m): m for model in models for m in model.modules()}
        self._modules = [AttributeState(m) for m in modules.values()]
        tensors: dict[int, torch.Tensor] = {}
        for module in modules.values():
            for table in (module._parameters, module._buffers):
                for t in table.values():
                    if t is not None:
                        tensors[id(t)] = t
        self._tensors = [_TensorState(t) for t in tensors.values()]

    def restore(self) -> None:
        """Every module, parameter and buffer as it was when the snapshot was taken."""
        for state in self._modules:
            state.restore()
        for state in self._tensors:
            state.restore()


def _copy(container: Any) -> Any:
    return dict(container) if isinstance(container, dict) else type(container)(container)


def _refill(container: Any, saved: Any) -> None:
    """`container` holds what `saved` does again, in place (it stays the same object)."""
    if isinstance(container, dict | set):
        container.clear()
        container.update(saved)
    else:
        container[:] = saved


def _same_data(t: torch.Tensor, data: torch.Tensor) -> bool:
    if t.is_meta or data.is_meta:
        return t.is_meta == data.is_meta and t.shape == data.shape and t.dtype == data.dtype
    return (
        t.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()
        and t.storage_offset() == data.storage_offset()
        and t.shape == data.shape
        and t.stride() == data.stride()
        and t.dtype == data.dtype
        and t.device == data.device
    )
