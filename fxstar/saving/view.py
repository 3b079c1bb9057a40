"""What a checkpoint reads from and writes into an engine: one typed view, made by `view_of`.

The layouts and the training state see this view, never the engine: `view_of` is the one place
that reads the engine's process groups, chunks and parameter store for a checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from fxstar.mesh import MeshLayout
from fxstar.runtime.optim import HybridAdam
from fxstar.runtime.rank_group import RankGroup
from fxstar.saving.collective import rank_in
from fxstar.saving.state_stream import state_items
from fxstar.weights import is_transformers

if TYPE_CHECKING:
    from fxstar.engine import Engine
    from fxstar.params import ParameterStore
    from fxstar.runtime.rank_stream import RankStream

Pairs = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class World:
    """The ranks one model runs on, as a checkpoint counts them."""

    group: RankGroup | None = None  # over every rank of the model (mesh, tensor or data parallel)
    tensor_parallel: int = 1
    data_parallel: int = 1

    @property
    def ranks(self) -> int:
        """How many ranks save one checkpoint together (1: this process alone)."""
        return self.tensor_parallel * self.data_parallel

    def rank(self) -> int:
        """This process's place among `ranks` (its rank in `group`)."""
        return rank_in(self.group) if self.ranks > 1 else 0

    @property
    def mesh(self) -> MeshLayout:
        """The ranks as a (data-parallel x tensor-parallel) grid, tensor parallel inner."""
        return MeshLayout(self.ranks, self.tensor_parallel)


@dataclass(frozen=True)
class TrainingView:
    """An engine as a checkpoint sees it: what a save writes and what a load restores."""

    model_class: str  # the model's class name, recorded in training.json
    model: nn.Module  # the model (an export reads a transformers model's config and ties)
    # a transformers model's config as JSON, recorded in training.json (None: another model)
    transformers_config: dict[str, Any] | None
    plan: dict[str, Any]  # the plan's options as training.json records them (no loss function)
    world: World
    # this rank holds only its own chunks' parameter values (sharded data-parallel payloads)
    sharded: bool
    # the model's state dict, whole: collective under tensor parallelism and sharded payloads
    state_dict: Callable[[], dict[str, torch.Tensor]]
    # this rank's state dict without a collective (sharded: other ranks' chunks as meta tensors)
    local_state_dict: Callable[[], dict[str, torch.Tensor]]
    # the model's state dict names, shapes and dtypes (as meta tensors), without a collective
    model_state: Callable[[], dict[str, torch.Tensor]]
    # the values of these names one at a time, as state_dict gives them (collective: every
    # rank draws the same names; see state_stream.py)
    state_items: Callable[[Sequence[str]], Iterator[tuple[str, torch.Tensor]]]
    parameters: Mapping[str, nn.Parameter]  # the tensors the engine trains, by name
    parameter_names: frozenset[str]  # every name of the model's parameters, tied ones too
    optimizer: Any
    objects: Mapping[str, Any]  # saved beside the optimizer: loss scaler, scheduler, registered
    accumulation_steps: int
    step_count: int  # micro-steps taken
    set_step_count: Callable[[int], None]
    rank_stream: RankStream | None  # the tensor-parallel RNG stream of this rank
    # the parameters tensor parallelism split, by fed name: (dim, parts) as shard_of cuts them
    tensor_splits: Mapping[str, tuple[int, int]]
    # the names of the parameters whose optimizer state this rank holds (None: every one;
    # HybridAdam under data parallelism: its own chunks' and those outside the chunks)
    stepped: frozenset[str] | None
    # copies (name, value) pairs into the tensors the engine trains, one value at a time
    copy_parameters: Callable[[Pairs], None]
    zero_grad: Callable[[], None]

    def rank_state_dict(self) -> dict[str, torch.Tensor]:
        """The parameters this rank saves and checks a load against: its own chunks' with
        sharded payloads (no collective), else the whole model's."""
        return self.local_state_dict() if self.sharded else self.state_dict()


