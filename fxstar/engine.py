"""Engine: runs the compiled training graph as a callable nn.Module, and steps the optimizer.

The Engine feeds the model's own parameter tensors into the captured graph, so gradients
land in the model's `.grad`, `engine.parameters()` are the model's parameters under the
model's names, and every capture (one per input signature) shares them: nothing is copied
per shape. Backward is ordinary autograd: `engine(idx, targets).backward()`.

Capture cache key: (training mode, structure of the inputs, and per tensor input its shape
-- or only its rank under `dynamic_shapes` -- dtype, device and requires_grad; non-tensor
inputs by value, since export specialises on them). Grad mode is not part of the key: the
training IR records no autograd decisions, so one capture serves `torch.no_grad()` too;
eval mode (dropout off) is a separate capture.

What compiles lives in fxstar/compiler.py (one input signature) with fxstar/chunk_setup.py
(the chunks taking the parameters over) and fxstar/chunk_plans.py (the plan a run follows);
what trains in fxstar/training_step.py (the optimizer and its update) and
fxstar/step_lock.py (a step belongs to one thread); this module is the facade.
"""

from __future__ import annotations

import contextlib
import functools
import os
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from fxstar import chunk_setup, compiler, model_owner, placement
from fxstar.chunk_plans import REFINED_STAGE as REFINED_STAGE  # the stage's name, re-exported
from fxstar.chunk_plans import plan_for_run
from fxstar.compute_copy import (
    COMPUTE_DTYPES,
    builds_cache,
    graph_inputs,
    low_precision_copy,
    mirror_buffers,
    scale_loss,
)
from fxstar.decisions import EngineDecisions
from fxstar.engine_report import memory_timeline, report
from fxstar.errors import EngineStateError
from fxstar.estimate import Estimate, estimate
from fxstar.model_snapshot import ModelSnapshot
from fxstar.params import ParameterStore
from fxstar.passes import PassManager, passes_for
from fxstar.passes import implemented_options as pass_options
from fxstar.passes.chunk_layout import check_chunk_options
from fxstar.program import EXPORT, Program
from fxstar.runtime.chunks import ChunkManager
from fxstar.runtime.layout import ChunkPlan
from fxstar.runtime.loss_scale import LossScaler
from fxstar.runtime.state_guard import StateGuard
from fxstar.runtime.step_check import begin_forward
from fxstar.step_lock import StepLock, whole_state
from fxstar.topology import Topology
from fxstar.training_step import make_optimizer, update

__all__ = ["Engine", "compile"]

# the plan options the engine itself implements (the passes declare theirs): the optimizer,
# verification, mixed precision (chunks in bf16/fp16, fp32 masters) and HybridAdam
ENGINE_OPTIONS = ("optimizer", "passes", "verify", "loss_fn", "seed", "device",
                  "precision", "loss_scale", "hybrid_adam", "margin_use_ratio",
                  "data_parallel", "data_parallel_shard", "release_after_init", "disk")  # fmt: skip


def implemented_options() -> set[str]:
    """Every plan option with a feature behind it: the engine's and every registered pass's."""
    return set(ENGINE_OPTIONS) | pass_options()


