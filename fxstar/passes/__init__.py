"""Passes: the Pass protocol, the registry, and the PassManager that orders and runs them.

A pass is a callable on a Program that returns it (usually the same object, changed). It has
a `name` and a `phase`, and declares:
- `requires`: passes that must run before it (pulled in if not asked for);
- `requires_fresh`: analyses it reads that must describe the graph as it is when it runs:
  the manager re-runs one (and records its stage) if a rewrite ran since it last did;
- `before`/`after`: order against other passes of the same phase when both run;
- `rewrites`: it changes the graph; the manager then lints and recompiles every graph of the
  program and refreshes the parameter uses (passes do not), and every analysis is stale;
- `implements`: the plan options whose feature it is (an option nothing implements is refused);
- `tolerance`: None if its result must be bitwise equal to the stage before under
  `plan.verify`, else (rtol, atol).
Phases run in the order of PHASES: `shard` (tensor-parallel sharding: every later analysis
measures one rank's graph), `analyse` (analyses asked for on their own), `restructure`
(tiling, activation checkpointing and offload), `place` (which tier holds what) and
`schedule` (when chunks move). A pass decides first and records the decision on
`program.decisions` (one attribute per pass) before it rewrites; the runtime follows it.
A built-in pass that a plan option turns on says so in `enabled_by(plan)`; `passes_for(plan)`
adds those to what `plan.passes` lists. Every module of this package is a built-in pass and is
imported with it. Passes never import the engine or runtime internals. A pass that crashes
surfaces as a PassError naming it and the node it was at; errors that explain themselves
(FxstarError, PlanError among them) pass through unchanged.
"""

from __future__ import annotations

import heapq
import importlib
import pkgutil
import time
from collections.abc import Callable, Iterable, Sequence
from graphlib import CycleError, TopologicalSorter
from typing import Any, Protocol, runtime_checkable

from torch import fx

from fxstar.dump import target_name
from fxstar.errors import FxstarError, IRError, PassOrderError
from fxstar.plan import check_option_names
from fxstar.program import EXPORT, Program

PHASES = ("shard", "analyse", "restructure", "place", "schedule")

__all__ = [
    "PHASES",
    "FunctionPass",
    "Pass",
    "PassError",
    "PassLike",
    "PassManager",
    "get",
    "ensure_fresh",
    "implemented_options",
    "is_fresh",
    "load_builtins",
    "passes_for",
    "register",
    "registered",
    "unregister",
]


@runtime_checkable
class PassLike(Protocol):
    """What the PassManager needs of a pass; `Pass` is a convenient base class for it."""

    name: str
    requires: tuple[str, ...]
    before: tuple[str, ...]
    after: tuple[str, ...]
    tolerance: tuple[float, float] | None

    def __call__(self, program: Program) -> Program: ...


class Pass:
    """Base class for passes: set the class attributes, implement `__call__`.

    `needs_export_ir` makes the PassManager refuse Programs captured by symbolic_trace (whose
    parameters are get_attr/call_module, not placeholders) with a clear IRError.
    """

    name: str = ""
    phase: str = "analyse"
    rewrites: bool = False
    requires: tuple[str, ...] = ()
    requires_fresh: tuple[str, ...] = ()
    before: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    implements: tuple[str, ...] = ()
    tolerance: tuple[float, float] | None = None
    needs_export_ir: bool = True

    def enabled_by(self, plan: Any) -> bool:
        """True when the plan's options ask for this pass without naming it in plan.passes."""
        return False

    def __call__(self, program: Program) -> Program:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<pass {self.name}>"


