"""Capture: model + example inputs -> Program, or a CaptureError that says where and why.

The default is `torch.export.export(..., strict=False)`, the pre-decomposition training IR:
parameters, buffers and lifted constants are placeholders, so passes see every parameter use
and the Engine can feed the model's own tensors. `torch.fx.symbolic_trace` is offered for
dump/diff and identity runs of models export cannot take; rewrite passes refuse it.
"""

from __future__ import annotations

import contextlib
import copy
import linecache
import os
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.export.graph_signature import InputKind, OutputKind

from fxstar.autograd_functions import FunctionNotKept
from fxstar.autograd_functions import kept_functions as _autograd_functions
from fxstar.errors import CaptureError
from fxstar.program import EXPORT, SYMBOLIC_TRACE, InputSlot, ParamInfo, Program, buffers_restored

__all__ = ["LossWrapper", "capture", "is_meta"]

_KINDS = {
    InputKind.PARAMETER: "parameter",
    InputKind.BUFFER: "buffer",
    InputKind.CONSTANT_TENSOR: "constant",
    InputKind.USER_INPUT: "input",
}


# One capture at a time in a process, of one engine or of several: torch.export is not
# thread-safe. What it patches while it traces is process-wide (dynamo's and export's config
# and caches, the fx tracing state, and the autograd.Function hook `_autograd_functions`
# swaps in here, which two captures at once would restore out of order and leave behind), so
# no finer lock would do.
_CAPTURE_LOCK = threading.RLock()


class LossWrapper(nn.Module):
    """`forward(*inputs, targets)` = `loss_fn(model(*inputs), targets)`, for logits models.

    The last positional argument is the targets; keyword arguments go to the model. Capturing
    the wrapper puts the loss in the graph, so memory passes see it like any other node.
    """

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor]):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not args:
            raise TypeError("with plan.loss_fn the last positional argument must be the targets")
        *inputs, targets = args
        return self.loss_fn(self.model(*inputs, **kwargs), targets)


def capture(
    model: nn.Module,
    args: tuple = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    plan: Any = None,
    dynamic_shapes: Any = None,
    method: str = EXPORT,
) -> Program:
    """Capture `model` called on `args`/`kwargs` as a Program whose first stage is 'capture'.

    With `plan.loss_fn` set, the model is wrapped in a LossWrapper (the targets are the last
    positional argument). The model is captured in its current training mode.
    """
    with _CAPTURE_LOCK:
        return _capture(model, args, kwargs, plan, dynamic_shapes, method)


def _capture(model, args, kwargs, plan, dynamic_shapes, method) -> Program:
    start = time.perf_counter()
    kwargs = dict(kwargs or {})
    loss_fn = getattr(plan, "loss_fn", None)
    root: nn.Module = LossWrapper(model, loss_fn) if loss_fn is not None else model
    prefix = "model." if loss_fn is not None else ""
    if method == EXPORT:
        program = _capture_export(root, model, prefix, args, kwargs, plan, dynamic_shapes)
    elif method == SYMBOLIC_TRACE:
        program = _capture_symbolic(root, model, args, kwargs, plan)
    else:
        raise ValueError(f"method must be {EXPORT!r} or {SYMBOLIC_TRACE!r}, got {method!r}")
    program.refresh_param_uses()
    program.record("capture", by="capture")
    program.timings["capture"] = time.perf_counter() - start
    return program


# -- torch.export ---------------------------------------------------------------------------------


