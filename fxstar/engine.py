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
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from fxstar import placement
from fxstar.capture import capture
from fxstar.decisions import EngineDecisions
from fxstar.errors import EngineStateError, UsageError
from fxstar.estimate import Estimate, estimate
from fxstar.model_snapshot import AttributeState, ModelSnapshot
from fxstar.params import ParameterStore
from fxstar.passes import PassManager, passes_for
from fxstar.passes import implemented_options as pass_options
from fxstar.passes.chunk_layout import check_chunk_options
from fxstar.plan import PlanError, resolve_device
from fxstar.program import EXPORT, Program
from fxstar.release import release_storage
from fxstar.runtime import ops
from fxstar.runtime.chunks import ChunkManager
from fxstar.runtime.data_parallel import ChunkGroups
from fxstar.runtime.grad_norm import GradNorm
from fxstar.runtime.host import give_back_freed
from fxstar.runtime.layout import ChunkPlan
from fxstar.runtime.loss_scale import LossScaler, scale_gradients
from fxstar.runtime.optim import HybridAdam
from fxstar.runtime.step_check import begin_forward
from fxstar.sizes import format_size
from fxstar.topology import Topology
from fxstar.verify import Verifier

__all__ = ["Engine", "compile"]

REFINED_STAGE = "chunk_plan_refined"  # the stage recorded when a program's plan is refined
# the stage recorded when the ranks (sharded payloads) derived a plan unlike and took rank 0's
AGREED_STAGE = "chunk_plan_from_rank_0"

# the plan options the engine itself implements (the passes declare theirs): the optimizer,
# verification, mixed precision (chunks in bf16/fp16, fp32 masters) and HybridAdam
ENGINE_OPTIONS = ("optimizer", "passes", "verify", "loss_fn", "seed", "device",
                  "precision", "loss_scale", "hybrid_adam", "margin_use_ratio",
                  "data_parallel", "data_parallel_shard", "release_after_init")  # fmt: skip


def implemented_options() -> set[str]:
    """Every plan option with a feature behind it: the engine's and every registered pass's."""
    return set(ENGINE_OPTIONS) | pass_options()


class _CaptureCheck:
    """Stand-in pass so the verifier names the capture when it differs from eager."""

    name = "capture"
    tolerance = None


