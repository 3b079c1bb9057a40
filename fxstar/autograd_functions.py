"""Custom torch.autograd.Functions kept whole through capture, backward included.

torch.export inlines a Function's forward and keeps no trace of its backward: the graph would
train on autograd's derivative of the forward instead. While capture traces, every application
of a user Function (one not from torch or fxstar, applied with grad enabled) becomes one call of
a torch.library operator made for that Function class and that pattern of arguments:

- its Autograd kernel is the Function's own `apply`, so the graph's forward runs the Function's
  forward and autograd its backward with the real ctx (saved tensors through the saved-tensor
  hooks the chunk runtime pages parameters with, `needs_input_grad`, attributes, non-
  differentiable outputs, `once_differentiable`), exactly as eager does;
- below autograd (and on fake tensors, for shapes) the forward runs under no_grad.

Tensors, numbers, strings, None, dtypes and devices (and lists, tuples, dicts of them) are the
arguments a node can hold; non-tensor ones are typed arguments of the operator. A Function whose
forward cannot run on fake tensors (`.numpy()`, value-dependent output shapes), that takes
another kind of argument (a module, a callable: tensors hidden from the graph), writes an input
in place, or keeps a parameter on ctx outside `save_for_backward` (read back from memory the
chunk runtime reused) is refused with a `FunctionNotKept` naming it.

torch's own `torch._export.wrappers.allow_in_pre_dispatch_graph` keeps a Function as a
`flat_apply` node too, but finds the class again by import path (no local classes) and puts
TreeSpec attributes in the graph; an operator node is what every fxstar pass already reads.

Operators are process-wide: one per Function class and argument pattern, reused by every later
capture, and removed with the class (the kernels hold it weakly).
"""

from __future__ import annotations

import contextlib
import itertools
import re
import threading
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

__all__ = ["FunctionNotKept", "kept_functions"]

_NAMESPACE = "fxstar_fn"

_APPLY = torch.autograd.Function.apply.__func__
_ORIGINAL_CODE = _APPLY.__code__
_original_apply = types.FunctionType(
    _ORIGINAL_CODE, _APPLY.__globals__, _APPLY.__name__, _APPLY.__defaults__, _APPLY.__closure__
)
"""Function.apply as torch wrote it, callable while the routing is in place: `(cls, *args)`."""


class _Routing:
    def apply(cls, *args, **kwargs):  # noqa: N805 - Function.apply's own code, swapped in
        __class__  # noqa: B018 - Function.apply's code has this cell (it calls super())
        from fxstar.autograd_functions import _route

        return _route(cls, args, kwargs)


class FunctionNotKept(Exception):  # noqa: N818 - capture turns it into a CaptureError
    """A custom autograd Function that cannot be kept as one node; `hint` says what would do."""

    def __init__(self, function: type, reason: str, hint: str):
        super().__init__(f"custom autograd Function {_name(function)} {reason}")
        self.function = function
        self.hint = hint


class _Tracing(threading.local):
    inside = False  # running a kept Function: what it applies inside runs as it is
    outputs: tuple[pytree.TreeSpec, list[Any]] | None = None  # the last call's output structure


_state = _Tracing()
_capturing: int | None = None  # the thread whose applications are routed (the swap is global)
_ops: weakref.WeakKeyDictionary[type, _FunctionOps] = weakref.WeakKeyDictionary()
_names = itertools.count()


@contextlib.contextmanager
def kept_functions() -> Iterator[None]:
    """While the body runs (in this thread), each user Function applied with grad enabled is
    one operator call; other threads' applications run as torch wrote them."""
    global _capturing
    if _capturing is not None:  # a capture inside a capture (same thread: capture's lock)
        yield
        return
    _capturing = threading.get_ident()
    _APPLY.__code__ = _Routing.apply.__code__
    try:
        yield
    finally:
        _APPLY.__code__ = _ORIGINAL_CODE
        _capturing = None


def _route(cls: type, args: tuple, kwargs: dict) -> Any:
    if (
        _capturing != threading.get_ident()
        or _state.inside
        or not _user_function(cls)
        or not torch.is_grad_enabled()  # no backward to keep: the forward inlined is exact
        or torch._C._are_functorch_transforms_active()
    ):
        return _original_apply(cls, *args, **kwargs)
    flat, spec = pytree.tree_flatten((args, kwargs))
    kinds = tuple(_kind(cls, i, x) for i, x in enumerate(flat))
    functions = _ops.get(cls)
    if functions is None:
        functions = _ops[cls] = _FunctionOps(cls)
    op = functions.op(spec, kinds)
    _state.outputs = None
    try:
        tensors = op(*flat)
    except FunctionNotKept:
        raise
    except Exception as error:
        raise FunctionNotKept(
            cls,
            f"cannot run on fake tensors: {type(error).__name__}: {_first_line(error)}",
            _FAKE_HINT,
        ) from error
    if _state.outputs is None:
        raise RuntimeError(f"{_name(cls)}'s operator {op} ran no kernel of fxstar's")
    out_spec, leaves = _state.outputs
    _state.outputs = None
    tensors = iter(tensors)
    return pytree.tree_unflatten(
        [next(tensors) if isinstance(x, torch.Tensor) else x for x in leaves], out_spec
    )


_FAKE_HINT = (
    "keep its forward traceable on fake tensors (no .item(), .tolist(), .numpy(), output "
    "shapes that follow tensor values), or make it a torch.library.custom_op with a fake "
    "implementation and register_autograd"
)