def view_of(engine: Engine) -> TrainingView:
    """The engine's training-state view (see TrainingView)."""
    topology = engine.topology  # the process groups
    whole, tp_group = topology.whole_group, topology.tensor_group
    plan = engine.plan.to_dict()
    plan.pop("loss_fn", None)  # code, not state
    store = engine.store
    sharded = engine.chunks is not None and engine.chunks.sharded

    def model_state() -> dict[str, torch.Tensor]:
        with engine._local_state_dicts():  # no gathering: names, shapes and dtypes only
            return {k: torch.empty_like(v, device="meta")
                    for k, v in engine.model.state_dict().items()}  # fmt: skip

    def values(names: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
        dtypes = {k: v.dtype for k, v in model_state().items()}
        if not sharded:
            return state_items(store, names, dtypes)
        chunks = engine.chunks
        return state_items(store, names, dtypes, chunks.data_parallel, chunks.step_chunks.chunks)

    return TrainingView(
        model_class=type(engine.model).__name__,
        model=engine.model,
        transformers_config=_transformers_config(engine.model),
        plan=plan,
        world=World(whole, _tensor_parallel_size(engine), engine.data_parallel_size),
        sharded=sharded,
        state_dict=engine.state_dict,
        local_state_dict=engine.local_state_dict,
        model_state=model_state,
        state_items=values,
        parameters=dict(engine.named_parameters()),
        parameter_names=frozenset(
            n for n, _ in engine.model.named_parameters(remove_duplicate=False)
        ),
        optimizer=engine.optimizer,
        objects=engine.stateful(),
        accumulation_steps=engine.plan.optimizer.accumulation_steps,
        step_count=engine.step_count,
        set_step_count=lambda count: setattr(engine, "step_count", count),
        rank_stream=None if tp_group is None else tp_group.stream,
        tensor_splits=_tensor_splits(engine) if tp_group is not None else {},
        stepped=_stepped(engine),
        copy_parameters=lambda pairs: copy_parameters(store, pairs),
        zero_grad=lambda: engine.zero_grad(set_to_none=True),
    )


def _transformers_config(model: nn.Module) -> dict[str, Any] | None:
    """A transformers model's config as JSON (every field, not only those off the defaults,
    so an export rebuilds it without the model's code at hand); None for another model."""
    if not is_transformers(model):
        return None
    return json.loads(model.config.to_json_string(use_diff=False))


def _tensor_splits(engine: Engine) -> dict[str, tuple[int, int]]:
    """How the tensor_parallel pass cut each parameter it split (every capture cuts alike)."""
    splits: dict[str, tuple[int, int]] = {}
    for program in engine.programs.values():
        sharding = program.decisions.tp_sharding
        if sharding is not None:
            splits.update(sharding.splits)
    return splits


def _stepped(engine: Engine) -> frozenset[str] | None:
    """The parameters HybridAdam steps on this rank under data parallelism: those of its own
    chunks and those kept out of the chunks; None where the optimizer steps every one."""
    chunks = engine.chunks
    if not isinstance(engine.optimizer, HybridAdam) or chunks.data_parallel is None:
        return None
    step_chunks = chunks.step_chunks
    own = {id(step_chunks.param(slot)) for chunk in step_chunks.own_trainable()
           for slot in chunk.slots}  # fmt: skip
    chunked = {id(p) for p in step_chunks.params()}
    return frozenset(name for name, p in engine.named_parameters()
                     if id(p) in own or id(p) not in chunked)  # fmt: skip


def _tensor_parallel_size(engine: Engine) -> int:
    """The plan's tensor-parallel size where a process group runs it, else 1."""
    config = engine.plan.tensor_parallel
    if config is None or config.size < 2 or not (dist.is_available() and dist.is_initialized()):
        return 1
    return config.size


def copy_parameters(store: ParameterStore, params: Pairs) -> None:
    """Copy into the tensors the engine trains, never replacing them (the optimizer, the chunk
    manager and the model hold them; a copy bumps their version, so a chunk whose compute
    copy is stale is fetched again). A parameter a pass cut into parts (tiles) is cut the
    same way; a buffer is copied into the engine's own. Given pairs one at a time, each
    value is let go before the next is read."""
    fed = store.tensors()
    done: set[str] = set()

    def copy(name: str, value: torch.Tensor) -> None:
        if name in fed and not isinstance(fed[name], nn.Parameter):
            fed[name].copy_(value)  # a buffer (bf16/fp16: the traced copy's)
            return
        canonical = store.aliases(name)[0]
        if canonical not in done:
            done.add(canonical)
            store.assign(canonical, value)

    one_by_one(params.items() if isinstance(params, Mapping) else params, copy)


def one_by_one(
    pairs: Iterable[tuple[str, torch.Tensor]], copy: Callable[[str, torch.Tensor], Any]
) -> None:
    """`copy(name, value)` for each pair, without grad; each value let go before the next is
    read, so a stream of a checkpoint's tensors never holds two."""
    pairs = iter(pairs)
    with torch.no_grad():
        while (pair := next(pairs, None)) is not None:
            copy(*pair)
            del pair
