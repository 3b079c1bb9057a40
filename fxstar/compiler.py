"""What an engine compiles for one input signature: capture, agreement, passes, chunks.

`compile_signature` is the recipe; each step is a named function below. A compile is a
transaction: one that raises at any step leaves the model and the engine as it found them
(`rollback_point`), and the model's original parameter storage is given back
(release_after_init) only once every step succeeded.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fxstar import chunk_setup
from fxstar.capture import capture
from fxstar.errors import EngineStateError
from fxstar.model_snapshot import AttributeState, ModelSnapshot
from fxstar.program import Program
from fxstar.release import release_storage
from fxstar.runtime import ops
from fxstar.runtime.chunks import ChunkManager
from fxstar.verify import Verifier

if TYPE_CHECKING:
    from fxstar.engine import Engine

__all__ = ["check_model", "compile_signature"]


def compile_signature(engine: Engine, args: tuple, kwargs: Mapping[str, Any]) -> Program:
    """Capture and passes for one input signature; the first one under the chunk passes also
    moves the parameters into their chunks and writes a meta model's weights."""
    rollback = rollback_point(engine)
    try:
        program, release = _compile_steps(engine, args, kwargs)
    except BaseException:
        rollback()
        raise
    release_storage(release)  # last: nothing can undo it
    return program


def _compile_steps(engine: Engine, args: tuple, kwargs: Mapping[str, Any]
                   ) -> tuple[Program, list[torch.Tensor]]:  # fmt: skip
    """compile_signature's work; also returns the model's tensors whose storage is to be
    given back (release_after_init) once it has all succeeded.

    Why this order: the ranks agree on what each captured before any pass runs, while nothing
    can have failed on one rank only; the verifier's eager baseline is taken from the model
    before the passes rewrite the graph; the chunks take the parameters over only after the
    passes decided their layout; a meta model's weights are written once the parameters are
    views of their chunk homes; the graph's runtimes are bound to the engine's chunks after
    the verifier ran the stages under chunks of its own; data-parallel replicas start as
    rank 0's once every home holds its values; the parameters fed are recorded last, as the
    model holds them once everything is in place."""
    program = _capture(engine, args, kwargs)
    agree_ranks(engine, program)
    check = _verifier(engine, program, args, kwargs)
    program = engine.pass_manager.run(program, check=check)
    first_chunks = engine.chunks is None
    release = chunk_setup.setup_chunks(engine, program)
    chunk_setup.fill_weights(engine)
    _bind_runtimes(program, engine.chunks)
    if first_chunks and engine.chunks is not None:
        chunk_setup.start_chunks(engine.chunks)
    engine._fed = _fed_parameters(engine.model)
    return program, release


def _capture(engine: Engine, args: tuple, kwargs: Mapping[str, Any]) -> Program:
    """The traced model's graph for these inputs, given the engine's store, topology and
    engine-wide decisions (what HybridAdam keeps on the compute tier: a later capture's plan
    counts it)."""
    with torch.enable_grad():
        program = capture(
            engine.traced,
            args,
            kwargs,
            plan=engine.plan,
            dynamic_shapes=engine.dynamic_shapes,
            method=engine.method,
        )
    program.store = engine.store
    program.engine_decisions, program.topology = engine.engine_decisions, engine.topology
    kept = engine.chunks.kept_bytes() if engine.chunks is not None else 0
    engine.engine_decisions.kept_bytes = kept
    return program


def agree_ranks(engine: Engine, program: Program) -> None:
    """Before any pass, while nothing can have failed on one rank only: the ranks agree on
    the plan, the graph and (tensor parallel, first capture) the full parameters over the
    topology's groups, made at the first compile (Topology.agree)."""
    engine.topology.agree(program)


class _CaptureCheck:
    """Stand-in pass so the verifier names the capture when it differs from eager."""

    name = "capture"
    tolerance = None


def _verifier(engine: Engine, program: Program, args: tuple, kwargs: Mapping[str, Any]
              ) -> Verifier | None:  # fmt: skip
    """plan.verify: the eager baseline, and the capture checked against it."""
    if not engine.plan.verify:
        return None
    plan = engine.plan
    check = Verifier(
        engine.traced, args, kwargs, loss_fn=plan.loss_fn, seed=plan.seed or 0,
        runner=functools.partial(_run_for_verify, engine),
    )  # fmt: skip
    check.baseline()
    check(_CaptureCheck(), program)
    return check


