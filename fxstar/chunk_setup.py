"""Once per engine, after the chunk passes: the ChunkManager takes the parameters over.

The model's parameters become the stable views of the chunks' host homes, so the model, the
engine and any optimizer keep seeing one set of tensors; a model built on the meta device
gets its weights written there; data-parallel replicas start as rank 0's.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fxstar import placement
from fxstar.errors import UsageError
from fxstar.plan import resolve_device
from fxstar.program import Program
from fxstar.runtime.chunks import ChunkManager
from fxstar.runtime.data_parallel import ChunkGroups
from fxstar.runtime.disk_tier import DiskTier
from fxstar.runtime.host import give_back_freed

if TYPE_CHECKING:
    from fxstar.engine import Engine

__all__ = ["buffers_to_fill", "chunk_manager", "fill_weights", "setup_chunks", "start_chunks"]


def setup_chunks(engine: Engine, program: Program) -> list[torch.Tensor]:
    """The chunks take the parameters over, if the program is the first under the chunk
    passes. Returns the model's own tensors whose storage release_after_init gives back once
    the compile succeeded.

    Why this order: the fp32 masters are read from the model before anything is rebound; the
    host budget is checked before the manager allocates the homes; the manager copies the
    parameters into its homes before the model's parameters are rebound to views of them;
    the storage to give back is what that rebinding replaced."""
    if program.decisions.chunk_layout is None or engine.chunks is not None:
        return []
    masters = _fp32_masters(engine)
    placement.check_host_budget(engine.plan, program.decisions.chunk_plan)
    engine.chunks = chunk_manager(engine, program, engine.store.tensors(), masters,
                                  disk=disk_tier(engine))  # fmt: skip
    if engine.chunks.sharded:
        _gather_in_state_dicts(engine)
    _keep_host_masters(engine, program)
    originals = _rebind_to_homes(engine)
    if not engine.plan.release_after_init:
        return []
    kept = {
        p.untyped_storage().data_ptr() for p in engine.model.parameters() if not p.is_meta
    }  # parameters kept out of the chunks (cpu_embedding)
    return [p for p in originals if p.is_meta or p.untyped_storage().data_ptr() not in kept]


def _fp32_masters(engine: Engine) -> dict[str, torch.Tensor]:
    """The model's own parameters, and the parts a pass cut from one (tiles, a rank's shard)
    cut the same way from it: never a full tensor where a part is fed, nor (bf16/fp16) parts
    cut from the rounded copy."""
    masters = dict(engine.store.tensors())
    for name, p in engine.model.named_parameters(remove_duplicate=False):
        masters.update(engine.store.cut(name, p.detach()))
    return masters


def _keep_host_masters(engine: Engine, program: Program) -> None:
    """bf16/fp16: parameters kept on the host are fed their fp32 masters; the chunks hold the
    low-precision payloads, so the traced copy keeps shapes only (a later capture traces it
    as a meta model; verify runs it, so keeps it)."""
    if not engine.chunks.low_precision:
        return
    own = dict(engine.model.named_parameters(remove_duplicate=False))
    for info in program.params:
        if info.host_resident and info.name in own:
            engine.store.rebind(info.name, own[info.name])
    if not engine.plan.verify:
        _drop_parameter_storage(engine.traced)


def _rebind_to_homes(engine: Engine) -> list[torch.Tensor]:
    """The store and the model feed the chunks' stable views; returns the model's own tensors
    the homes replace (fxstar/release.py)."""
    slots = engine.chunks.layout.slots()
    own = dict(engine.model.named_parameters(remove_duplicate=False))
    originals = []
    for name, stable in engine.chunks.stable.items():
        engine.store.rebind(name, stable)
        for alias in slots[name].aliases:
            if alias in own:  # derived parts (tiles, shards) are not the model's
                originals.append(own[alias])
                owner, _, attr = alias.rpartition(".")
                setattr(engine.model.get_submodule(owner), attr, stable)
    return originals


def buffers_to_fill(model: nn.Module, plan: Any, weights: placement.Weights) -> list[str]:
    """At the engine's start, for a model built on the meta device: the plan and `weights`
    checked, and the buffers given storage that fill_weights writes (the names it returns);
    no other model takes `weights`."""
    if placement.is_meta(model):
        placement.check_plan(model, plan, weights)
        return placement.give_buffers_storage(model, resolve_device(plan))
    if weights is not None:
        raise UsageError(
            "weights= gives a model built on the meta device its values; this model has "
            "them already (load others with model.load_state_dict before compile, or "
            "engine.load)"
        )
    return []


def fill_weights(engine: Engine) -> None:
    """Once, for a model built on the meta device: its parameters are views of their chunk
    homes now; write their values there (and the buffers'), then the low-precision copies
    follow."""
    if engine._weights is None or engine._weights_line is not None or engine.chunks is None:
        return
    with engine._local_state_dicts():  # its names only: nothing gathered
        engine._weights_line = placement.fill(
            engine.model, engine._weights, engine._unfilled_buffers,
            sharded=engine.chunks.sharded, everywhere=engine.plan.release_after_init,
            settled=engine.release_mapped_pages,  # a disk tier's masters: a tensor at a time
        )  # fmt: skip
    engine.chunks.masters_written()
    engine.release_mapped_pages()
    if engine.traced is not engine.model:  # the low-precision copy's buffers, from the model's
        own = dict(engine.model.named_buffers())
        with torch.no_grad():
            for name, buffer in engine.traced.named_buffers():
                buffer.copy_(own[name])
                engine._buffer_values[name] = buffer.clone()


def start_chunks(chunks: ChunkManager) -> None:
    """Once the first chunks hold their values: every data-parallel replica starts as rank
    0's, and what the homes replaced goes back to the system."""
    if chunks.data_parallel is not None:
        chunks.data_parallel.start_alike(chunks.step_chunks)
    give_back_freed()


def chunk_manager(
    engine: Engine,
    program: Program,
    tensors: Mapping[str, torch.Tensor],
    masters: Mapping[str, torch.Tensor] | None = None,
    *,
    disk: DiskTier | None = None,
) -> ChunkManager:
    """The manager the program's ChunkPlan decides, with the plan's run-time knobs; `disk`,
    the engine's disk tier (a verifier's manager has none: its state is short-lived)."""
    plan = engine.plan
    layout = program.decisions.chunk_plan.layout
    groups = None
    if layout.ranks > 1:
        groups = ChunkGroups(layout.ranks, engine.topology.data_group,
                             mem_saving=plan.mem_saving_comm,
                             sharded=engine.topology.sharded_payloads)  # fmt: skip
    return ChunkManager.from_plan(
        program.decisions.chunk_plan, tensors, masters=masters,
        monitor=plan.async_mem_monitor,
        overlap_grad_copies={"on": True, "off": False}.get(plan.overlap_grad_copies),
        prefetch={"on": True, "off": False}.get(plan.prefetch),
        grads_in_host=plan.grads_in_host, data_parallel=groups,
        disk=disk, masters_on_disk=plan.disk is not None and plan.disk.masters,
    )  # fmt: skip


def disk_tier(engine: Engine) -> DiskTier | None:
    """The plan's disk tier, in the rank's own subdirectory when there are several ranks
    (each keeps its own chunks' state, and one directory belongs to one engine): taken here,
    so a second engine on the directory is refused at its compile."""
    disk = engine.plan.disk
    if disk is None:
        return None
    directory = Path(disk.path)
    if engine.topology.world > 1:
        directory = directory / f"rank{torch.distributed.get_rank()}"
    return DiskTier(directory, keep=disk.keep, depth=disk.depth)


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


def _gather_in_state_dicts(engine: Engine) -> None:
    """Sharded payloads: the model's own `state_dict()` (what a training script saves) gathers
    the other ranks' chunks too, as `engine.state_dict()` does (collective: every rank calls
    it), instead of handing out meta tensors that would save no values."""
    ref = weakref.ref(engine)

    def gather(module: nn.Module, state: dict, prefix: str, local_metadata: Any) -> None:
        engine = ref()
        if engine is None or engine._local_depth or engine.chunks is None:
            return
        remote = [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.is_meta]
        if remote:
            full = engine.state_dict()
            for key in remote:
                state[key] = full[key[len(prefix) :]]

    engine.model.register_state_dict_post_hook(gather)
