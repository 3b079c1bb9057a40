"""shape_memory: per node, output shape/dtype/bytes and the bytes it saves for backward.

Measured once by running the program on its example inputs node by node under
`saved_tensors_hooks` (no backward; RNG state and buffers untouched). Saved tensors are
counted by storage, once, at the first node that saves them; saves of parameter storage
(`linear` saves `weight.t()`) are counted apart, since they cost no activation memory.

Each node also gets `backward_bytes`: what its gradient allocates at once on top of what is
saved — the gradient of its output, of its activation inputs, and of intermediates it saved
inside (cross_entropy's log-softmax): the logits' backward holds two logits-sized gradients.
The peak of a step is where the saved bytes still alive plus this are largest.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from fxstar.dump import NOTES_KEY
from fxstar.passes import Pass, register
from fxstar.program import SYMBOLIC_TRACE, Program, buffers_restored
from fxstar.sizes import format_size

__all__ = [
    "META_KEY",
    "BackwardStep",
    "MemoryReport",
    "NodeMemory",
    "ShapeMemory",
    "backward_peak",
    "block_of",
    "node_steps",
]

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
    backward_bytes: int = 0  # allocated at once while its gradient runs (module docstring)
    grad_bytes: int = 0  # the gradient of its outputs, held from its last user's backward on


@dataclass
class MemoryReport:
    """Totals of a shape_memory measurement, and the same per block ('h.0', 'wte', ...)."""

    out_bytes: int = 0
    saved_bytes: int = 0
    saved_param_bytes: int = 0
    param_bytes: int = 0
    largest_backward: int = 0  # the most one node's gradient allocates at once
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


@dataclass
class BackwardStep:
    """One node of the forward as backward meets it."""

    kept: int  # kept from the forward until its gradient has run
    transient: int  # what its gradient allocates at once
    back: int = 0  # brought back before its gradient runs (the end of a checkpointed region)
    frees: int | None = None  # freed once its gradient ran; None: what it kept

    def released(self) -> int:
        return self.kept if self.frees is None else self.frees


def backward_peak(steps: list[BackwardStep]) -> int:
    """The peak of activation bytes in backward: everything kept is resident at the turn; the
    steps' gradients run in reverse, each with its transient on top of what is resident (a
    checkpointed region's recomputation included), then free what they held."""
    live = sum(step.kept for step in steps)
    peak = live
    for step in reversed(steps):
        live += step.back
        peak = max(peak, live + step.transient)
        live -= step.released()
    return peak


def node_steps(nodes: Iterable[fx.Node]) -> dict[fx.Node, BackwardStep]:
    """A BackwardStep for each measured node, in graph order. Its transient includes the
    gradients waiting meanwhile: of values made before it and used after it (the residual
    stream), whose gradient a later node's backward made and an earlier one will consume."""
    nodes = [n for n in nodes if META_KEY in n.meta]
    position = {n: i for i, n in enumerate(nodes)}
    last_use = [max((position[u] for u in n.users if u in position), default=i)
                for i, n in enumerate(nodes)]  # fmt: skip
    done_at: dict[int, int] = {}  # position -> gradient bytes that stop waiting there
    for i, node in enumerate(nodes):
        if last_use[i] > i:
            done_at[last_use[i]] = done_at.get(last_use[i], 0) + node.meta[META_KEY].grad_bytes
    steps, waiting = {}, 0
    for i, node in enumerate(nodes):
        mem = node.meta[META_KEY]
        waiting -= done_at.get(i, 0)  # its own backward makes these: in backward_bytes
        steps[node] = BackwardStep(mem.saved_bytes, mem.backward_bytes + waiting)
        if last_use[i] > i:
            waiting += mem.grad_bytes
    return steps


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


def _grad_tensors(value: Any, params: set[int]) -> dict[int, int]:
    """Storage -> bytes of the tensors in `value` that get a gradient, parameters aside."""
    return {
        t.untyped_storage().data_ptr(): t.numel() * t.element_size()
        for t in pytree.tree_leaves(value)
        if isinstance(t, torch.Tensor)
        and t.requires_grad
        and t.untyped_storage().data_ptr() not in params
    }


class _Recorder(fx.Interpreter):
    """Runs node by node, attributing each saved tensor to the node being run."""

    def __init__(self, gm: fx.GraphModule, measured: dict, params: set[int]):
        super().__init__(gm)
        self.measured = measured  # node -> (output, backward, gradient bytes)
        self.params = params
        self.fresh: list[tuple[int, int]] = []  # (storage, bytes) first saved by this node
        self.current: fx.Node | None = None

    def run_node(self, node: fx.Node) -> Any:
        self.current = node
        self.fresh = []
        result = super().run_node(node)
        if node.op in ("call_function", "call_method", "call_module"):
            outputs = _grad_tensors(result, self.params)
            inputs = _grad_tensors([self.env[a] for a in node.all_input_nodes], self.params)
            inside = sum(
                nbytes
                for ptr, nbytes in self.fresh
                if ptr not in inputs and ptr not in outputs and ptr not in self.params
            )
            backward = sum(outputs.values()) + sum(inputs.values()) + inside
            grads = sum(outputs.values())
            self.measured[node] = (_bytes(result), backward if outputs else 0, grads)
            if "val" not in node.meta and isinstance(result, torch.Tensor):
                node.meta["tensor_meta"] = _extract_tensor_metadata(result)
        return result