class FunctionPass(Pass):
    """A plain function `f(program) -> program | None` made into a Pass."""

    def __init__(
        self,
        fn: Callable[[Program], Program | None],
        *,
        name: str | None = None,
        phase: str = "analyse",
        rewrites: bool = False,
        requires: Iterable[str] = (),
        requires_fresh: Iterable[str] = (),
        before: Iterable[str] = (),
        after: Iterable[str] = (),
        implements: Iterable[str] = (),
        tolerance: tuple[float, float] | None = None,
        needs_export_ir: bool = True,
    ):
        self.fn = fn
        self.name = name or fn.__name__
        self.phase, self.rewrites = phase, rewrites
        self.requires, self.before, self.after = tuple(requires), tuple(before), tuple(after)
        self.requires_fresh, self.implements = tuple(requires_fresh), tuple(implements)
        self.tolerance = tolerance
        self.needs_export_ir = needs_export_ir
        self.__doc__ = fn.__doc__

    def __call__(self, program: Program) -> Program:
        result = self.fn(program)
        return program if result is None else result


_REGISTRY: dict[str, PassLike] = {}


def register(obj: Any = None, /, *, replace: bool = False, **options: Any) -> Any:
    """Register a pass by name; usable as `@register`, `@register(...)` or `register(p)`.

    A class is instantiated without arguments; a function becomes a FunctionPass (keyword
    options: name, phase, rewrites, requires, requires_fresh, before, after, implements,
    tolerance, needs_export_ir); an instance is
    registered as is. A name already taken is an error unless `replace=True`.
    Returns what it was given, so decorated classes and functions stay usable.
    """

    def add(target: Any) -> Any:
        if isinstance(target, type):
            instance = target()
        elif isinstance(target, PassLike):
            instance = target
        elif callable(target):
            instance = FunctionPass(target, **options)
        else:
            raise TypeError(f"cannot register {target!r} as a pass")
        if not isinstance(instance, PassLike) or not instance.name:
            raise TypeError(f"{target!r} is not a pass: it needs a name and the Pass attributes")
        if instance.name in _REGISTRY and not replace:
            raise ValueError(f"a pass named {instance.name!r} is already registered")
        check_option_names(getattr(instance, "implements", ()), f"pass {instance.name!r}")
        if phase_of(instance) not in PHASES:
            raise ValueError(
                f"pass {instance.name!r}: phase {phase_of(instance)!r} is not one of {PHASES}"
            )
        _REGISTRY[instance.name] = instance
        return target

    return add if obj is None else add(obj)


def unregister(name: str) -> None:
    """Remove a registered pass (tests and interactive sessions)."""
    _REGISTRY.pop(name, None)


def get(name: str) -> PassLike:
    """The registered pass called `name`."""
    load_builtins()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise PassOrderError(_unknown_message([name])) from None


def registered() -> dict[str, PassLike]:
    """Name -> pass of every registered pass."""
    load_builtins()
    return dict(_REGISTRY)


def load_builtins() -> None:
    """Import every module of fxstar.passes: each registers its pass on import."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


def passes_for(plan: Any) -> list[str | PassLike]:
    """What runs under `plan`: the passes it names, then the built-ins its options enable."""
    load_builtins()
    named = list(plan.passes)
    enabled = [
        name
        for name, p in _REGISTRY.items()
        if name not in named and getattr(p, "enabled_by", lambda _plan: False)(plan)
    ]
    return [*named, *enabled]


def implemented_options() -> set[str]:
    """The plan options some registered pass implements (`Pass.implements`)."""
    load_builtins()
    return {option for p in _REGISTRY.values() for option in getattr(p, "implements", ())}


def phase_of(p: PassLike) -> str:
    return getattr(p, "phase", "analyse")


def rewrites(name: str) -> bool:
    """Does a stage called `name` made by a pass come from a rewrite?"""
    p = _REGISTRY.get(name)
    return p is not None and getattr(p, "rewrites", False)


def is_fresh(program: Program, name: str) -> bool:
    """Has analysis `name` run since the last rewrite of the program's graph (capture made
    the graph; the engine's own records change nothing)?"""
    for stage in reversed(program.stages):
        if stage.by == "pass" and stage.name == name:
            return True
        if stage.by == "capture" or (stage.by == "pass" and rewrites(stage.name)):
            return False
    return False


def _unknown_message(names: Sequence[str]) -> str:
    known = ", ".join(sorted(_REGISTRY)) or "none"
    return f"unknown pass name(s): {', '.join(names)}; registered passes: {known}"


