"""shape_memory: per node, output shape/dtype/bytes and the bytes it saves for backward.

Measured once by running the program on its example inputs node by node under
`saved_tensors_hooks` (no backward; RNG state and buffers untouched). Saved tensors are
counted by storage, once, at the first node that saves them; saves of parameter storage
(`linear` saves `weight.t()`) are counted apart, since they cost no activation memory.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from fxstar.dump import NOTES_KEY
from fxstar.passes import Pass, register
from fxstar.program import Program
from fxstar.sizes import format_size

__all__ = ["META_KEY", "MemoryReport", "NodeMemory", "ShapeMemory", "block_of"]

META_KEY = "fxstar.shape_memory"
"""node.meta key of the node's NodeMemory; Program.meta key of the MemoryReport."""


@dataclass
class NodeMemory:
    out_bytes: int = 0
    saved_bytes: int = 0
    saved_param_bytes: int = 0
    block: str = ""
    # the parameters (by store name) this node saves for backward, one entry per saved
    # tensor in the order saved: backward unpacks each when this node's gradient runs, which
    # is what chunk eviction plans for
    saved_params: tuple[str, ...] = ()


@dataclass
class MemoryReport:
    """Totals of a shape_memory measurement, and the same per block ('h.0', 'wte', ...)."""

    out_bytes: int = 0
    saved_bytes: int = 0
    saved_param_bytes: int = 0
    param_bytes: int = 0
    blocks: dict[str, NodeMemory] = field(default_factory=dict)

    def format(self) -> str:
        rows = [("block", "outputs", "saved for backward")]
        rows += [(b, format_size(m.out_bytes), format_size(m.saved_bytes))
                 for b, m in self.blocks.items()]  # fmt: skip
        rows.append(("total", format_size(self.out_bytes), format_size(self.saved_bytes)))
        w0, w1 = (max(len(r[i]) for r in rows) for i in (0, 1))
        lines = ["activation memory (shape_memory, measured on the example inputs):"]
        lines += [f"  {a:<{w0}}  {b:>{w1}}  {c}" for a, b, c in rows]
        lines.append(
            f"  parameters {format_size(self.param_bytes)}; parameter tensors saved for "
            f"backward (views, no extra memory): {format_size(self.saved_param_bytes)}"
        )
        return "\n".join(lines)


def block_of(node: fx.Node) -> str:
    """The block a node belongs to: the module path up to its first index ('h.0'), else the
    top-level module ('wte', 'ln_f'), else '(root)'."""
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
    elif node.op == "call_module":
        path = str(node.target)
    else:
        path = ""
    parts = [p for p in path.split(".") if p]
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0] if parts else "(root)"


def _bytes(value: Any) -> int:
    return sum(
        t.numel() * t.element_size()
        for t in pytree.tree_leaves(value)
        if isinstance(t, torch.Tensor)
    )


class _Recorder(fx.Interpreter):
    """Runs node by node, attributing each saved tensor to the node being run."""

    def __init__(self, gm: fx.GraphModule, saved: dict, measured: dict):
        super().__init__(gm)
        self.saved = saved
        self.measured = measured
        self.current: fx.Node | None = None

    def run_node(self, node: fx.Node) -> Any:
        self.current = node
        result = super().run_node(node)
        if node.op in ("call_function", "call_method", "call_module"):
            self.measured[node] = _bytes(result)
            if "val" not in node.meta and isinstance(result, torch.Tensor):
                node.meta["tensor_meta"] = _extract_tensor_metadata(result)
        return result


def _fork_rng():
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    return torch.random.fork_rng(devices=devices)


@register
class ShapeMemory(Pass):
    """Analysis: writes NodeMemory to node.meta and a MemoryReport to program.meta."""

    name = "shape_memory"
    needs_export_ir = False

    def __call__(self, program: Program) -> Program:
        param_storages = {p.untyped_storage().data_ptr() for p in program.model.parameters()} | {
            b.untyped_storage().data_ptr() for b in program.model.buffers()
        }
        # and what the program is fed in their place (tiles, shards a pass derived)
        param_storages |= {t.untyped_storage().data_ptr() for t in program.model_tensors().values()}
        param_names: dict[int, list[str]] = {}  # storage ptr -> parameter names
        for name, t in program.model_tensors().items():
            if isinstance(t, torch.nn.Parameter):
                param_names.setdefault(t.untyped_storage().data_ptr(), []).append(name)
        saved_params: dict[fx.Node, list[str]] = {}
        saved: dict[int, tuple[fx.Node | None, int]] = {}  # storage ptr -> (node, bytes)
        keep: list[torch.Tensor] = []  # keeps storages alive so pointers stay unique
        measured: dict[fx.Node, int] = {}
        recorder: _Recorder | None = None

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in param_names and recorder is not None and recorder.current is not None:
                saved_params.setdefault(recorder.current, []).append(param_names[ptr][0])
            if ptr not in saved:
                saved[ptr] = (recorder.current if recorder else None, storage.nbytes())
                keep.append(t)
            return t

        def make(gm: fx.GraphModule) -> _Recorder:
            nonlocal recorder
            recorder = _Recorder(gm, saved, measured)
            return recorder

        with contextlib.ExitStack() as stack:
            stack.enter_context(_fork_rng())
            stack.enter_context(torch.enable_grad())
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
            program.run(
                program.example_args,
                program.example_kwargs,
                apply_mutations=False,
                interpreter=make,
            )

        report = MemoryReport(param_bytes=program.param_bytes)
        per_node: dict[fx.Node, NodeMemory] = {}
        for node, nbytes in measured.items():
            names = tuple(saved_params.get(node, ()))
            per_node[node] = NodeMemory(out_bytes=nbytes, block=block_of(node), saved_params=names)
        for ptr, (node, nbytes) in saved.items():
            if node is None or node not in per_node:
                continue
            if ptr in param_storages:
                per_node[node].saved_param_bytes += nbytes
            else:
                per_node[node].saved_bytes += nbytes
        for node, mem in per_node.items():
            node.meta[META_KEY] = mem
            notes = node.meta.setdefault(NOTES_KEY, {})
            notes["out"] = format_size(mem.out_bytes)
            if mem.saved_bytes:
                notes["saved"] = format_size(mem.saved_bytes)
            block = report.blocks.setdefault(mem.block, NodeMemory(block=mem.block))
            for total in (block, report):
                total.out_bytes += mem.out_bytes
                total.saved_bytes += mem.saved_bytes
                total.saved_param_bytes += mem.saved_param_bytes
        program.meta[META_KEY] = report
        return program
