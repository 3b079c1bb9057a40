"""shape_memory: per node, output shape/dtype/bytes and the bytes it saves for backward.

Measured once by running the program's forward on its example inputs node by node under
`saved_tensors_hooks` (no backward; RNG state and buffers untouched). The run is on fake
tensors (FakeTensorMode: shapes, strides and dtypes, no data), so compile time and memory
follow the number of nodes, not of parameters; a program fake tensors cannot run (an op that
needs the data) is measured on real tensors instead, with a warning. Saved tensors are
counted by storage, once, at the first node that saves them; saves of parameter storage
(`linear` saves `weight.t()`) are counted apart, since they cost no activation memory.

Each node also gets `backward_bytes`: what its gradient allocates at once on top of what is
saved — the gradient of its output, of its activation inputs, and of intermediates it saved
inside (cross_entropy's log-softmax): the logits' backward holds two logits-sized gradients.
The peak of a step is where the saved bytes still alive plus this are largest.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from fxstar.dump import NOTES_KEY, target_name
from fxstar.passes import Pass, register
from fxstar.program import SYMBOLIC_TRACE, Program, buffers_restored
from fxstar.runtime import rng_tracker
from fxstar.runtime.offload import offload_region
from fxstar.runtime.recompute import run_region
from fxstar.sizes import format_size

__all__ = [
    "META_KEY",
    "BackwardStep",
    "MemoryReport",
    "NodeMemory",
    "ShapeMemory",
    "backward_peak",
    "block_of",
    "measure",
    "node_steps",
]

META_KEY = "fxstar.shape_memory"
"""node.meta key of the node's NodeMemory (the MemoryReport is program.decisions.shape_memory)."""


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


def _storage_key(t: torch.Tensor) -> int:
    """Which storage `t` is a view of: the address of its StorageImpl, shared by all its views.
    Not `data_ptr()`: a fake tensor has no memory (its data pointer is 0 or refused), but a
    StorageImpl of its own, as a real one has; keys stay unique while the tensors live."""
    return t.untyped_storage()._cdata


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage `t` reaches, [first, last + 1)."""
    start = t.storage_offset() * t.element_size()
    if t.numel() == 0:
        return start, start
    extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1
    return start, start + extent * t.element_size()


def _grad_tensors(value: Any, params: set[int]) -> dict[int, int]:
    """Storage -> bytes of the tensors in `value` that get a gradient, parameters aside."""
    return {
        _storage_key(t): t.numel() * t.element_size()
        for t in pytree.tree_leaves(value)
        if isinstance(t, torch.Tensor) and t.requires_grad and _storage_key(t) not in params
    }


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


class _Recorder(fx.Interpreter):
    """Runs node by node, attributing each saved tensor to the node being run.

    `convert` turns every real tensor that enters the graph (placeholders, get_attr, the state
    of a called module) into what the run computes on: itself, or a fake tensor. Under
    FakeTensorMode nothing real may reach an op: arithmetic on real tensors alone would run
    for real (and write real buffers in place)."""

    def __init__(
        self,
        gm: fx.GraphModule,
        measured: dict,
        params: set[int],
        convert: Callable[[torch.Tensor], torch.Tensor] = _same,
    ):
        super().__init__(gm)
        self.measured = measured  # node -> (output, backward, gradient bytes)
        self.params = params
        self.convert = convert
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
                for key, nbytes in self.fresh
                if key not in inputs and key not in outputs and key not in self.params
            )
            backward = sum(outputs.values()) + sum(inputs.values()) + inside
            grads = sum(outputs.values())
            self.measured[node] = (_bytes(result), backward if outputs else 0, grads)
            if "val" not in node.meta and isinstance(result, torch.Tensor):
                node.meta["tensor_meta"] = _extract_tensor_metadata(result)
        return result

    def placeholder(self, target: Any, args: tuple, kwargs: dict) -> Any:
        value = super().placeholder(target, args, kwargs)
        return pytree.tree_map_only(torch.Tensor, self.convert, value)

    def get_attr(self, target: Any, args: tuple, kwargs: dict) -> Any:
        value = super().get_attr(target, args, kwargs)
        return self.convert(value) if isinstance(value, torch.Tensor) else value

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if target is offload_region:
            # what checkpoint saves goes to the offload's hooks, not to ours: swallow it the
            # same way, without the host copies (and counters) of a real offload
            _, _, region, *inputs = args
            with torch.autograd.graph.saved_tensors_hooks(_discard, _no_backward):
                return run_region(region, *inputs)
        return super().call_function(target, args, kwargs)

    def call_module(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if self.convert is _same:
            return super().call_module(target, args, kwargs)
        # a symbolic_trace leaf (nn.Linear, BatchNorm): run it on fake parameters and buffers
        module = self.fetch_attr(target)
        state = dict(module.named_parameters(remove_duplicate=False))
        state.update(module.named_buffers(remove_duplicate=False))
        state = {name: self.convert(t) for name, t in state.items()}
        return torch.func.functional_call(module, state, args, kwargs)


def _discard(_: torch.Tensor) -> None:
    return None


def _no_backward(_: Any) -> None:
    raise RuntimeError("shape_memory's measuring run has no backward")


def _analysis_tensors(
    program: Program, convert: Callable[[torch.Tensor], torch.Tensor] = _same
) -> tuple[dict[str, torch.Tensor], set[str]]:
    """What the measuring run is fed (each made by `convert` first): the program's tensors, its
    buffers as copies; and the names fed a parameter as it is (not a copy, not a cast). The
    training IR updates buffers in place (BatchNorm's running statistics, a counter a model
    bumps in forward): a measurement must leave the model as it found it."""
    real = program.model_tensors()
    tensors = {name: convert(t) for name, t in real.items()}
    params = {name for name, t in real.items() if isinstance(t, torch.nn.Parameter)}
    for slot in program.inputs:
        if slot.kind == "buffer" and slot.target in tensors:
            tensors[slot.target] = tensors[slot.target].detach().clone()
            params.discard(slot.target)
    # bf16/fp16 after the chunks took over: the store holds the fp32 masters, the graph was
    # traced in the compute dtype (a later capture, eval or a new shape, measures as it runs)
    for info in program.params:
        for name in info.aliases:
            t = tensors.get(name)
            if t is not None and t.dtype != info.dtype:
                tensors[name] = t.detach().to(info.dtype).requires_grad_(t.requires_grad)
                params.discard(name)
    return tensors, params


def _fake_converter(
    mode: FakeTensorMode, device: torch.device
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Real tensor -> its fake (memoized by `mode`: one fake storage per real one, so views
    and tied weights share it); fakes are kept alive with the converter, so storage keys stay
    unique while it is in use. A parameter of a model built on the meta device becomes a fake
    on `device`, where the inputs are (one fake per tensor: tied weights stay one)."""
    made: list[torch.Tensor] = []
    on_meta: dict[int, torch.Tensor] = {}

    def convert(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, FakeTensor):
            return t
        if t.is_meta:
            if id(t) not in on_meta:
                with mode:
                    fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
                on_meta[id(t)] = fake.requires_grad_(t.requires_grad)
                made.append(t)  # its id stays its own while the fake is in use
            return on_meta[id(t)]
        copy = mode.from_tensor(t)
        # a fake storage is made as long as the views seen so far reach; a real one can be
        # longer (a chunk's padding), and a saved view counts all of it
        nbytes = t.untyped_storage().nbytes()
        if copy.untyped_storage().nbytes() < nbytes:
            copy.untyped_storage().resize_(nbytes)
        made.append(copy)
        return copy

    return convert