class PassError(FxstarError, RuntimeError):
    """A pass crashed. Names the pass and, where it can tell, the node it was at (a `node`
    attribute of the error, else the innermost frame of the traceback holding an fx.Node);
    the original is `__cause__`. `program` is the Program the pass was given: its last stage
    is the graph the pass saw (`fxstar.dump(error.program)`)."""

    def __init__(self, pass_name: str, original: Exception, program: Program):
        self.pass_name = pass_name
        self.program = program
        node = _failing_node(original)
        self.node = None if node is None else node.name
        first = str(original).strip().splitlines()
        lines = [f"pass {pass_name!r} failed: {type(original).__name__}: "
                 f"{first[0] if first else ''}"]  # fmt: skip
        if node is not None:
            lines.append(f"  at node: {_describe(node)}")
        if program.stages:
            lines.append(
                f"  graph it was given: stage {program.stages[-1].name!r} "
                "(print it with fxstar.dump(error.program))"
            )
        lines.append(
            f"  try: compile without {pass_name!r} (drop it from plan.passes, or the plan option "
            "that turns it on); a crash in a pass of fxstar's own is a bug: report it with that "
            "graph"
        )
        super().__init__("\n".join(lines))


def _failing_node(error: BaseException) -> fx.Node | None:
    """The node the error names (`error.node`), else the innermost traceback frame's fx.Node
    local (one called `node` first): the node the failing code was working on."""
    node = getattr(error, "node", None)
    if isinstance(node, fx.Node):
        return node
    found = None
    tb = error.__traceback__
    while tb is not None:
        local = tb.tb_frame.f_locals
        nodes = [v for v in local.values() if isinstance(v, fx.Node)]
        if isinstance(local.get("node"), fx.Node):
            found = local["node"]
        elif nodes:
            found = nodes[0]
        tb = tb.tb_next
    return found


def _describe(node: fx.Node) -> str:
    what = node.op if node.op in ("placeholder", "output", "get_attr") else target_name(node.target)
    stack = list((node.meta.get("nn_module_stack") or {}).values())
    return f"{node.name} ({what}" + (f" @{stack[-1][0]})" if stack and stack[-1][0] else ")")


Check = Callable[[PassLike, Program], None]