def _capture_export(root, model, prefix, args, kwargs, plan, dynamic_shapes) -> Program:
    args, kwargs = _distinct_tensors(args, kwargs)
    start = time.perf_counter()
    try:
        with (
            _autograd_functions(),
            _buffer_assignments(root),
            _meta_as_fake(root, args, kwargs) as traced,
        ):
            ep = torch.export.export(root, *traced, strict=False, dynamic_shapes=dynamic_shapes)
    except CaptureError:
        raise
    except Exception as error:  # noqa: BLE001 - any failure becomes a CaptureError
        raise _capture_error(error, root, prefix) from error
    export_seconds = time.perf_counter() - start

    def model_name(target: str) -> str:
        return target[len(prefix) :] if prefix and target.startswith(prefix) else target

    inputs = []
    for spec in ep.graph_signature.input_specs:
        if spec.kind not in _KINDS:
            raise CaptureError(
                f"unsupported graph input {spec.arg.name} of kind {spec.kind.name}",
                hint="fxstar feeds parameters, buffers, tensor constants and user inputs only",
            )
        target = spec.target
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            target = model_name(target)
        inputs.append(InputSlot(_KINDS[spec.kind], spec.arg.name, target))
    constants = {
        spec.target: ep.constants[spec.target]
        for spec in ep.graph_signature.input_specs
        if spec.kind == InputKind.CONSTANT_TENSOR
    }

    mutations = []
    for spec in ep.graph_signature.output_specs:
        if spec.kind == OutputKind.BUFFER_MUTATION:
            mutations.append(InputSlot("buffer", spec.arg.name, model_name(spec.target)))
        elif spec.kind != OutputKind.USER_OUTPUT:
            raise CaptureError(
                f"unsupported graph output {spec.arg.name} of kind {spec.kind.name}",
                hint="a model that mutates its inputs in place cannot be captured; copy first",
            )
    kinds = [spec.kind for spec in ep.graph_signature.output_specs]
    if any(k == OutputKind.BUFFER_MUTATION for k in kinds[len(mutations) :]):
        raise CaptureError("buffer mutations are expected before the user outputs")

    program = Program(
        graph_module=copy.deepcopy(ep.graph_module),
        model=model,
        plan=plan,
        ir=EXPORT,
        inputs=inputs,
        constants=constants,
        mutations=mutations,
        in_spec=ep.call_spec.in_spec,
        out_spec=ep.call_spec.out_spec,
        example_args=tuple(args),
        example_kwargs=kwargs,
        training=model.training,
        timings={"export": export_seconds},
    )
    program.params = _param_table(
        model, [(s.node, s.target) for s in inputs if s.kind == "parameter"]
    )
    return program


def is_meta(model: nn.Module) -> bool:
    """Is any parameter or buffer of `model` on the meta device (built without storage)?"""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


@contextlib.contextmanager
def _meta_as_fake(root: nn.Module, args: tuple, kwargs: dict) -> Iterator[tuple[tuple, dict]]:
    """Trace a model built on the meta device: while export runs, its meta parameters and
    buffers are fake tensors that say they live where the inputs do (one FakeTensorMode with
    the inputs), so nothing of the model's size is allocated and no op sees two devices.
    A model with real tensors is traced as it is."""
    if not is_meta(root):
        yield args, kwargs
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    device = leaves[0].device if leaves else torch.device("cpu")
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    swapped: list[tuple[dict, str, Any]] = []

    def fake(t: torch.Tensor) -> torch.Tensor:
        with mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)

    made: dict[int, torch.Tensor] = {}  # a tied tensor stays one (export reads it once)
    try:
        for module in root.modules():
            for table in (module._parameters, module._buffers):
                for name, t in list(table.items()):
                    if t is None or not t.is_meta:
                        continue
                    swapped.append((table, name, t))
                    value = made.get(id(t))
                    if value is None:
                        value = fake(t)
                        if isinstance(t, nn.Parameter):
                            value = nn.Parameter(value, requires_grad=t.requires_grad)
                        made[id(t)] = value
                    table[name] = value
        with mode:
            yield pytree.tree_map_only(torch.Tensor, mode.from_tensor, (args, kwargs))
    finally:
        for table, name, t in reversed(swapped):
            table[name] = t


@contextlib.contextmanager
def _buffer_assignments(root: nn.Module) -> Iterator[None]:
    """Write a buffer that a submodule's forward assigns (`self.ema = self.ema * 0.9 + m`) in
    place, while tracing (in this thread). Export turns such an assignment into a copy into
    the buffer on the root module only; on a submodule it drops it, and the graph would
    train with the buffer never changing. An in-place copy is a mutation export keeps; the
    module then holds the same tensor with the new value, as `state_dict()` shows eager's."""
    thread = threading.get_ident()
    owners = {id(m): name for name, m in root.named_modules() if m is not root}

    def assign(module: nn.Module, name: str, value: Any) -> Any:
        old = module._buffers.get(name)
        if threading.get_ident() != thread or id(module) not in owners or old is None:
            return None
        where = f"{owners[id(module)]}.{name}"
        if not isinstance(value, torch.Tensor) or (value.shape, value.dtype) != (
            old.shape,
            old.dtype,
        ):
            described = (
                f"a {tuple(value.shape)} {value.dtype} tensor"
                if isinstance(value, torch.Tensor)
                else repr(type(value).__name__)
            )
            raise CaptureError(
                f"forward assigns {described} to buffer {where} "
                f"({tuple(old.shape)} {old.dtype}): export drops a submodule's buffer "
                "assignment, and a different shape or dtype cannot be written in place",
                hint=f"keep {where}'s shape and dtype, or update it in place "
                "(`self.buf.copy_(new)`)",
            )
        old.copy_(value)
        return old

    handle = torch.nn.modules.module.register_module_buffer_registration_hook(assign)
    try:
        yield
    finally:
        handle.remove()