class Engine(nn.Module):
    """A compiled model: call it like the model, then `loss.backward()` and `engine.step()`."""

    def __init__(
        self,
        model: nn.Module,
        plan: Any,
        *,
        dynamic_shapes: Any = None,
        method: str = EXPORT,
        weights: placement.Weights = None,
    ):
        super().__init__()
        # Not a registered submodule: parameter and state_dict names stay the model's own.
        object.__setattr__(self, "model", model)
        self.plan = plan
        # a model built on the meta device: its weights are written once the chunks exist
        self._weights = weights
        self._unfilled_buffers = chunk_setup.buffers_to_fill(model, plan, weights)
        self._weights_line: str | None = None
        self._local_depth = 0  # inside _local_state_dicts: the model's own, not gathered
        # the ranks and their process groups (made at the first compile, gone with the engine)
        self.topology = Topology(plan)
        weakref.finalize(self, self.topology.release).atexit = False
        # under torchrun: the replicas this process is one of (runtime/data_parallel.py)
        self.data_parallel_size = self.topology.data_parallel_size
        self.device = placement.place(model, plan)  # the compute device (None: the model's)
        self.dynamic_shapes = dynamic_shapes
        self.method = method
        self.pass_manager = PassManager(passes_for(plan))
        self.programs: dict[tuple, Program] = {}
        self.training = model.training
        self.compute_dtype = COMPUTE_DTYPES[plan.precision]
        # What capture traces: the model itself, or for bf16/fp16 a copy in that precision
        # (fxstar/compute_copy.py); the model keeps the fp32 masters.
        low = plan.precision != "fp32"
        self.traced = low_precision_copy(model, self.compute_dtype) if low else model
        self.store = ParameterStore(self.traced)
        # the low-precision copy's buffers as last mirrored into the model's (mirror_buffers)
        self._buffer_values = {n: b.clone() for n, b in self.traced.named_buffers()} if low else {}
        self.scaler = LossScaler.from_config(plan.loss_scale) if plan.precision == "fp16" else None
        self.engine_decisions = EngineDecisions()  # what every capture of this engine follows
        self._optimizer: torch.optim.Optimizer | None = None
        self.chunks: ChunkManager | None = None  # set up by the chunk passes' first compile
        self._micro_steps = 0
        self._registered_state: dict[str, Any] = {}  # saved with checkpoints (scheduler, ...)
        if plan.verify and method != EXPORT:
            raise ValueError("plan.verify needs method='export' (it feeds cloned parameters)")
        model_owner.claim(model, self)
        self._closed = False
        self._builds_cache = builds_cache(model)
        self.step_lock = StepLock()  # forward and step: one thread at a time, a step its own
        # a step or load stopped halfway: nothing reads or trains on what it left (the model
        # records it too, for a compile of it after this engine is closed)
        self.state_guard = StateGuard(functools.partial(model_owner.record_half_written, model))
        self._fed: list[tuple[str, nn.Module, str, torch.Tensor]] = []  # compiler.check_model
        # sharded payloads: the chunk plans the ranks agreed on, by id (held: ids stay theirs)
        self._agreed_plans: dict[int, ChunkPlan] = {}

    # -- running ------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise EngineStateError("the engine was closed; compile the model again to train on")
        with self.step_lock:
            self.step_lock.refuse_other_threads_step()
            self.state_guard.check("engine forward")
            output = self._forward(args, kwargs)
            if torch.is_grad_enabled():  # a graph to run backward on: this thread's step
                self.step_lock.open_step()
            return output

    def _forward(self, args: tuple, kwargs: Mapping[str, Any]) -> Any:
        """One run of the graph for these inputs.

        Why this order: the ranks check they are in step before anything collective runs;
        the inputs are converted before their signature picks the program (the capture key
        is of what the graph takes); the model is checked before a compile records what it
        feeds; the replicas' buffers are made alike before the run reads them; the run
        follows its chunk plan as refined and agreed just before it; the buffers the run
        changed are mirrored, and fp16's loss scaled, once it returned."""
        begin_forward(self, args, kwargs)  # ranks out of step raise (runtime/step_check)
        args, kwargs = self._graph_inputs(args, kwargs)
        compiler.check_model(self)
        program = self._program_for(args, kwargs)
        groups = self.chunks.data_parallel if self.chunks is not None else None
        if groups is not None and torch.is_grad_enabled():  # DDP's broadcast_buffers
            groups.broadcast(list(self.traced.buffers()), "the buffers")
        if self.chunks is None or program.decisions.chunk_plan is None:
            output = program.run(args, kwargs)
        else:
            with self.chunks.running(plan_for_run(self, program)):
                output = program.run(args, kwargs)
        if self.traced is not self.model:
            mirror_buffers(self.model, self.traced, self._buffer_values)
        if self.scaler is not None and torch.is_grad_enabled():
            output = scale_loss(output, self.scaler.scale)
        return output

    def _graph_inputs(self, args: tuple, kwargs: Mapping[str, Any]) -> tuple[tuple, dict]:
        """What the graph is called with (fxstar/compute_copy.py): no KV cache built, bf16/fp16
        floating-point inputs in the compute dtype, tensors on plan.device when one is set."""
        dtype = self.compute_dtype if self.traced is not self.model else None
        return graph_inputs(args, kwargs, no_cache=self._builds_cache, dtype=dtype,
                            device=self.device)  # fmt: skip

    def prepare(self, *args: Any, **kwargs: Any) -> Program:
        """The Program for these inputs, captured (and passes run) if not cached yet."""
        with self.step_lock:
            return self._program_for(*self._graph_inputs(args, kwargs))

    def _program_for(self, args: tuple, kwargs: Mapping[str, Any]) -> Program:
        """prepare() for inputs already as the graph takes them (_graph_inputs)."""
        key = self.signature(args, kwargs)
        program = self.programs.get(key)
        if program is None:
            program = compiler.compile_signature(self, args, kwargs)
            self.programs[key] = program
        return program

    def signature(self, args: tuple, kwargs: Mapping[str, Any]) -> tuple:
        """The capture cache key of a call (see the module docstring)."""
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        parts = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                shape = leaf.dim() if self.dynamic_shapes is not None else tuple(leaf.shape)
                parts.append(("tensor", shape, leaf.dtype, leaf.device, leaf.requires_grad))
            else:
                try:
                    hash(leaf)
                    parts.append(("value", type(leaf), leaf))
                except TypeError:
                    parts.append(("value", type(leaf), repr(leaf)))
        return (self.model.training, str(spec), tuple(parts))

    @property
    def program(self) -> Program:
        """The first Program compiled (for the example inputs)."""
        if not self.programs:
            raise LookupError("nothing compiled yet: call the engine or pass example_inputs")
        return next(iter(self.programs.values()))

    # -- training (fxstar/training_step.py) --------------------------------------------------

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The plan's optimizer over `engine.parameters()`, made on first use: passes may
        replace parameters (tiles, shards, chunk views) while compiling."""
        if self._optimizer is None:
            self._optimizer = make_optimizer(self)
        return self._optimizer

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()`, for symmetry with DeepSpeed/PatrickStar (`model.backward(loss)`):
        under fp16 the loss the engine returned already sends scaled gradients back."""
        loss.backward()

    def step(self) -> bool:
        """One optimizer step every `accumulation_steps` calls (gradients summed meanwhile),
        with gradient clipping if planned, then gradients zeroed. True when it stepped. Safe
        to call from several threads: steps run one after the other."""
        # Why this order: the step is counted first (a checkpoint saves the count) and
        # uncounted when the update raised before writing anything (called again, it takes
        # this step with the gradients summed so far); the update reads the summed gradients
        # before they are dropped; the step ends, whatever happened, so that other threads
        # may train.
        with self.step_lock:
            try:
                self.state_guard.check("engine.step")
                self._micro_steps += 1
                if self._micro_steps % self.plan.optimizer.accumulation_steps:
                    return False  # the gradients go on summing
                try:
                    if self.chunks is not None:  # a backward that raised left copies in flight
                        self.chunks.step_chunks.wait_for_grads()
                    stepped = update(self, self.optimizer)
                except BaseException:
                    if self.state_guard.stopped is None:  # nothing written: not taken
                        self._micro_steps -= 1
                    raise
                self.zero_grad(set_to_none=True)
                return stepped
            finally:
                self.step_lock.end_step()

    @whole_state
    def gradients(self) -> dict[str, torch.Tensor | None]:
        """This step's gradient of every parameter under the model's names: parts a pass cut
        (tiles, shards) glued back, and under bf16/fp16 read from the chunks' gradient
        buffers (the fp32 masters users see have no `.grad` there). Collective under tensor
        parallel: every rank gathers the shards. Under data parallelism they are this rank's
        own: the step reduces them to the chunks' owners (DeepSpeed's boundary)."""
        if self.chunks is not None:  # the copies a backward that raised left in flight
            self.chunks.step_chunks.wait_for_grads()
        grads = {n: p.grad for n, p in self.store.named_parameters()}
        if self.chunks is not None and self.chunks.low_precision:
            slots = self.chunks.layout.slots()
            grads.update({n: self.chunks.slot_grad(slots[n]) for n in grads if n in slots})
        return self.store.consolidate_grads(grads)

    # -- checkpoints (fxstar/saving/) -------------------------------------------------------

    @property
    def step_count(self) -> int:
        """Calls of `step()` so far (micro-steps: an optimizer step every accumulation_steps)."""
        return self._micro_steps

    @step_count.setter
    def step_count(self, value: int) -> None:
        self._micro_steps = value

    def stateful(self) -> dict[str, Any]:
        """What checkpoints save beside the optimizer, by name: fp16's loss scaler, an attached
        scheduler, objects given to register_state."""
        objects: dict[str, Any] = {}
        if self.scaler is not None:
            objects["loss_scaler"] = self.scaler
        objects.update(self._registered_state)
        return objects

    def attach_scheduler(self, scheduler: Any) -> Any:
        """Save and restore `scheduler` (made over `engine.optimizer`) with checkpoints. An
        explicit call, since nothing links an optimizer to its schedulers; stepping it stays
        the caller's (`scheduler.step()` after `engine.step()` returned True)."""
        if getattr(scheduler, "optimizer", None) is not self.optimizer:
            raise ValueError("attach_scheduler: the scheduler must be made over engine.optimizer")
        return self.register_state("scheduler", scheduler)

    def register_state(self, name: str, obj: Any) -> Any:
        """Save `obj.state_dict()` under `name` in checkpoints; `engine.load` gives it back
        through `obj.load_state_dict`."""
        from fxstar.saving import RESERVED

        if name in RESERVED:
            raise ValueError(f"register_state: {name!r} is reserved ({', '.join(RESERVED)})")
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise ValueError(f"register_state: {obj!r} has no state_dict/load_state_dict")
        self._registered_state[name] = obj
        return obj

    @whole_state
    def training_state(self) -> dict[str, Any]:
        """Step, RNG states, optimizer state and what is registered (see fxstar.saving);
        `state_dict()` stays the model's, so the eager model can load it."""
        from fxstar.saving import training_state, view_of

        return training_state(view_of(self))

    def release_mapped_pages(self) -> None:
        """The pages of the disk tier's mapped fp32 masters read or written since (a save, an
        export, a load through the parameters) go back to the host; the files keep the
        values."""
        if self.chunks is not None and self.chunks.disk is not None:
            self.chunks.disk.unmap_pages()

    @whole_state
    def save(self, path: str | os.PathLike) -> str:
        """Write a checkpoint directory (parameters in safetensors, training state in JSON and
        safetensors), replacing any previous one atomically. Called while another thread has
        a step open, it waits for that step's engine.step() (or zero_grad())."""
        from fxstar.saving import save

        return str(save(self, path))

    @whole_state(writes=True)
    def load(self, path: str | os.PathLike, *, strict: bool = True, rng: bool = True) -> Any:
        """Restore a checkpoint in place: parameters, optimizer, scheduler, step and RNG.
        Returns the `fxstar.saving.Checkpoint` read; the parameters are read one tensor at a
        time straight into the engine's own (a model larger than half the host resumes)."""
        from fxstar.saving import load

        checkpoint = load(path, read_parameters=False)
        checkpoint.apply(self, strict=strict, rng=rng)
        return checkpoint

    @whole_state
    def save_pretrained(self, path: str | os.PathLike, *, max_shard_size: int | str | None = None,
                        dtype: torch.dtype | None = None) -> str:  # fmt: skip
        """A transformers model directory `from_pretrained` opens, written a tensor at a time
        (fxstar.saving.export); every rank calls it."""
        from fxstar.saving.export import save_pretrained

        return str(save_pretrained(self, path, max_shard_size=max_shard_size, dtype=dtype))

    @whole_state
    def export_state_dict(self, path: str | os.PathLike, *,
                          dtype: torch.dtype | None = None) -> str:  # fmt: skip
        """The model's state dict in one safetensors file, for any model (see save_pretrained)."""
        from fxstar.saving.export import export_state_dict

        return str(export_state_dict(self, path, dtype=dtype))

    # -- nn.Module plumbing: the model's parameters, names, state and mode -------------------

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        if not remove_duplicate:
            raise ValueError("an Engine lists each trained tensor once (remove_duplicate=True)")
        for name, p in self.store.named_parameters():
            yield prefix + name, p

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        return self.model.named_buffers(prefix, recurse, remove_duplicate)

    @whole_state
    def state_dict(self, *, prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:
        """The model's keys, shapes and dtypes, whatever passes (or bf16/fp16, whose traced
        copy holds low-precision buffers) did to the tensors. Collective under tensor
        parallelism and with sharded data-parallel payloads (the others' values gathered)."""
        full = None
        if self.chunks is not None and self.chunks.sharded:  # other ranks' chunks: collective
            full = self.chunks.data_parallel.full_parameters(self.chunks.step_chunks)
        with self._local_state_dicts():
            # remote chunks' values filled in before tensor-parallel shards are glued (2-D mesh)
            state = self.store.state_dict(full)
            own = {k: v.dtype for k, v in self.model.state_dict().items()}
        return {prefix + k: v.to(own.get(k, v.dtype)) for k, v in state.items()}

    @whole_state
    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's state dict without a collective: with sharded data-parallel payloads
        the other ranks' chunks are meta tensors (their names and shapes)."""
        with self._local_state_dicts():
            return self.store.state_dict()

    @contextlib.contextmanager
    def _local_state_dicts(self) -> Iterator[None]:
        """The model's state_dict() as it is here: no gathering by the hook chunk_setup adds
        under sharded payloads."""
        self._local_depth += 1
        try:
            yield
        finally:
            self._local_depth -= 1

    @whole_state(writes=True)
    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign=False):
        return self.model.load_state_dict(state_dict, strict=strict, assign=assign)

    def train(self, mode: bool = True) -> Engine:
        self.training = mode
        self.model.train(mode)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients dropped, and the step open (forward .. step) ended."""
        with self.step_lock:
            if self.chunks is not None:
                self.chunks.zero_grad(set_to_none)  # also what low-precision chunks hold
            for _, p in self.store.named_parameters():
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()
            self.step_lock.end_step()

    def _apply(self, fn, recurse: bool = True):
        if self.chunks is not None or self.traced is not self.model:
            raise EngineStateError(
                "this engine keeps its parameters in chunks (device_memory or bf16/fp16): "
                "their dtype and device are the plan's (precision, and the device the chunks "
                "live on). Change the model before fxstar.compile, or compile it again."
            )
        self.model._apply(fn, recurse)
        self.programs.clear()  # devices and dtypes are baked into captures
        self._fed = []  # recaptured with what the model holds now
        return self

    def estimate(self) -> Estimate:
        """What the plan needs of the compute tier: activation peak, parameter bytes, the
        smallest device_memory that works and the moment that sets it."""
        return estimate(self.program)

    # -- lifetime -------------------------------------------------------------------------------

    def close(self) -> None:
        """Release now what the engine holds: threads (memory monitor, gradient copies), the
        arena, host chunks, optimizer state and the disk tier's files. The model keeps its
        current values (its parameters get storage of their own, or, with the fp32 masters on
        the disk tier, keep mapping their removed files) and can be compiled again. Dropping
        the last reference to an engine frees the same, later."""
        with self.step_lock:  # not while a forward or step runs
            if self._closed:
                return
            if self.chunks is not None:  # and its disk tier's files
                self.chunks.close()
            self.topology.release()
            self._closed = True
            self.programs.clear()
            self._optimizer = None
            self.chunks = None
            model_owner.release(self.model, self)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # -- reporting ------------------------------------------------------------------------------

    def report(self) -> str:
        """Parameters, captures, passes and, if shape_memory ran, activation memory."""
        return report(self)

    def memory_timeline(self, path: str | os.PathLike = "memory_timeline.png") -> str:
        """A PNG of memory per moment of the last step: chunks, activations, share, budget."""
        return memory_timeline(self, path)

    def extra_repr(self) -> str:
        return f"model={type(self.model).__name__}, passes={self.pass_manager.names}"


def compile(  # noqa: A001 - fxstar.compile mirrors torch.compile
    model: nn.Module,
    plan: Any = None,
    example_inputs: Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    dynamic_shapes: Any = None,
    method: str = EXPORT,
    weights: placement.Weights = None,
) -> Engine:
    """Compile `model` under `plan` (default `Plan()`) into an Engine.

    With example inputs, capture and passes run now (errors surface here); otherwise at the
    first call. A single tensor counts as a one-element tuple. A model built on the meta
    device gets its values from `weights` once the chunks hold its parameters: a safetensors
    file or directory, 'init', or a function of one module (see fxstar/placement.py).
    """
    from fxstar.plan import Plan

    plan = Plan() if plan is None else plan
    plan.check_implemented(implemented_options())
    check_chunk_options(plan)
    if plan.seed is not None:
        torch.manual_seed(plan.seed)
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    # a compile that raises leaves the model as it was given (fxstar/model_snapshot.py)
    snapshot = ModelSnapshot(model)
    engine = None
    try:
        engine = Engine(model, plan, dynamic_shapes=dynamic_shapes, method=method,
                        weights=weights)  # fmt: skip
        if example_inputs or example_kwargs:
            engine.prepare(*example_inputs, **dict(example_kwargs or {}))
    except BaseException:
        if engine is not None:
            engine.close()
        snapshot.restore()
        raise
    return engine