class PassManager:
    """Orders passes by phase and constraints and runs them, recording a stage after each.

    Passes are given by name (looked up in the registry) or as pass objects. Required passes
    are added; inside a phase, among passes with no constraint between them the given order is
    kept. Unknown names, duplicates, cycles and constraints against the phase order raise
    PassOrderError naming the passes involved; `before`/`after` names of passes that are not
    registered are ignored.
    """

    def __init__(self, passes: Iterable[str | PassLike] = ()):
        load_builtins()
        self.passes = self._resolve(list(passes))
        self.order = self._sort(self.passes)

    @staticmethod
    def _resolve(items: list[str | PassLike]) -> list[PassLike]:
        chosen: dict[str, PassLike] = {}
        unknown = [i for i in items if isinstance(i, str) and i not in _REGISTRY]
        if unknown:
            raise PassOrderError(_unknown_message(unknown))
        for item in items:
            p = _REGISTRY[item] if isinstance(item, str) else item
            if p.name in chosen:
                raise PassOrderError(f"pass {p.name!r} is listed twice")
            chosen[p.name] = p
        pending = list(chosen.values())
        while pending:  # pull in what is required, transitively
            p = pending.pop()
            fresh = getattr(p, "requires_fresh", ())
            missing = [r for r in (*p.requires, *fresh) if r not in chosen and r not in _REGISTRY]
            if missing:
                raise PassOrderError(f"pass {p.name!r} requires {_unknown_message(missing)}")
            for r in p.requires:
                if r not in chosen:
                    chosen[r] = _REGISTRY[r]
                    pending.append(chosen[r])
                if PHASES.index(phase_of(chosen[r])) > PHASES.index(phase_of(p)):
                    raise PassOrderError(
                        f"pass {p.name!r} (phase {phase_of(p)}) requires {r!r}, which runs "
                        f"later (phase {phase_of(chosen[r])}); phases run in the order {PHASES}"
                    )
        # before/after may name passes that are not registered (yet): they order nothing
        return list(chosen.values())

    @staticmethod
    def _sort(passes: list[PassLike]) -> list[PassLike]:
        names = {p.name: i for i, p in enumerate(passes)}
        rank = {p.name: PHASES.index(phase_of(p)) for p in passes}
        preds: dict[str, set[str]] = {p.name: set() for p in passes}

        def edge(first: str, then: str) -> None:
            if first not in names:
                return
            if rank[first] > rank[then]:
                raise PassOrderError(
                    f"pass {then!r} (phase {PHASES[rank[then]]}) is to run after {first!r} "
                    f"(phase {PHASES[rank[first]]}), but phases run in the order {PHASES}"
                )
            if rank[first] == rank[then]:  # across phases the phase order decides
                preds[then].add(first)

        for p in passes:
            for other in (*p.requires, *p.after):
                edge(other, p.name)
            for other in p.before:
                if other in names:
                    edge(p.name, other)
        try:
            TopologicalSorter(preds).prepare()
        except CycleError as error:
            cycle = " -> ".join(error.args[1])
            raise PassOrderError(f"passes form an ordering cycle: {cycle}") from None
        # Kahn's algorithm, earliest phase then smallest given position first: stable.
        waiting = {n: set(s) for n, s in preds.items()}
        ready = [(rank[n], names[n], n) for n, s in waiting.items() if not s]
        heapq.heapify(ready)
        order = []
        while ready:
            _, _, name = heapq.heappop(ready)
            order.append(passes[names[name]])
            for other, s in waiting.items():
                if name in s:
                    s.discard(name)
                    if not s:
                        heapq.heappush(ready, (rank[other], names[other], other))
        return order

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.order]

    def run(self, program: Program, *, check: Check | None = None) -> Program:
        """Run every pass in order, record a stage after each, then call `check(pass, program)`.

        Before a pass, the analyses it `requires_fresh` are re-run if a rewrite ran since
        (each records its stage and is checked like any pass); after a rewrite the program's
        graphs are linted and recompiled and its parameter uses refreshed.
        `check` is how verification hooks in (see fxstar.verify) without passes knowing it.
        A pass that raises anything but an error that explains itself raises PassError.
        """
        for p in self.order:
            for name in getattr(p, "requires_fresh", ()):
                program = ensure_fresh(program, name, check=check)
            program = run_one(p, program, check)
        return program

    def __repr__(self) -> str:
        return f"PassManager({self.names})"


def ensure_fresh(program: Program, name: str, *, check: Check | None = None) -> Program:
    """Run analysis `name` unless it ran since the last rewrite (its stage recorded): what
    the manager does for `requires_fresh`, for callers outside a run (fxstar.estimate)."""
    return program if is_fresh(program, name) else run_one(get(name), program, check)


def run_one(p: PassLike, program: Program, check: Check | None) -> Program:
    """Run one pass: the IR checked, its stage recorded and timed, `check` called."""
    if getattr(p, "needs_export_ir", True) and program.ir != EXPORT:
        raise IRError(
            f"pass {p.name!r} needs the torch.export IR (parameters as placeholders), "
            f"but the program was captured with {program.ir}; capture with "
            "method='export' or drop the pass"
        )
    start = time.perf_counter()
    try:
        result = p(program)
        program = program if result is None else result
        if getattr(p, "rewrites", False):
            finalise(program)
    except FxstarError:
        raise
    except Exception as error:
        raise PassError(p.name, error, program) from error
    program.record(p.name)
    program.timings[p.name] = program.timings.get(p.name, 0.0) + time.perf_counter() - start
    if check is not None:
        check(p, program)
    return program


def finalise(program: Program) -> None:
    """After a rewrite: every graph of the program (regions are GraphModules inside it)
    linted and recompiled, the parameter table's first/last uses refreshed."""
    for module in program.graph_module.modules():
        if isinstance(module, fx.GraphModule):
            module.graph.lint()
            module.recompile()
    program.refresh_param_uses()