class _NotFakeable(Exception):
    """The measuring run failed on fake tensors; the message names the op and the node."""


class _Run:
    """One measuring run: what it is fed, the hook that sees every saved tensor, the tallies."""

    def __init__(self, program: Program, convert: Callable[[torch.Tensor], torch.Tensor]):
        self.program, self.convert = program, convert
        self.fed, param_fed = _analysis_tensors(program, convert)
        model_tensors = [*program.model.parameters(), *program.model.buffers()]
        self.param_keys = {_storage_key(convert(t)) for t in model_tensors}
        # and what the program is fed in their place (tiles, shards a pass derived, buffer copies)
        self.param_keys |= {_storage_key(t) for t in self.fed.values()}
        # storage -> (span, name) of each parameter fed from it: once the chunks hold the
        # parameters (a later capture), every parameter of a chunk home views one storage
        self.param_spans: dict[int, list[tuple[int, int, str]]] = {}
        for name, t in self.fed.items():
            if name in param_fed:
                self.param_spans.setdefault(_storage_key(t), []).append((*_span(t), name))
        self.saved_params: dict[fx.Node, list[str]] = {}
        self.saved: dict[int, tuple[fx.Node | None, int]] = {}  # storage -> (node, bytes)
        self.keep: list[torch.Tensor] = []  # keeps storages alive so their keys stay unique
        self.measured: dict[fx.Node, tuple[int, int, int]] = {}
        self.recorder: _Recorder | None = None

    def pack(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = _storage_key(t)
        current = self.recorder.current if self.recorder is not None else None
        if key in self.param_spans and current is not None:
            self.saved_params.setdefault(current, []).append(self.param_name(t))
        if key not in self.saved:
            self.saved[key] = (current, storage.nbytes())
            self.keep.append(t)
            if self.recorder is not None and t.requires_grad:  # a gradient will flow to it
                self.recorder.fresh.append((key, storage.nbytes()))
        # nothing to give back (no backward runs): a tensor handed back to the graph that
        # saved it would make a cycle through C++ autograd that keeps graph and program
        return None

    def param_name(self, t: torch.Tensor) -> str:
        """The parameter a saved tensor of parameter storage views (`linear` saves
        `weight.t()`): the narrowest whose span holds the tensor's (the first fed of tied
        names), else the first it overlaps, else the storage's first."""
        spans = self.param_spans[_storage_key(t)]
        start, stop = _span(t)
        within = [(b - a, i) for i, (a, b, _) in enumerate(spans) if a <= start and stop <= b]
        if within:
            return spans[min(within)[1]][2]
        overlapping = [name for a, b, name in spans if a < stop and start < b]
        return overlapping[0] if overlapping else spans[0][2]

    def _interpreter(self, gm: fx.GraphModule) -> _Recorder:
        self.recorder = _Recorder(gm, self.measured, self.param_keys, self.convert)
        return self.recorder

    def forward(self) -> None:
        program = self.program
        symbolic = program.ir == SYMBOLIC_TRACE
        args, kwargs = pytree.tree_map_only(
            torch.Tensor, self.convert, (program.example_args, program.example_kwargs)
        )
        hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, _no_backward)
        try:
            with torch.enable_grad(), hooks:
                program.run(
                    args,
                    kwargs,
                    tensors=None if symbolic else self.fed,
                    apply_mutations=False,
                    interpreter=self._interpreter,
                )
        finally:
            # autograd keeps the saved-tensor hooks (and what they close over: this run, the
            # graph) alive with the tensors of this run; drop them, or nothing is ever freed
            self.keep.clear()

    def per_node(self) -> dict[fx.Node, NodeMemory]:
        self.recorder = None  # holds the environment of the run: every value it made
        per_node: dict[fx.Node, NodeMemory] = {}
        for node, (nbytes, backward, grads) in self.measured.items():
            names = tuple(self.saved_params.get(node, ()))
            per_node[node] = NodeMemory(out_bytes=nbytes, block=block_of(node),
                                        saved_params=names, backward_bytes=backward,
                                        grad_bytes=grads)  # fmt: skip
        for key, (node, nbytes) in self.saved.items():
            if node is None or node not in per_node:
                continue
            if key in self.param_keys:
                per_node[node].saved_param_bytes += nbytes
            else:
                per_node[node].saved_bytes += nbytes
        return per_node