def _run_for_verify(engine: Engine, program: Program, args: tuple, kwargs: dict,
                    tensors: dict) -> Any:  # fmt: skip
    """plan.verify runs a chunked stage under a manager of its own, made from the verifier's
    copies; the names it trains are rebound so their gradients are found."""
    plan = program.decisions.chunk_plan
    if plan is None:
        return program.run(args, kwargs, tensors=tensors)
    manager = chunk_setup.chunk_manager(engine, program, tensors)
    for name, stable in manager.stable.items():
        for alias in manager.layout.slots()[name].aliases:
            tensors[alias] = stable
    # bound until the engine binds its own after the passes: the verifier's backward (a
    # region's recomputation) runs after this returns
    _bind_runtimes(program, manager)
    with manager.running(plan):
        return program.run(args, kwargs, tensors=tensors)


def _bind_runtimes(program: Program, manager: ChunkManager | None) -> None:
    """The graph calls this manager, no other (each graph holds its own ChunkRuntime)."""
    for runtime in ops.runtimes(program.graph_module):
        runtime.manager = manager


def rollback_point(engine: Engine) -> Callable[[], None]:
    """What a compile may change, and the function that puts it back: the model (and the
    low-precision copy traced in its place: fxstar/model_snapshot.py), the parameter store,
    the engine-wide pass decisions (the topology's process groups made stay: every rank made
    them), the chunks, the weights' report."""
    models = (engine.model,) if engine.traced is engine.model else (engine.model, engine.traced)
    snapshot = ModelSnapshot(*models)
    # the store's tables, and the parts of each derived parameter (rebind replaces them)
    store = [AttributeState(engine.store), *map(AttributeState, engine.store._derived.values())]
    chunks, decided = engine.chunks, AttributeState(engine.engine_decisions)
    fields = {name: copy.copy(getattr(engine, name))
              for name in ("_weights_line", "_fed", "_buffer_values")}  # fmt: skip

    def rollback() -> None:
        if engine.chunks is not chunks:
            _discard_chunks(engine)
        decided.restore()
        for name, value in fields.items():
            setattr(engine, name, value)
        for state in store:
            state.restore()
        snapshot.restore()

    return rollback


def _discard_chunks(engine: Engine) -> None:
    """A chunk manager made by a compile that raised goes, its homes' values with it (no one
    holds its parameters: close() alone would first copy each out of its home)."""
    chunks, engine.chunks = engine.chunks, None
    with torch.no_grad():
        for stable in chunks.stable.values():
            stable.data = stable.data.new_empty(0)
    chunks.close()


def _parameter_slots(model: nn.Module) -> Iterator[tuple[str, nn.Module, str]]:
    """(name, owning module, attribute) of every parameter, tied ones under each name."""
    for module_name, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is not None:
                yield (f"{module_name}.{attr}" if module_name else attr), module, attr


def _fed_parameters(model: nn.Module) -> list[tuple[str, nn.Module, str, torch.Tensor]]:
    """Every parameter slot of the model and the tensor the engine feeds from it."""
    return [
        (name, module, attr, module._parameters[attr])
        for name, module, attr in _parameter_slots(model)
    ]


def check_model(engine: Engine) -> None:
    """Before every run: the model's parameters are still the tensors this engine trains.
    A new Parameter object (`module.weight = nn.Parameter(...)`) would be silently ignored:
    refused. New values given through `p.data = t` are taken into the chunk homes (a plain
    engine feeds `p` itself and sees them anyway)."""
    for name, module, attr, expected in engine._fed:
        if module._parameters.get(attr) is not expected:
            raise EngineStateError(
                f"parameter {name} of the model was replaced by another tensor after "
                "compile; the engine would go on training the old one. Change values in "
                "place instead (`with torch.no_grad(): p.copy_(new)`, or "
                "engine.load_state_dict), or compile the model again."
            )
    if engine.chunks is not None:
        try:
            engine.chunks.adopt_replaced_data()
        except RuntimeError as error:
            raise EngineStateError(str(error)) from None