def _user_function(cls: Any) -> bool:
    """Not torch's own (a custom op's autograd wrapper, reentrant checkpoint) nor fxstar's."""
    return isinstance(cls, type) and not cls.__module__.startswith(("torch.", "fxstar."))


# -- one operator per Function class and argument pattern ------------------------------------


_SCHEMA_TYPES: tuple[tuple[type | tuple[type, ...], str], ...] = (
    (torch.Tensor, "Tensor"),
    (type(None), "Tensor?"),
    ((bool, torch.SymBool), "bool"),
    ((int, torch.SymInt), "SymInt"),
    ((float, torch.SymFloat), "float"),
    (str, "str"),
    (torch.dtype, "ScalarType"),
    (torch.device, "Device"),
)


def _kind(cls: type, position: int, value: Any) -> str:
    for types_, schema in _SCHEMA_TYPES:
        if isinstance(value, types_):
            return schema
    what = "a module" if isinstance(value, nn.Module) else f"a {type(value).__qualname__}"
    raise FunctionNotKept(
        cls,
        f"takes {what} (argument leaf {position}): a graph node holds tensors, numbers, "
        "strings, None, dtypes and devices, and a module's or a callable's tensors would be "
        "hidden from the graph",
        "pass the tensors the Function uses as its arguments",
    )


class _FunctionOps:
    """The operators of one Function class, by argument pattern (tree structure and kinds)."""

    def __init__(self, cls: type):
        self.library = torch.library.Library(_NAMESPACE, "FRAGMENT")
        self.function = weakref.ref(cls)
        self.stem = re.sub(r"\W", "_", cls.__qualname__)
        self.ops: dict[tuple[pytree.TreeSpec, tuple[str, ...]], Any] = {}

    def op(self, spec: pytree.TreeSpec, kinds: tuple[str, ...]) -> Any:
        key = (spec, kinds)
        if key not in self.ops:
            self.ops[key] = self._define(spec, kinds)
        return self.ops[key]

    def _define(self, spec: pytree.TreeSpec, kinds: tuple[str, ...]) -> Any:
        name = f"{self.stem}_{next(_names)}"
        arguments = ", ".join(f"{kind} a{i}" for i, kind in enumerate(kinds))
        self.library.define(f"{name}({arguments}) -> Tensor[]")
        function = self.function

        def with_autograd(*flat: Any) -> list[torch.Tensor]:
            return _run(function, spec, flat)

        def below_autograd(*flat: Any) -> list[torch.Tensor]:
            with torch.no_grad():
                return _run(function, spec, flat)

        self.library.impl(name, with_autograd, "Autograd")
        self.library.impl(name, below_autograd, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{_NAMESPACE}::{name}", below_autograd, lib=self.library)
        return getattr(getattr(torch.ops, _NAMESPACE), name).default


def _run(function: Callable[[], type | None], spec: pytree.TreeSpec, flat: tuple) -> list:
    """Apply the Function as torch would; its tensor outputs, none an alias of an input."""
    cls = function()
    if cls is None:
        raise RuntimeError("the custom autograd Function of this graph node no longer exists")
    args, kwargs = pytree.tree_unflatten(list(flat), spec)
    inputs = [x for x in flat if isinstance(x, torch.Tensor)]
    versions = [t._version for t in inputs]
    inside, _state.inside = _state.inside, True
    try:
        out = _original_apply(cls, *args, **kwargs)
    finally:
        _state.inside = inside
    leaves, out_spec = pytree.tree_flatten(out)
    tracing = _capturing == threading.get_ident() and not inside
    if tracing:
        _check(cls, inputs, versions, leaves)
        _state.outputs = (out_spec, leaves)
    storages = {_storage(t) for t in inputs}
    # an output that views an input is a copy: no pass follows an alias through an opaque node
    return [
        t.clone() if _storage(t) in storages else t for t in leaves if isinstance(t, torch.Tensor)
    ]


def _check(cls: type, inputs: list, versions: list, leaves: list) -> None:
    """What the capture refuses, seen on the traced (fake) application."""
    for t, version in zip(inputs, versions, strict=True):
        if t._version != version:
            raise FunctionNotKept(
                cls,
                f"writes its input ({tuple(t.shape)} {t.dtype}) in place: its node would "
                "hide the write from the graph",
                "return a new tensor instead of writing the input (and of ctx.mark_dirty)",
            )
    # a number it returns is the trace's: fixed by the shapes and arguments (one of the
    # tensors' values would have failed on fake tensors), or a symbol of the shapes
    for x in leaves:
        if isinstance(x, torch.Tensor) and _unbacked(x):
            raise FunctionNotKept(
                cls,
                f"returns a tensor whose shape {tuple(x.shape)} follows tensor values",
                _FAKE_HINT,
            )
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    ctx = next((t.grad_fn for t in tensors if getattr(t.grad_fn, "_forward_cls", None)), None)
    if ctx is None:
        return
    parameters = {_storage(t): t for t in inputs if isinstance(_root(t), nn.Parameter)}
    for attribute, value in vars(ctx).items():
        for kept in pytree.tree_leaves(value):
            if isinstance(kept, torch.Tensor) and _storage(kept) in parameters:
                raise FunctionNotKept(
                    cls,
                    f"keeps a parameter ({tuple(kept.shape)} {kept.dtype}) as ctx.{attribute}: "
                    "backward would read it from memory that parameter paging reuses",
                    f"save it with ctx.save_for_backward instead of ctx.{attribute}",
                )


def _root(t: torch.Tensor) -> torch.Tensor:
    while t._base is not None:
        t = t._base
    return t


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _unbacked(t: torch.Tensor) -> bool:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    return bool(free_unbacked_symbols(t.shape))


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else ""