def _measure(program: Program, *, fake: bool = True) -> dict[fx.Node, NodeMemory]:
    """Run the program's forward once under saved-tensor hooks and measure every node.

    With `fake`, every tensor is a fake copy (shape, strides, dtype, requires_grad) under
    FakeTensorMode: no real compute and no real memory, whatever the parameter count; any
    failure then raises _NotFakeable. Without, the real tensors run (buffers copied first).
    Both give the same numbers (tests/passes/test_shape_memory_fake.py)."""
    run: _Run | None = None
    with contextlib.ExitStack() as stack:
        stack.enter_context(rng_tracker.fork_all(program.graph_module))
        if not fake:
            if program.ir == SYMBOLIC_TRACE:  # it runs on the model's own buffers: restore them
                stack.enter_context(buffers_restored(program.model))
            run = _Run(program, _same)
            run.forward()
            return run.per_node()
        mode = FakeTensorMode()  # no real inputs allowed: a real tensor left over raises
        stack.enter_context(mode)
        try:
            run = _Run(program, _fake_converter(mode, program.compute_device()))
            run.forward()
        except Exception as exc:
            raise _NotFakeable(_failed(exc, run.recorder if run else None)) from exc
    return run.per_node()


def _failed(exc: Exception, recorder: _Recorder | None) -> str:
    """'<op> at node <name> (<error>)', on one line, for the fallback's warning."""
    node = recorder.current if recorder is not None else None
    op = getattr(exc, "func", None) or (target_name(node.target) if node else "the inputs")
    where = f" at node {node.name}" if node is not None else ""
    first = (str(exc).strip().splitlines() or [""])[0].split(". ")[0][:160]
    why = type(exc).__name__ + (f": {first}" if first and first != str(op) else "")
    return f"{op}{where} ({why})"


def measure(program: Program) -> dict[fx.Node, NodeMemory]:
    """NodeMemory per node, measured on fake tensors; on real ones, with a warning, where
    fake tensors cannot run the program (a data-dependent op, a custom op without a fake
    kernel): a slower compile, never a wrong number."""
    try:
        return _measure(program, fake=True)
    except _NotFakeable as exc:
        warnings.warn(
            f"shape_memory: fake tensors cannot run {exc}; measuring with real tensors "
            "(compile time and memory grow with the parameters)",
            stacklevel=2,
        )
        return _measure(program, fake=False)


@register
class ShapeMemory(Pass):
    """Analysis: writes NodeMemory to node.meta and a MemoryReport to program.decisions."""

    name = "shape_memory"
    phase = "analyse"
    needs_export_ir = False

    def __call__(self, program: Program) -> Program:
        per_node = measure(program)
        report = MemoryReport(param_bytes=program.param_bytes)
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
        program.decisions.shape_memory = report
        return program