def _whole_state(method: Callable) -> Callable:
    """`method` runs under Engine._between_steps: the engine's lock, once no other thread has
    a step open (reads and writes of the whole training state)."""

    @functools.wraps(method)
    def whole(self: Engine, *args: Any, **kwargs: Any) -> Any:
        with self._between_steps():
            return method(self, *args, **kwargs)

    return whole


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
        self._unfilled_buffers: list[str] = []
        if placement.is_meta(model):
            placement.check_plan(model, plan, weights)
            self._unfilled_buffers = placement.give_buffers_storage(model, resolve_device(plan))
        elif weights is not None:
            raise UsageError(
                "weights= gives a model built on the meta device its values; this model has "
                "them already (load others with model.load_state_dict before compile, or "
                "engine.load)"
            )
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
        # What capture traces: the model itself, or for bf16/fp16 a copy in that precision (a
        # graph traced in fp32 bakes fp32 into its casts); the model keeps the fp32 masters.
        low = plan.precision != "fp32"
        self.traced = _low_precision_copy(model, self.compute_dtype) if low else model
        self.store = ParameterStore(self.traced)
        # the low-precision copy's buffers as last mirrored into the model's (_mirror_buffers)
        self._buffer_values = {n: b.clone() for n, b in self.traced.named_buffers()} if low else {}
        self.scaler = LossScaler.from_config(plan.loss_scale) if plan.precision == "fp16" else None
        self.engine_decisions = EngineDecisions()  # what every capture of this engine follows
        self._optimizer: torch.optim.Optimizer | None = None
        self.chunks: ChunkManager | None = None  # set up by the chunk passes' first compile
        self._micro_steps = 0
        self._registered_state: dict[str, Any] = {}  # saved with checkpoints (scheduler, ...)
        if plan.verify and method != EXPORT:
            raise ValueError("plan.verify needs method='export' (it feeds cloned parameters)")
        _claim(model, self)
        self._closed = False
        self._builds_cache = _builds_cache(model)
        # forward and step change the chunks' state: one thread at a time (a second waits).
        # A step (forward .. step()/zero_grad()) is its thread's: another thread's forward
        # meanwhile is refused (it would interleave with that step's backward, which runs
        # outside any lock); save, load and the state and gradient reads wait for it to end.
        self._lock = threading.RLock()
        self._step_ended = threading.Condition(self._lock)
        self._step_thread: threading.Thread | None = None  # whose step is open
        self._fed: list[tuple[str, nn.Module, str, torch.Tensor]] = []  # see _check_model
        # sharded payloads: the chunk plans the ranks agreed on, by id (held: ids stay theirs)
        self._agreed_plans: dict[int, ChunkPlan] = {}

    # -- running ------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise EngineStateError("the engine was closed; compile the model again to train on")
        with self._lock:
            self._refuse_other_threads_step()
            output = self._forward(args, kwargs)
            if torch.is_grad_enabled():  # a graph to run backward on: this thread's step
                self._step_thread = threading.current_thread()
            return output

    def _open_step_elsewhere(self) -> threading.Thread | None:
        """The other thread whose step is open, if any (one that ended left its step to the
        threads that come next, as an abandoned forward in one thread is)."""
        owner = self._step_thread
        if owner is None or owner is threading.current_thread():
            return None
        if not owner.is_alive():
            self._step_thread = None
            return None
        return owner

    def _refuse_other_threads_step(self) -> None:
        owner = self._open_step_elsewhere()
        if owner is not None:
            raise EngineStateError(
                f"engine forward in thread {threading.current_thread().name!r} while thread "
                f"{owner.name!r} has a step open (its forward ran; its engine.step() or "
                "zero_grad() has not): the two forwards and backwards would mix their chunks "
                "and gradients. Train one engine from one thread, or end the other thread's "
                "step first (engine.step() or engine.zero_grad())"
            )

    def _end_step(self) -> None:
        self._step_thread = None
        self._step_ended.notify_all()

    @contextlib.contextmanager
    def _between_steps(self) -> Iterator[None]:
        """The engine's lock, once no other thread has a step open: what is read or written
        meanwhile (parameters, optimizer state, gradients, the step count) is whole, never
        halfway through another thread's step. A step open in this thread is its own."""
        with self._lock:
            while self._open_step_elsewhere() is not None:
                self._step_ended.wait(timeout=1.0)  # also wakes to see whether it has ended
            yield

    def _forward(self, args: tuple, kwargs: Mapping[str, Any]) -> Any:
        begin_forward(self, args, kwargs)  # ranks out of step raise (runtime/step_check)
        args, kwargs = self._compute_inputs(args, kwargs)
        self._check_model()
        program = self._program_for(args, kwargs)
        groups = self.chunks.data_parallel if self.chunks is not None else None
        if groups is not None and torch.is_grad_enabled():  # DDP's broadcast_buffers
            groups.broadcast(list(self.traced.buffers()), "the buffers")
        if self.chunks is None or program.decisions.chunk_plan is None:
            output = program.run(args, kwargs)
        else:
            self._refine_plans()
            self._agree_plan(program)
            self._fit_kept(program.decisions.chunk_plan)
            with self.chunks.running(program.decisions.chunk_plan):
                output = program.run(args, kwargs)
        if self.traced is not self.model:
            self._mirror_buffers()
        if self.scaler is not None and torch.is_grad_enabled():
            output = _scale_loss(output, self.scaler.scale)
        return output

    def _mirror_buffers(self) -> None:
        """bf16/fp16 run on a low-precision copy: what forward changed in its buffers
        (BatchNorm's running statistics, in place or as a mutation) shows in the model's own,
        so `model.state_dict()` is the trained model. Compared by value: batch_norm updates
        its running statistics without bumping their version, and a buffer nothing changed
        (RoPE's fp32 inv_freq) must not come back rounded."""
        own = dict(self.model.named_buffers(remove_duplicate=False))
        with torch.no_grad():
            for name, buffer in self.traced.named_buffers(remove_duplicate=False):
                last = self._buffer_values.get(name)
                if name in own and (last is None or not torch.equal(last, buffer)):
                    own[name].copy_(buffer)
                    self._buffer_values[name] = buffer.clone()

    def _compute_inputs(self, args: tuple, kwargs: Mapping[str, Any]) -> tuple[tuple, dict]:
        """What the graph is called with. A transformers model whose config builds a KV cache
        (`use_cache=True`, the default) is asked not to: training never reads it, and a cache
        object is no tensor a graph can return. bf16/fp16: floating-point inputs in the
        compute dtype, as the model traced in it expects (integer inputs, token ids, as they
        are). Tensors go to plan.device when one is set."""
        kwargs = dict(kwargs)
        if self._builds_cache and "use_cache" not in kwargs:
            kwargs["use_cache"] = False
        low = self.traced is not self.model
        if not low and self.device is None:
            return args, kwargs
        dtype, device = self.compute_dtype, self.device

        def convert(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            if low and x.is_floating_point() and x.dtype != dtype:
                x = x.to(dtype)
            return x if device is None else x.to(device, non_blocking=True)

        return pytree.tree_map(convert, (tuple(args), dict(kwargs)))

    def prepare(self, *args: Any, **kwargs: Any) -> Program:
        """The Program for these inputs, captured (and passes run) if not cached yet."""
        with self._lock:
            return self._program_for(*self._compute_inputs(args, kwargs))

    def _program_for(self, args: tuple, kwargs: Mapping[str, Any]) -> Program:
        """prepare() for inputs already as the graph takes them (_compute_inputs)."""
        key = self.signature(args, kwargs)
        program = self.programs.get(key)
        if program is None:
            program = self._compile(args, kwargs)
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

    def _compile(self, args: tuple, kwargs: Mapping[str, Any]) -> Program:
        """Capture and passes for one input signature; the first one under the chunk passes
        also moves the parameters into their chunks and writes a meta model's weights. A
        compile that raises (at any step: passes, budgets, weights, agreement) leaves the
        model and this engine as it found them; the original parameters' storage is given
        back (release_after_init) only once every step succeeded."""
        rollback = self._rollback_point()
        try:
            program, release = self._compile_steps(args, kwargs)
        except BaseException:
            rollback()
            raise
        release_storage(release)
        return program

    def _rollback_point(self) -> Callable[[], None]:
        """What `_compile` may change, and the function that puts it back: the model (and the
        low-precision copy traced in its place: fxstar/model_snapshot.py), the parameter
        store, the engine-wide pass decisions (the topology's process groups made stay: every
        rank made them), the chunks, the weights' report."""
        models = (self.model,) if self.traced is self.model else (self.model, self.traced)
        snapshot = ModelSnapshot(*models)
        # the store's tables, and the parts of each derived parameter (rebind replaces them)
        store = [AttributeState(self.store), *map(AttributeState, self.store._derived.values())]
        chunks, decided = self.chunks, AttributeState(self.engine_decisions)
        fields = {name: copy.copy(getattr(self, name))
                  for name in ("_weights_line", "_fed", "_buffer_values")}  # fmt: skip

        def rollback() -> None:
            if self.chunks is not chunks:
                self._discard_chunks()
            decided.restore()
            for name, value in fields.items():
                setattr(self, name, value)
            for state in store:
                state.restore()
            snapshot.restore()

        return rollback

    def _discard_chunks(self) -> None:
        """A chunk manager made by a compile that raised goes, its homes' values with it (no
        one holds its parameters: close() alone would first copy each out of its home)."""
        chunks, self.chunks = self.chunks, None
        with torch.no_grad():
            for stable in chunks.stable.values():
                stable.data = stable.data.new_empty(0)
        chunks.close()

    def _compile_steps(self, args: tuple, kwargs: Mapping[str, Any]
                       ) -> tuple[Program, list[torch.Tensor]]:  # fmt: skip
        """_compile's work; also returns the model's tensors whose storage is to be given back
        (release_after_init) once it has all succeeded."""
        with torch.enable_grad():
            program = capture(
                self.traced,
                args,
                kwargs,
                plan=self.plan,
                dynamic_shapes=self.dynamic_shapes,
                method=self.method,
            )
        program.store = self.store
        program.engine_decisions, program.topology = self.engine_decisions, self.topology
        # what HybridAdam keeps on the compute tier: a later capture's plan counts it
        kept = self.chunks.kept_bytes() if self.chunks is not None else 0
        self.engine_decisions.kept_bytes = kept
        self._agree_ranks(program)
        check = None
        if self.plan.verify:
            check = Verifier(
                self.traced, args, kwargs, loss_fn=self.plan.loss_fn, seed=self.plan.seed or 0,
                runner=self._run_for_verify,
            )  # fmt: skip
            check.baseline()
            check(_CaptureCheck(), program)
        program = self.pass_manager.run(program, check=check)
        first_chunks = self.chunks is None
        release = self._setup_chunks(program)
        self._fill_weights()
        for runtime in ops.runtimes(program.graph_module):
            runtime.manager = self.chunks  # the graph calls this engine's manager, no other
        if first_chunks and self.chunks is not None:
            if self.chunks.data_parallel is not None:  # every replica starts as rank 0's
                self.chunks.data_parallel.start_alike(self.chunks.step_chunks)
            give_back_freed()  # what the homes replaced, to the system
        self._fed = [
            (name, module, attr, module._parameters[attr])
            for name, module, attr in _parameter_slots(self.model)
        ]
        return program, release

    def _check_model(self) -> None:
        """Before every run: the model's parameters are still the tensors this engine trains.
        A new Parameter object (`module.weight = nn.Parameter(...)`) would be silently
        ignored: refused. New values given through `p.data = t` are taken into the chunk
        homes (a plain engine feeds `p` itself and sees them anyway)."""
        for name, module, attr, expected in self._fed:
            if module._parameters.get(attr) is not expected:
                raise EngineStateError(
                    f"parameter {name} of the model was replaced by another tensor after "
                    "compile; the engine would go on training the old one. Change values in "
                    "place instead (`with torch.no_grad(): p.copy_(new)`, or "
                    "engine.load_state_dict), or compile the model again."
                )
        if self.chunks is not None:
            try:
                self.chunks.adopt_replaced_data()
            except RuntimeError as error:
                raise EngineStateError(str(error)) from None

    def _agree_ranks(self, program: Program) -> None:
        """Before any pass, while nothing can have failed on one rank only: the ranks agree on
        the plan, the graph and (tensor parallel, first capture) the full parameters over the
        topology's groups, made at the first compile (Topology.agree)."""
        self.topology.agree(program)

    def _setup_chunks(self, program: Program) -> list[torch.Tensor]:
        """Once per engine, after the chunk passes: the ChunkManager takes the parameters over.
        The model's parameters become the stable views of the chunks' host homes, so the model,
        the engine and any optimizer keep seeing one set of tensors. Returns the model's own
        tensors whose storage release_after_init gives back once the compile succeeded."""
        if program.decisions.chunk_layout is None or self.chunks is not None:
            return []
        # fp32 masters: the model's own parameters, and the parts a pass cut from one (tiles,
        # a rank's shard) cut the same way from it: never a full tensor where a part is fed,
        # nor (bf16/fp16) parts cut from the rounded copy
        masters = dict(self.store.tensors())
        for name, p in self.model.named_parameters(remove_duplicate=False):
            masters.update(self.store.cut(name, p.detach()))
        placement.check_host_budget(self.plan, program.decisions.chunk_plan)
        self.chunks = self._chunk_manager(program, self.store.tensors(), masters)
        if self.chunks.sharded:
            self._gather_in_state_dicts()
        slots = self.chunks.layout.slots()
        own = dict(self.model.named_parameters(remove_duplicate=False))
        if self.chunks.low_precision:  # parameters kept on the host: their fp32 masters
            for info in program.params:
                if info.host_resident and info.name in own:
                    self.store.rebind(info.name, own[info.name])
        if self.chunks.low_precision and not self.plan.verify:
            # the chunks hold the low-precision payloads now: the traced copy keeps shapes
            # only (a later capture traces it as a meta model; verify runs it, so keeps it)
            _drop_parameter_storage(self.traced)
        originals = []  # the model's own tensors the chunk homes replace (fxstar/release.py)
        for name, stable in self.chunks.stable.items():
            self.store.rebind(name, stable)
            for alias in slots[name].aliases:
                if alias in own:  # derived parts (tiles, shards) are not the model's
                    originals.append(own[alias])
                    owner, _, attr = alias.rpartition(".")
                    setattr(self.model.get_submodule(owner), attr, stable)
        if not self.plan.release_after_init:
            return []
        kept = {
            p.untyped_storage().data_ptr() for p in self.model.parameters() if not p.is_meta
        }  # parameters kept out of the chunks (cpu_embedding)
        return [p for p in originals if p.is_meta or p.untyped_storage().data_ptr() not in kept]

    def _fill_weights(self) -> None:
        """Once, for a model built on the meta device: its parameters are views of their chunk
        homes now; write their values there (and the buffers'), then the low-precision copies
        follow."""
        if self._weights is None or self._weights_line is not None or self.chunks is None:
            return
        with self._local_state_dicts():  # its names only: nothing gathered
            self._weights_line = placement.fill(
                self.model, self._weights, self._unfilled_buffers, sharded=self.chunks.sharded,
                everywhere=self.plan.release_after_init,
            )  # fmt: skip
        self.chunks.masters_written()
        if self.traced is not self.model:  # the low-precision copy's buffers, from the model's
            own = dict(self.model.named_buffers())
            with torch.no_grad():
                for name, buffer in self.traced.named_buffers():
                    buffer.copy_(own[name])
                    self._buffer_values[name] = buffer.clone()

    def _chunk_manager(
        self,
        program: Program,
        tensors: Mapping[str, torch.Tensor],
        masters: Mapping[str, torch.Tensor] | None = None,
    ) -> ChunkManager:
        """The manager the program's ChunkPlan decides, with the plan's run-time knobs."""
        layout = program.decisions.chunk_plan.layout
        groups = None
        if layout.ranks > 1:
            groups = ChunkGroups(layout.ranks, self.topology.data_group,
                                 mem_saving=self.plan.mem_saving_comm,
                                 sharded=self.topology.sharded_payloads)  # fmt: skip
        return ChunkManager.from_plan(
            program.decisions.chunk_plan, tensors, masters=masters,
            monitor=self.plan.async_mem_monitor,
            overlap_grad_copies={"on": True, "off": False}.get(self.plan.overlap_grad_copies),
            prefetch={"on": True, "off": False}.get(self.plan.prefetch),
            grads_in_host=self.plan.grads_in_host, data_parallel=groups,
        )  # fmt: skip

    def _refine_plans(self) -> None:
        """After the first training step under a compiled ChunkPlan, the program follows a
        plan made from what that step measured: a new object and a new stage of the program
        ('chunk_plan_refined'), the compiled one left as it was decided."""
        observation = self.chunks.observe()
        if observation is None:
            return
        compiled, observed = observation
        if self.chunks.sharded:  # every rank refines alike: its loads are collective
            measured = self.chunks.data_parallel.agree_measured(
                None if observed is None else observed.nonmodel_bytes)  # fmt: skip
            if measured is None:  # some rank's step could not be used: none refines
                return
            observed = dataclasses.replace(observed, nonmodel_bytes=measured)
        if observed is None:
            return
        for program in self.programs.values():
            if program.decisions.chunk_plan is compiled:
                program.decisions.chunk_plan = compiled.refined(observed)
                program.decisions.chunk_observed = observed
                program.record(REFINED_STAGE, by="engine")

    def _agree_plan(self, program: Program) -> None:
        """Sharded payloads: every load and eviction is a collective, so before any rank
        first follows a chunk plan the ranks agree on it (ChunkGroups.agree_plan: each rank
        derived its own, from its capture or its traced step); one that differed is replaced
        by rank 0's, recorded as a stage of the program."""
        plan = program.decisions.chunk_plan
        if not self.chunks.sharded or id(plan) in self._agreed_plans:
            return
        agreed = self.chunks.data_parallel.agree_plan(plan)
        self._agreed_plans[id(agreed)] = agreed
        if agreed is not plan:
            program.decisions.chunk_plan = agreed
            program.record(AGREED_STAGE, by="engine")

    def _fit_kept(self, plan: ChunkPlan) -> None:
        """The chunks HybridAdam keeps on the compute tier for good are part of every plan:
        those a plan has no room for (a later, larger input) go back to the host tier before
        it runs, the least used first, and stay there."""
        optimizer = self._optimizer
        if not isinstance(optimizer, HybridAdam) or not optimizer.device_chunks:
            return
        room = plan.kept_room()
        if room is not None and self.chunks.kept_bytes() > room:
            optimizer.give_back(room)

    def _run_for_verify(self, program: Program, args: tuple, kwargs: dict, tensors: dict) -> Any:
        """plan.verify runs a chunked stage under a manager of its own, made from the
        verifier's copies; the names it trains are rebound so their gradients are found."""
        plan = program.decisions.chunk_plan
        if plan is None:
            return program.run(args, kwargs, tensors=tensors)
        manager = self._chunk_manager(program, tensors)
        for name, stable in manager.stable.items():
            for alias in manager.layout.slots()[name].aliases:
                tensors[alias] = stable
        # bound until the engine binds its own after the passes: the verifier's backward
        # (a region's recomputation) runs after this returns
        for runtime in ops.runtimes(program.graph_module):
            runtime.manager = manager
        with manager.running(plan):
            return program.run(args, kwargs, tensors=tensors)

    @property
    def program(self) -> Program:
        """The first Program compiled (for the example inputs)."""
        if not self.programs:
            raise LookupError("nothing compiled yet: call the engine or pass example_inputs")
        return next(iter(self.programs.values()))

    # -- optimizer ------------------------------------------------------------------------------

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The plan's optimizer over `engine.parameters()`, made on first use: passes may
        replace parameters (tiles, shards, chunk views) while compiling."""
        if self._optimizer is None:
            opt = self.plan.optimizer
            groups = _param_groups(self.store, opt)
            if self.chunks is not None and opt.type in ("adam", "adamw"):
                self._optimizer = HybridAdam(
                    self.chunks.step_chunks, groups, lr=opt.lr, betas=opt.betas, eps=opt.eps,
                    adamw=opt.type == "adamw", clip_grad_norm=opt.clip_grad_norm,
                    scaler=self.scaler,
                    # without a device_memory the budget is made up: no margin to plan from
                    hybrid=self.plan.hybrid_adam and self.plan.device_memory is not None,
                    margin_use_ratio=self.plan.margin_use_ratio,
                    norm=self._grad_norm(own_chunks=True),
                    accumulation_steps=opt.accumulation_steps,
                    host_budget=placement.HostBudget(self.plan, self.program),
                    data_parallel=self.chunks.data_parallel,
                )  # fmt: skip
            elif self.chunks is not None and self.chunks.low_precision:
                raise PlanError(
                    f"optimizer.type: {opt.type!r} cannot update bf16/fp16 chunks; "
                    "use 'adam' or 'adamw' (HybridAdam), or precision 'fp32'"
                )
            else:
                self._optimizer = _torch_optimizer(groups, opt)
        return self._optimizer

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()`, for symmetry with DeepSpeed/PatrickStar (`model.backward(loss)`):
        under fp16 the loss the engine returned already sends scaled gradients back."""
        loss.backward()

    def step(self) -> bool:
        """One optimizer step every `accumulation_steps` calls (gradients summed meanwhile),
        with gradient clipping if planned, then gradients zeroed. True when it stepped. Safe
        to call from several threads: steps run one after the other."""
        with self._lock:
            try:
                return self._step()
            finally:
                self._end_step()

    def _step(self) -> bool:
        self._micro_steps += 1
        opt = self.plan.optimizer
        if self._micro_steps % opt.accumulation_steps:
            return False
        optimizer = self.optimizer
        if isinstance(optimizer, HybridAdam):
            stepped = optimizer.step()  # clipping and loss scaling fused into it
        else:
            groups = self.chunks.data_parallel if self.chunks is not None else None
            if groups is not None:  # every rank steps every parameter: all get the average
                groups.average([p.grad for p in self.parameters() if p.grad is not None])
            if opt.clip_grad_norm is not None:  # every rank has whole averaged gradients
                self._clip(opt.clip_grad_norm, self._grad_norm(own_chunks=False))
            stepped = optimizer.step() is not False
        self.zero_grad(set_to_none=True)
        return stepped

    def _grad_norm(self, *, own_chunks: bool) -> GradNorm:
        """How this rank's partial sums of squares make the model's (runtime/grad_norm.py):
        the shards tensor parallelism split are summed over its ranks; with `own_chunks`
        (HybridAdam under data parallelism) every sum over the data-parallel ranks too."""
        sharded = set()
        for program in self.programs.values():
            if program.decisions.tp_sharding is not None:
                sharded |= program.decisions.tp_sharding.params
        tensors = self.store.tensors()
        groups = self.chunks.data_parallel if self.chunks is not None else None
        return GradNorm(self.topology.tensor_group,
                        [tensors[n] for n in sharded if n in tensors],
                        groups.group if own_chunks and groups is not None else None)  # fmt: skip

    def _clip(self, max_norm: float, norm: GradNorm) -> None:
        """torch's clip_grad_norm_ by the model's norm (a tensor-parallel rank holds shards)."""
        params = [p for p in self.parameters() if p.grad is not None]

        def sum_sq(grads: list[torch.Tensor]) -> float:
            return sum(float(torch.linalg.vector_norm(g, dtype=torch.float64) ** 2)
                       for g in grads)  # fmt: skip

        shards, rest = norm.split((p, p.grad) for p in params)
        total, _ = norm.decide(sum_sq(shards), sum_sq(rest), True)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, torch.tensor(total**0.5))

    @_whole_state
    def gradients(self) -> dict[str, torch.Tensor | None]:
        """This step's gradient of every parameter under the model's names: parts a pass cut
        (tiles, shards) glued back, and under bf16/fp16 read from the chunks' gradient
        buffers (the fp32 masters users see have no `.grad` there). Collective under tensor
        parallel: every rank gathers the shards. Under data parallelism they are this rank's
        own: the step reduces them to the chunks' owners (DeepSpeed's boundary)."""
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

    @_whole_state
    def training_state(self) -> dict[str, Any]:
        """Step, RNG states, optimizer state and what is registered (see fxstar.saving);
        `state_dict()` stays the model's, so the eager model can load it."""
        from fxstar.saving import training_state, view_of

        return training_state(view_of(self))

    @_whole_state
    def save(self, path: str | os.PathLike) -> str:
        """Write a checkpoint directory (parameters in safetensors, training state in JSON and
        safetensors), replacing any previous one atomically. Called while another thread has
        a step open, it waits for that step's engine.step() (or zero_grad())."""
        from fxstar.saving import save

        return str(save(self, path))

    @_whole_state
    def load(self, path: str | os.PathLike, *, strict: bool = True, rng: bool = True) -> Any:
        """Restore a checkpoint in place: parameters, optimizer, scheduler, step and RNG.
        Returns the `fxstar.saving.Checkpoint` read; the parameters are read one tensor at a
        time straight into the engine's own (a model larger than half the host resumes)."""
        from fxstar.saving import load

        checkpoint = load(path, read_parameters=False)
        checkpoint.apply(self, strict=strict, rng=rng)
        return checkpoint

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

    @_whole_state
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

    @_whole_state
    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's state dict without a collective: with sharded data-parallel payloads
        the other ranks' chunks are meta tensors (their names and shapes)."""
        with self._local_state_dicts():
            return self.store.state_dict()

    @contextlib.contextmanager
    def _local_state_dicts(self) -> Iterator[None]:
        """The model's state_dict() as it is here: no gathering by the hook below."""
        self._local_depth += 1
        try:
            yield
        finally:
            self._local_depth -= 1

    def _gather_in_state_dicts(self) -> None:
        """Sharded payloads: the model's own `state_dict()` (what a training script saves)
        gathers the other ranks' chunks too, as `engine.state_dict()` does (collective: every
        rank calls it), instead of handing out meta tensors that would save no values."""
        engine = weakref.ref(self)

        def gather(module: nn.Module, state: dict, prefix: str, local_metadata: Any) -> None:
            self = engine()
            if self is None or self._local_depth or self.chunks is None:
                return
            remote = [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.is_meta]
            if remote:
                full = self.state_dict()
                for key in remote:
                    state[key] = full[key[len(prefix) :]]

        self.model.register_state_dict_post_hook(gather)

    @_whole_state
    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign=False):
        return self.model.load_state_dict(state_dict, strict=strict, assign=assign)

    def train(self, mode: bool = True) -> Engine:
        self.training = mode
        self.model.train(mode)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients dropped, and the step open (forward .. step) ended."""
        with self._lock:
            if self.chunks is not None:
                self.chunks.zero_grad(set_to_none)  # also what low-precision chunks hold
            for _, p in self.store.named_parameters():
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()
            self._end_step()

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
        arena, host chunks and optimizer state. The model keeps its current values (its
        parameters get storage of their own) and can be compiled again. Dropping the last
        reference to an engine frees the same, later."""
        with self._lock:  # not while a forward or step runs
            if self._closed:
                return
            if self.chunks is not None:
                self.chunks.close()
            self.topology.release()
            self._closed = True
            self.programs.clear()
            self._optimizer = None
            self.chunks = None
            if _owner(self.model) is self:
                del self.model.__dict__[OWNER]

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # -- reporting ------------------------------------------------------------------------------

    def report(self) -> str:
        """Parameters, captures, passes and, if shape_memory ran, activation memory."""
        lines = []
        if not self.programs:
            return "fxstar engine: nothing compiled yet"
        program = self.program
        tied = sum(len(p.aliases) - 1 for p in program.params)
        lines.append(
            f"fxstar engine for {type(self.model).__name__}: {len(program.params)} parameter "
            f"tensors ({tied} tied aliases), {format_size(program.param_bytes)}"
        )
        lines.append(f"captures: {len(self.programs)} (one per input signature and mode)")
        lines.append("passes run: " + (", ".join(program.passes_run()) or "none"))
        lines.append(
            "compile time: "
            + ", ".join(f"{name} {seconds:.2f}s" for name, seconds in program.timings.items())
        )
        lines.append(self._optimizer_line())
        if self._weights_line is not None:
            lines.append(self._weights_line)
        if self.chunks is not None:
            lines.append(self.chunks.report())
            given = getattr(self._optimizer, "given_back", None)
            if given:
                lines.append(
                    f"kept chunks {sorted(given)} went back to the host tier with their optimizer "
                    "state: a later input's plan had no room for them beside its own"
                )
            kept = getattr(self._optimizer, "kept", None)  # None: as forecast
            lines.append(placement.describe_host(self.plan, program.decisions.chunk_plan, kept))
            lines.append(program.decisions.chunk_plan.describe().splitlines()[0])
            observed = program.decisions.chunk_observed
            if observed is not None:
                lines.append(f"observed in the first traced step: {observed.describe()}")
        if self.scaler is not None:
            lines.append(
                f"fp16 loss scale {self.scaler.scale:g}; {self.scaler.skipped_steps} steps "
                "skipped for overflow"
            )
        report = program.decisions.shape_memory
        if report is not None:
            lines.append(report.format())
        else:
            lines.append("activation memory: add 'shape_memory' to plan.passes to measure it")
        # what passes want reported: strings, or callables read now (run-time counters)
        for line in program.decisions.report_lines:
            lines.append(line() if callable(line) else str(line))
        return "\n".join(lines)

    def _optimizer_line(self) -> str:
        """What the optimizer does, and where that differs from torch.optim's defaults (a user
        porting a torch loop expects those)."""
        opt = self.plan.optimizer
        groups = _param_groups(self.store, opt)
        decayed = sum(len(g["params"]) for g in groups if g["weight_decay"])
        exempt = sum(len(g["params"]) for g in groups) - decayed
        line = (
            f"optimizer: {opt.type} lr={opt.lr:g} betas={tuple(opt.betas)} eps={opt.eps:g} "
            f"weight_decay={opt.weight_decay:g}"
        )
        if opt.weight_decay:
            line += (
                f" on {decayed} tensors, none on {exempt} matching no_decay {list(opt.no_decay)}"
            )
        torch_decay = {"adamw": 0.01, "adam": 0.0, "sgd": 0.0}[opt.type]
        if opt.type != "sgd" and opt.weight_decay != torch_decay:
            line += (
                f" (torch.optim.{'AdamW' if opt.type == 'adamw' else 'Adam'}'s default is "
                f"weight_decay={torch_decay:g} on every tensor)"
            )
        return line

    def memory_timeline(self, path: str | os.PathLike = "memory_timeline.png") -> str:
        """A PNG of memory per moment of the last step: chunks, activations, share, budget."""
        from fxstar.timeline import plot_timeline

        if self.chunks is None:
            raise ValueError("memory_timeline needs the chunk engine: set plan.device_memory")
        budget = self.chunks.budget
        title = f"{type(self.model).__name__}: device_memory " + (
            "none (every chunk resident)" if budget is None else format_size(budget)
        )
        line = self.chunks.arena.capacity if budget is None else budget
        return plot_timeline(self.chunks.tracer, line, path, title)

    def extra_repr(self) -> str:
        return f"model={type(self.model).__name__}, passes={self.pass_manager.names}"


COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _builds_cache(model: nn.Module) -> bool:
    """A transformers model that returns a KV cache unless told `use_cache=False`."""
    config = getattr(model, "config", None)
    try:
        takes = "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return takes and bool(getattr(config, "use_cache", False))


def _parameter_slots(model: nn.Module) -> Iterator[tuple[str, nn.Module, str]]:
    """(name, owning module, attribute) of every parameter, tied ones under each name."""
    for module_name, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is not None:
                yield (f"{module_name}.{attr}" if module_name else attr), module, attr


def _claim(model: nn.Module, engine: Engine) -> None:
    """One chunk or bf16/fp16 engine per model: such an engine rebinds the model's parameters
    to its own chunk homes, so a second engine over the same model would train a copy the
    first never sees (and the model would show only one of them)."""
    other = _owner(model)
    if (
        other is not None
        and other.model is model
        and (other.topology.uses_chunks or engine.topology.uses_chunks)
    ):
        theirs = other.topology.uses_chunks
        raise EngineStateError(
            f"{type(model).__name__} is already compiled by another fxstar engine that "
            + ("keeps" if theirs else "would share")
            + " its parameters"
            + (" in chunks" if theirs else " with this chunk engine")
            + "; two engines over one model would train two copies. Compile a copy "
            "(copy.deepcopy(model)), or close the first engine (engine.close()) before "
            "compiling again."
        )
    model.__dict__[OWNER] = _Owner(engine)


