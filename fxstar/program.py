"""Program: the captured graph, its parameter table, the plan, and the history of every stage.

Passes take a Program and return it; each pass's result is recorded as a Stage (the printed
graph after it) so that any two stages can be dumped and diffed. A Program can run itself on
the model's tensors, so analysis passes and verification need nothing but the Program.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from fxstar.decisions import Decisions, EngineDecisions
from fxstar.params import ParameterStore
from fxstar.topology import Topology

__all__ = ["InputSlot", "ParamInfo", "Program", "Stage"]

EXPORT = "export"
SYMBOLIC_TRACE = "symbolic_trace"


@dataclass
class Stage:
    """One step of a Program's history: the pass that produced it and the printed graph.
    `by` is what made it: 'pass', 'capture', or 'engine' (a record of the engine's own)."""

    name: str
    text: str
    after: tuple[str, ...] = ()
    graph_module: fx.GraphModule | None = None
    by: str = "pass"


@dataclass
class ParamInfo:
    """One parameter tensor; tied parameters are one entry with several aliases.

    `placeholders` are the graph nodes that bring it in (placeholders in the export IR;
    get_attr or call_module nodes under symbolic_trace). `first_use`/`last_use` are the
    names of the first and last graph nodes that read it, in execution order (None when the
    graph never reads it).
    """

    name: str
    aliases: tuple[str, ...]
    placeholders: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = True
    first_use: str | None = None
    last_use: str | None = None
    chunk: int | None = None  # where chunk_layout put it: chunk id and element offset
    chunk_offset: int | None = None
    host_resident: bool = False  # kept out of the chunks, on the host (cpu_embedding)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class InputSlot:
    """What feeds one placeholder: kind is 'parameter', 'buffer', 'constant' or 'input'.

    `target` is the model's name of the parameter or buffer, or the key into
    `Program.constants`; None for user inputs.
    """

    kind: str
    node: str
    target: str | None = None


@dataclass
class Program:
    """The captured training graph and everything needed to run, analyse and print it.

    `ir` is 'export' (torch.export training IR: parameters, buffers and constants are
    placeholders fed from `inputs`) or 'symbolic_trace' (parameters are `get_attr` of the
    graph module itself, which shares the model's tensors).
    """

    graph_module: fx.GraphModule
    model: nn.Module
    plan: Any
    ir: str = EXPORT
    inputs: list[InputSlot] = field(default_factory=list)
    constants: dict[str, Any] = field(default_factory=dict)
    mutations: list[InputSlot] = field(default_factory=list)
    in_spec: pytree.TreeSpec | None = None
    out_spec: pytree.TreeSpec | None = None
    params: list[ParamInfo] = field(default_factory=list)
    example_args: tuple = ()
    example_kwargs: dict[str, Any] = field(default_factory=dict)
    training: bool = True
    stages: list[Stage] = field(default_factory=list)
    # what each pass decided, one typed attribute per pass (fxstar.decisions)
    decisions: Decisions = field(default_factory=Decisions)
    # seconds spent per compile phase: "export", then "capture" (all of capture), then each pass
    timings: dict[str, float] = field(default_factory=dict)
    # what parameter/buffer placeholders are fed from; the Engine's store, shared by its
    # captures (None: the model's own tensors)
    store: ParameterStore | None = None
    # what the first capture of an engine decided for every capture: the Engine hands each
    # Program the same object
    engine_decisions: EngineDecisions = field(default_factory=EngineDecisions)
    # the ranks, their process groups and what follows (fxstar/topology.py): the Engine's;
    # None: one made from the plan over this process's world
    topology: Topology | None = None

    def __post_init__(self) -> None:
        if self.topology is None:
            self.topology = Topology(self.plan)

    # -- parameters -----------------------------------------------------------------------------

    def param(self, name: str) -> ParamInfo:
        """The table entry of a parameter, by any of its names or placeholder names."""
        for info in self.params:
            if name in info.aliases or name in info.placeholders:
                return info
        raise KeyError(f"no parameter {name!r} in the program")

    @property
    def param_bytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    def add_input(self, kind: str, target: str, name: str) -> fx.Node:
        """A new placeholder (after the existing ones) fed from `target`: a parameter or
        buffer name of the store, or a key of `constants`. Rewrite passes use it to feed
        tensors they derived (tiles, shards)."""
        graph = self.graph_module.graph
        last = [n for n in graph.nodes if n.op == "placeholder"][-1]
        with graph.inserting_after(last):
            node = graph.placeholder(name)
        self.inputs.append(InputSlot(kind, node.name, target))
        return node

    def remove_input(self, node: fx.Node) -> None:
        """Drop a placeholder nobody reads any more, and what fed it."""
        self.remove_inputs([node])

    def remove_inputs(self, nodes: list[fx.Node]) -> None:
        """Drop placeholders nobody reads any more, and what fed them: all at once, one pass
        over the inputs (a deep model's chunk schedule drops hundreds)."""
        for node in nodes:
            if node.users:
                raise ValueError(f"placeholder {node.name} still has users: {list(node.users)}")
        names = {node.name for node in nodes}
        self.inputs = [slot for slot in self.inputs if slot.node not in names]
        for node in nodes:
            self.graph_module.graph.erase_node(node)

    def placeholder_kinds(self) -> dict[str, InputSlot]:
        """Placeholder node name -> the slot that feeds it."""
        return {slot.node: slot for slot in self.inputs}

    def refresh_param_uses(self) -> None:
        """Recompute first/last use of every parameter (the PassManager calls it after each
        rewrite). Once the chunks own the parameters (their placeholders are gone) the table
        keeps the uses and the order it had last."""
        order = {node: i for i, node in enumerate(self.graph_module.graph.nodes)}
        by_name = {node.name: node for node in order}
        if any(not any(p in by_name for p in info.placeholders) for info in self.params):
            return
        for info in self.params:
            users = [u for p in info.placeholders if p in by_name for u in _uses(by_name[p])]
            users = [u for u in users if u.op != "output"]
            if users:
                users.sort(key=order.__getitem__)
                info.first_use, info.last_use = users[0].name, users[-1].name
            else:
                info.first_use = info.last_use = None
        self.params.sort(key=lambda p: _use_key(p, by_name, order))

    # -- history --------------------------------------------------------------------------------

    def record(self, name: str, *, keep_graph: bool = False, by: str = "pass") -> Stage:
        """Print the graph as it is now and append it to the history as stage `name`."""
        from fxstar.dump import format_graph  # printing lives with dump; imported late

        stage = Stage(
            name=name,
            text=format_graph(self),
            after=tuple(s.name for s in self.stages),
            graph_module=_snapshot(self.graph_module) if keep_graph else None,
            by=by,
        )
        self.stages.append(stage)
        return stage

    def passes_run(self) -> list[str]:
        """The passes that ran, in order, an analysis as often as the manager ran it (a rewrite
        made it stale for a pass that needs it fresh)."""
        return [s.name for s in self.stages if s.by == "pass"]

    def stage(self, key: int | str | None = None) -> tuple[int, Stage]:
        """(index, stage) for an index, a stage's name, or None (the last). A name that several
        stages have (an analysis re-run after a rewrite) is refused, listing them by number:
        which one is meant is the caller's to say."""
        if not self.stages:
            raise LookupError("the program has no recorded stages")
        if key is None:
            return len(self.stages) - 1, self.stages[-1]
        if isinstance(key, int):
            index = key if key >= 0 else len(self.stages) + key
            if not 0 <= index < len(self.stages):
                raise LookupError(f"no stage {key}; the program has {len(self.stages)}")
            return index, self.stages[index]
        found = [i for i, s in enumerate(self.stages) if s.name == key]
        if len(found) == 1:
            return found[0], self.stages[found[0]]
        if found:
            which = "; ".join(
                f"{i} (after {self.stages[i - 1].name})" if i else f"{i}" for i in found
            )
            raise LookupError(
                f"{len(found)} stages are named {key!r}: {which}; give the stage's number"
            )
        names = ", ".join(s.name for s in self.stages)
        raise LookupError(f"no stage named {key!r}; stages: {names}")

    # -- running --------------------------------------------------------------------------------

    def compute_device(self) -> torch.device:
        """Where the graph computes: its example inputs' device, else its parameters' (a model
        built on the meta device computes where its inputs are)."""
        for x in pytree.tree_leaves((self.example_args, self.example_kwargs)):
            if isinstance(x, torch.Tensor):
                return x.device
        for t in self.model_tensors().values():
            if not t.is_meta:
                return t.device
        return torch.device("cpu")

    def model_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors fed by name: the store's, else the model's parameters and buffers
        by every name (aliases included)."""
        if self.store is not None:
            return self.store.tensors()
        tensors: dict[str, torch.Tensor] = dict(self.model.named_parameters(remove_duplicate=False))
        tensors.update(self.model.named_buffers(remove_duplicate=False))
        return tensors

    def run(
        self,
        args: tuple = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        tensors: Mapping[str, torch.Tensor] | None = None,
        apply_mutations: bool = True,
        interpreter: Callable[[fx.GraphModule], fx.Interpreter] | None = None,
    ) -> Any:
        """Run the graph on `args`/`kwargs` and return what the model returns.

        `tensors` maps parameter/buffer names to the tensors to feed (default: the model's
        own, so gradients land in the model's `.grad`). Buffer mutations (BatchNorm's running
        stats) are copied into the fed buffers unless `apply_mutations` is False.
        `interpreter` builds an fx.Interpreter to run the graph node by node (analysis).
        """
        kwargs = dict(kwargs or {})
        if self.ir == SYMBOLIC_TRACE:
            if tensors is not None:
                raise ValueError("a symbolic_trace Program runs on the model's own tensors only")
            if interpreter is not None:
                flat, _ = pytree.tree_flatten((args, kwargs))
                return interpreter(self.graph_module).run(*flat)
            return self.graph_module(*args, **kwargs)
        flat_inputs = self.flat_inputs(args, kwargs, tensors)
        if interpreter is not None:
            flat_out = interpreter(self.graph_module).run(*flat_inputs)
        else:
            flat_out = self.graph_module(*flat_inputs)
        if not isinstance(flat_out, list | tuple):
            flat_out = (flat_out,)
        n = len(self.mutations)
        if apply_mutations and n:
            fed = self.model_tensors() if tensors is None else tensors
            with torch.no_grad():
                for slot, value in zip(self.mutations, flat_out[:n], strict=True):
                    fed[slot.target].copy_(value)
        return pytree.tree_unflatten(list(flat_out[n:]), self.out_spec)

    def flat_inputs(
        self,
        args: tuple,
        kwargs: Mapping[str, Any],
        tensors: Mapping[str, torch.Tensor] | None = None,
    ) -> list[Any]:
        """The placeholder values in graph order for one call."""
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        if self.in_spec is not None and spec != self.in_spec:
            raise TypeError(
                "inputs do not match the captured signature\n"
                f"  captured: {self.in_spec}\n  got: {spec}"
            )
        tensors = self.model_tensors() if tensors is None else tensors
        user = iter(leaves)
        flat = []
        for slot in self.inputs:
            if slot.kind == "input":
                flat.append(next(user))
            elif slot.kind == "constant":
                flat.append(self.constants[slot.target])
            elif slot.target in tensors:
                flat.append(tensors[slot.target])
            else:
                raise KeyError(
                    f"placeholder {slot.node} is fed from {slot.target!r}, which is not among "
                    "the tensors fed (a pass that derives or removes a parameter must replace "
                    "every use of its placeholder)"
                )
        return flat


@contextlib.contextmanager
def buffers_restored(model: nn.Module) -> Iterator[None]:
    """Put the model's buffer values back afterwards: running it to trace or measure (the
    symbolic tracer runs in-place buffer updates for real) must leave it as it was."""
    buffers = list(model.buffers())
    saved = [b.detach().clone() for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in zip(buffers, saved, strict=True):
                b.copy_(value)


def _uses(node: fx.Node) -> list[fx.Node]:
    """Nodes that read a parameter brought in by `node` (a call_module reads its own)."""
    return [node] if node.op == "call_module" else list(node.users)


def _use_key(info: ParamInfo, by_name: dict, order: dict) -> tuple[int, int]:
    if info.first_use is None:
        return (1, 0)
    return (0, order[by_name[info.first_use]])


def _snapshot(gm: fx.GraphModule) -> fx.GraphModule:
    import copy

    return copy.deepcopy(gm)