def _no_backward(_: Any) -> None:
    raise RuntimeError("shape_memory's measuring run has no backward")


def _analysis_tensors(program: Program) -> dict[str, torch.Tensor]:
    """What the measuring run is fed: the program's tensors, its buffers as copies. The
    training IR updates buffers in place (BatchNorm's running statistics, a counter a model
    bumps in forward): a measurement must leave the model as it found it."""
    tensors = program.model_tensors()
    for slot in program.inputs:
        if slot.kind == "buffer" and slot.target in tensors:
            tensors[slot.target] = tensors[slot.target].detach().clone()
    # bf16/fp16 after the chunks took over: the store holds the fp32 masters, the graph was
    # traced in the compute dtype (a later capture, eval or a new shape, measures as it runs)
    for info in program.params:
        for name in info.aliases:
            t = tensors.get(name)
            if t is not None and t.dtype != info.dtype:
                tensors[name] = t.detach().to(info.dtype).requires_grad_(t.requires_grad)
    return tensors


def _fork_rng():
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    return torch.random.fork_rng(devices=devices)


@register
class ShapeMemory(Pass):
    """Analysis: writes NodeMemory to node.meta and a MemoryReport to program.meta."""

    name = "shape_memory"
    needs_export_ir = False

    def __call__(self, program: Program) -> Program:
        fed = _analysis_tensors(program)
        param_storages = {p.untyped_storage().data_ptr() for p in program.model.parameters()} | {
            b.untyped_storage().data_ptr() for b in program.model.buffers()
        }
        # and what the program is fed in their place (tiles, shards a pass derived, buffer copies)
        param_storages |= {t.untyped_storage().data_ptr() for t in fed.values()}
        param_names: dict[int, list[str]] = {}  # storage ptr -> parameter names
        for name, t in fed.items():
            if isinstance(t, torch.nn.Parameter):
                param_names.setdefault(t.untyped_storage().data_ptr(), []).append(name)
        saved_params: dict[fx.Node, list[str]] = {}
        saved: dict[int, tuple[fx.Node | None, int]] = {}  # storage ptr -> (node, bytes)
        keep: list[torch.Tensor] = []  # keeps storages alive so pointers stay unique
        measured: dict[fx.Node, tuple[int, int, int]] = {}
        recorder: _Recorder | None = None

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in param_names and recorder is not None and recorder.current is not None:
                saved_params.setdefault(recorder.current, []).append(param_names[ptr][0])
            if ptr not in saved:
                saved[ptr] = (recorder.current if recorder else None, storage.nbytes())
                keep.append(t)
                if recorder is not None and t.requires_grad:  # a gradient will flow to it
                    recorder.fresh.append((ptr, storage.nbytes()))
            # nothing to give back (no backward runs): a tensor handed back to the graph that
            # saved it would make a cycle through C++ autograd that keeps graph and program
            return None

        def make(gm: fx.GraphModule) -> _Recorder:
            nonlocal recorder
            recorder = _Recorder(gm, measured, param_storages)
            return recorder

        with contextlib.ExitStack() as stack:
            stack.enter_context(_fork_rng())
            stack.enter_context(torch.enable_grad())
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, _no_backward))
            symbolic = program.ir == SYMBOLIC_TRACE
            if symbolic:
                stack.enter_context(buffers_restored(program.model))
            program.run(
                program.example_args,
                program.example_kwargs,
                tensors=None if symbolic else fed,
                apply_mutations=False,
                interpreter=make,
            )
        # autograd keeps the saved-tensor hooks (and what they close over: this recorder, the
        # graph) alive with the tensors of this run; drop them, or nothing is ever freed
        keep.clear()
        recorder = None

        report = MemoryReport(param_bytes=program.param_bytes)
        per_node: dict[fx.Node, NodeMemory] = {}
        for node, (nbytes, backward, grads) in measured.items():
            names = tuple(saved_params.get(node, ()))
            per_node[node] = NodeMemory(out_bytes=nbytes, block=block_of(node), saved_params=names,
                                        backward_bytes=backward, grad_bytes=grads)  # fmt: skip
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
            report.largest_backward = max(report.largest_backward, mem.backward_bytes)
            block = report.blocks.setdefault(mem.block, NodeMemory(block=mem.block))
            for total in (block, report):
                total.out_bytes += mem.out_bytes
                total.saved_bytes += mem.saved_bytes
                total.saved_param_bytes += mem.saved_param_bytes
        program.meta[META_KEY] = report
        return program