def _distinct_tensors(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Clone repeated input tensors: export merges identical inputs into one placeholder."""
    seen: set[int] = set()

    def distinct(x):
        if isinstance(x, torch.Tensor):
            if id(x) in seen:
                return x.detach().clone()
            seen.add(id(x))
        return x

    return pytree.tree_map(distinct, (tuple(args), kwargs))


def _param_table(model: nn.Module, bound: list[tuple[str, str]]) -> list[ParamInfo]:
    """One entry per parameter tensor (tied ones deduplicated by identity), every alias kept.

    `bound` lists (graph node name, model parameter name) pairs that bring a parameter in.
    """
    names_of: dict[int, list[str]] = {}
    tensor_of: dict[int, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
        tensor_of[id(p)] = p
    id_of = {name: key for key, names in names_of.items() for name in names}
    nodes_of: dict[int, list[str]] = {}
    for node, name in bound:
        nodes_of.setdefault(id_of[name], []).append(node)
    table = []
    for key, nodes in nodes_of.items():
        p = tensor_of[key]
        table.append(
            ParamInfo(
                name=names_of[key][0],
                aliases=tuple(names_of[key]),
                placeholders=tuple(nodes),
                shape=tuple(p.shape),
                dtype=p.dtype,
                requires_grad=p.requires_grad,
            )
        )
    return table


# -- torch.fx.symbolic_trace ----------------------------------------------------------------------


def _capture_symbolic(root, model, args, kwargs, plan) -> Program:
    try:
        with buffers_restored(root):
            gm = fx.symbolic_trace(root)
    except Exception as error:  # noqa: BLE001
        raise _capture_error(error, root, "model." if root is not model else "") from error
    prefix = "model." if root is not model else ""
    params = {name for name, _ in root.named_parameters(remove_duplicate=False)}
    bound = []
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target in params:
            bound.append((node.name, node.target))
        elif node.op == "call_module":
            mod = gm.get_submodule(node.target)
            for pname, _ in mod.named_parameters(remove_duplicate=False):
                bound.append((node.name, f"{node.target}.{pname}"))
    bound = [(n, t[len(prefix) :] if prefix and t.startswith(prefix) else t) for n, t in bound]
    return Program(
        graph_module=gm,
        model=model,
        plan=plan,
        ir=SYMBOLIC_TRACE,
        params=_param_table(model, bound),
        example_args=tuple(args),
        example_kwargs=dict(kwargs),
        training=model.training,
    )


# -- errors ---------------------------------------------------------------------------------------

_TORCH_DIR = os.path.dirname(torch.__file__)
_FXSTAR_DIR = os.path.dirname(__file__)


def _capture_error(error: BaseException, root: nn.Module, prefix: str) -> CaptureError:
    """A CaptureError naming the innermost model module and model source line in the traceback."""
    module_names = {id(m): name for name, m in root.named_modules(remove_duplicate=False)}
    module_path = location = None
    for frame, lineno in traceback.walk_tb(error.__traceback__):
        filename = frame.f_code.co_filename
        owner = frame.f_locals.get("self")
        if owner is not None and id(owner) in module_names:
            name = module_names[id(owner)]
            module_path = name[len(prefix) :] if prefix and name.startswith(prefix) else name
        if not filename.startswith((_TORCH_DIR, _FXSTAR_DIR)):
            source = linecache.getline(filename, lineno).strip()
            location = f"{filename}:{lineno} in {frame.f_code.co_name}" + (
                f": {source}" if source else ""
            )
    return CaptureError(
        f"could not capture {type(root).__name__} with torch.export (strict=False)",
        original=error,
        module_path=module_path,
        location=location,
        hint=_hint(error),
    )


def _hint(error: BaseException) -> str:
    if isinstance(error, FunctionNotKept):
        return error.hint
    text = f"{type(error).__name__}: {error}"
    if "pytree" in text or "not a known type" in text:
        return (
            "the model returns or takes a non-tensor object (a KV cache?): set "
            "config.use_cache=False, or wrap the model so forward returns only tensors"
        )
    if "data-dependent" in text or "DataDependent" in text:
        return (
            "Python control flow or .item() depends on a tensor's value here: compute it "
            "outside the model, use torch.where/torch.cond, or hint with torch._check"
        )
    return (
        "make forward traceable with fake tensors (no .item(), .numpy() or value-dependent "
        "branches); for dump/diff only, capture with method='symbolic_trace'"
    )