OWNER = "_fxstar_engine"  # the model's attribute naming the engine that owns its parameters


class _Owner:
    """A weak reference to the engine that owns a model's parameters, which copies and pickles
    of the model (`torch.save(model)`, `copy.deepcopy`) leave behind."""

    def __init__(self, engine: Engine | None = None):
        self.ref = weakref.ref(engine) if engine is not None else None

    def __call__(self) -> Engine | None:
        return self.ref() if self.ref is not None else None

    def __reduce__(self):
        return (_Owner, ())

    def __deepcopy__(self, memo: dict) -> _Owner:
        return _Owner()


def _owner(model: nn.Module) -> Engine | None:
    owner = model.__dict__.get(OWNER)
    return owner() if owner is not None else None


def _drop_parameter_storage(model: nn.Module) -> None:
    """Every parameter of `model` becomes a meta tensor of its shape and dtype (tied ones stay
    one): what capture needs of it, with none of its bytes."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for attr, p in list(module._parameters.items()):
            if p is None or p.is_meta:
                continue
            if id(p) not in made:
                meta = torch.empty(p.shape, dtype=p.dtype, device="meta")
                made[id(p)] = nn.Parameter(meta, requires_grad=p.requires_grad)
            module._parameters[attr] = made[id(p)]


def _low_precision_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    return copy.deepcopy(model).to(dtype)


def _scale_loss(output: Any, scale: float) -> Any:
    """fp16: the loss the user calls backward on sends its gradient back multiplied by the
    loss scale (its value stays unscaled)."""
    if isinstance(output, torch.Tensor):
        return scale_gradients(output, scale)
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        output["loss"] = scale_gradients(output["loss"], scale)
        return output
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return (scale_gradients(output[0], scale), *output[1:])
    raise TypeError("precision 'fp16' needs the model to return its loss (or a 'loss' entry)")


def _param_groups(store: ParameterStore, opt: Any) -> list[dict[str, Any]]:
    """no_decay parameters in a group of their own; name patterns match the model's names
    (a tile matches what it was cut from)."""
    decay, no_decay = [], []
    for name, p in store.named_parameters():
        if p.requires_grad:
            (decay if opt.decays(store.origin(name)) else no_decay).append(p)
    return [
        {"params": ps, "weight_decay": wd}
        for ps, wd in ((decay, opt.weight_decay), (no_decay, 0.0))
        if ps
    ]


def _torch_optimizer(groups: list[dict[str, Any]], opt: Any) -> torch.optim.Optimizer:
    if opt.type == "adamw":
        return torch.optim.AdamW(groups, lr=opt.lr, betas=opt.betas, eps=opt.eps)
    if opt.type == "adam":
        return torch.optim.Adam(groups, lr=opt.lr, betas=opt.betas, eps=opt.eps)
    if opt.type == "sgd":
        return torch.optim.SGD(groups, lr=opt.lr, momentum=opt.betas[0])
    raise ValueError(f"unknown optimizer type {opt.type!r}")


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
