"""Where a model computes and where its weights come from: the compute device a plan names
(`place`: the model is never moved whole), and models built on the meta device, which the
engine compiles without their weights and fills straight in the chunk homes afterwards, so
the host never holds the model twice.

The parameters stay on the meta device until the chunks exist: capture traces them as fake
tensors, shape_memory measures on fake tensors, chunk_layout and chunk_schedule need shapes
only. Then each parameter is a view of its chunk home, and `fill` gives the homes their values
from `weights`: a safetensors file or directory (transformers' sharded layout included) read
tensor by tensor (a transformers checkpoint under its model's names by transformers' own
rules: fxstar/hf_checkpoint.py), "init" (each module's `reset_parameters`, or transformers' own
init for a transformers model), or a function of one module (after every module's own
`reset_parameters`, as a constructor runs them). Buffers are small: they get real storage
before capture and their values from the same source; those no checkpoint holds (not
persistent) are computed by a transformers model's own init, no parameter touched
(`compute_buffers`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from fxstar.capture import is_meta
from fxstar.errors import FxstarError, UsageError
from fxstar.hf_checkpoint import converted_source
from fxstar.plan import resolve_device
from fxstar.runtime.disk_pieces import host_slot_bytes
from fxstar.runtime.layout import ChunkPlan, spare_bytes
from fxstar.sizes import format_size
from fxstar.topology import Topology
from fxstar.weights import WeightSource, initialize, is_transformers, materialize, tied_names

__all__ = [
    "HostBudget",
    "HostMemoryError",
    "Weights",
    "check_host_budget",
    "check_plan",
    "fill",
    "forecast_kept",
    "give_buffers_storage",
    "host_budget",
    "is_meta",
    "place",
]

Weights = str | os.PathLike | Callable[[nn.Module], Any] | None


class HostMemoryError(FxstarError, MemoryError):
    """The chunk engine's host allocations would not fit the host budget."""


def physical_memory() -> int:
    """Bytes of memory this machine has."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_budget(plan: Any) -> tuple[int, str]:
    """The host budget and where it comes from: plan.host_memory, else overall_cpu_mem_ratio
    of the machine's memory shared by the processes of this node (LOCAL_WORLD_SIZE, as
    torchrun sets it), as PatrickStar budgets its CPU tier."""
    if plan.host_memory is not None:
        return int(plan.host_memory), "plan.host_memory"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    ratio, total = plan.overall_cpu_mem_ratio, physical_memory()
    where = f"plan.overall_cpu_mem_ratio {ratio:g} of {format_size(total)}"
    if local > 1:
        where += f" / {local} processes"
    return int(ratio * total / max(local, 1)), where


def forecast_kept(plan: Any, chunk_plan: ChunkPlan) -> list[int]:
    """The chunks HybridAdam's device half will keep on the compute tier, forecast from the
    access plan: its margin (see spare_bytes) over what a kept chunk takes there, the
    smallest trainable chunks counted (the least host given back). The runtime chooses from
    the traced step and checks the host budget again then (HostBudget.check)."""
    layout = chunk_plan.layout
    access = chunk_plan.access
    hybrid = plan.hybrid_adam and plan.optimizer.type in ("adam", "adamw")
    if (not hybrid or plan.device_memory is None or chunk_plan.budget is None
            or chunk_plan.static_share is not None or layout.ranks > 1):  # fmt: skip
        return []  # data parallel keeps whole groups by the least margin of any rank: none
    pairs = zip(access.pinned_at_once, access.nonmodel_bytes, strict=True)
    moments = [(pinned * layout.chunk_bytes, other) for pinned, other in pairs]
    spare = spare_bytes(chunk_plan.chunk_budget, chunk_plan.arena_capacity, moments,
                        plan.margin_use_ratio)  # fmt: skip
    share_room = layout.kept_grad_in_payload(
        grads_in_host=plan.grads_in_host, accumulation_steps=plan.optimizer.accumulation_steps
    )
    count = spare // layout.kept_chunk_bytes(share_room=share_room,
                                             state_dtype=plan.optimizer.state_dtype)  # fmt: skip
    trainable = sorted((c for c in layout.chunks if c.trainable), key=lambda c: (c.used, c.id))
    return [c.id for c in trainable[:count]]


def host_need(plan: Any, chunk_plan: ChunkPlan, kept: list[int] | None = None
              ) -> tuple[int, int]:  # fmt: skip
    """What the chunk engine takes on the host: (chunk homes and optimizer state but those
    of the chunks `kept` on the compute tier (None: as forecast), the arena where it lives on
    the host: a CPU-only machine)."""
    layout = chunk_plan.layout
    low_precision = layout.dtype != torch.float32
    adam = plan.optimizer.type in ("adam", "adamw")
    masters_on_disk = low_precision and plan.disk is not None and plan.disk.masters
    need = layout.host_bytes(
        masters=low_precision and not masters_on_disk,
        own_grads=not (low_precision and plan.grads_in_host),
        moments=adam and plan.disk is None, state_dtype=plan.optimizer.state_dtype,
        rank=torch.distributed.get_rank() if layout.ranks > 1 else 0,  # its own moments only
        sharded=layout.ranks > 1 and Topology(plan).sharded_payloads,  # and its own homes only
        kept=forecast_kept(plan, chunk_plan) if kept is None else kept,
    )  # fmt: skip
    if adam and plan.disk is not None:  # the disk tier's parts pass through its host slots
        need += host_slot_bytes(
            plan.optimizer.state_dtype,
            [(c.used, [p.numel for p in c.params]) for c in layout.chunks if c.trainable],
            plan.disk.piece, plan.disk.depth, masters=masters_on_disk,
        )  # fmt: skip
    arena = chunk_plan.arena_capacity if torch.device(chunk_plan.device).type == "cpu" else 0
    return need, arena


def describe_host(plan: Any, chunk_plan: ChunkPlan, kept: list[int] | None = None) -> str:
    """The report's line: the chunk engine's host memory against the host budget."""
    need, arena = host_need(plan, chunk_plan, kept)
    budget, source = host_budget(plan)
    count = len(forecast_kept(plan, chunk_plan) if kept is None else kept)
    return (
        f"host memory: {format_size(need)} for chunk homes and optimizer state"
        + (" (the disk tier's parts in its host slots)" if plan.disk is not None else "")
        + (f" (but the {count} chunks kept on the compute tier)" if count else "")
        + (f" and {format_size(arena)} for the arena" if arena else "")
        + f", of a host budget of {format_size(budget)} ({source})"
    )


def check_host_budget(plan: Any, chunk_plan: ChunkPlan, kept: list[int] | None = None) -> int:
    """Before the chunk homes are allocated: what they, their optimizer state and (on a
    CPU-only machine) the arena take on the host must fit the host budget: a model too large
    for the host is a clear error at compile, not the kernel's OOM killer mid-step. The
    chunks HybridAdam will keep on the compute tier are forecast at compile (`kept` None);
    the first step, before it makes the moments, checks with the chunks it kept. Returns
    the bytes the chunk engine will take."""
    layout = chunk_plan.layout
    need, arena = host_need(plan, chunk_plan, kept)
    budget, source = host_budget(plan)
    if need + arena > budget:
        params = sum(c.used for c in layout.chunks)
        forecast = forecast_kept(plan, chunk_plan)
        when = (
            f"; HybridAdam kept {len(kept)} chunks on the compute tier at the first step, "
            f"where compile forecast {len(forecast)} from the plan (the traced step left less "
            "room)" if kept is not None else ""
        )  # fmt: skip
        raise HostMemoryError(
            f"the chunk engine needs {format_size(need + arena)} of host memory "
            f"({format_size(need)} for {params:,} parameters' chunk homes and optimizer state"
            + (f", {format_size(arena)} for the arena on the host" if arena else "")
            + f"), over the host budget of {format_size(budget)} ({source}){when}; activations "
            "come on top. Raise plan.host_memory or overall_cpu_mem_ratio if the machine has "
            "the room, train in bf16 (14 bytes per parameter instead of 16), or shard the "
            "model over more processes"
        )
    return need + arena


class HostBudget:
    """The host budget of a plan over the chunk plan a program follows: what HybridAdam is
    given to check again once it has chosen the chunks it keeps on the compute tier (their
    host homes go back), before it makes the moments."""

    def __init__(self, plan: Any, program: Any):
        self.plan = plan
        self.program = program  # its chunk plan is read at the check: it may be refined

    def check(self, kept: list[int]) -> int:
        return check_host_budget(self.plan, self.program.decisions.chunk_plan, kept=kept)


def check_plan(model: nn.Module, plan: Any, weights: Weights) -> None:
    """What a meta model needs of the plan and of `weights`, each refusal with its remedy."""
    if weights is None:
        raise UsageError(
            f"{type(model).__name__} has parameters on the meta device (no values): pass "
            "weights= to fxstar.compile: a safetensors file or checkpoint directory to read "
            "them from, 'init' to initialise them in their chunk homes, or a function of one "
            "module"
        )
    if plan.device_memory is None:
        raise UsageError(
            "a model on the meta device trains through the chunk engine, which gives every "
            "parameter its home: set plan.device_memory (a budget, or 'auto'); to train it "
            "without chunks, build it on the host (or model.to_empty(device='cpu') and load it)"
        )
    used = {"verify": plan.verify, "tensor_parallel": plan.tensor_parallel is not None,
            "tiled_linear": plan.tiled_linear is not None}  # fmt: skip
    refused = [name for name, on in used.items() if on]
    if refused:
        raise UsageError(
            f"plan.{', plan.'.join(refused)}: not supported yet for a model built on the meta "
            "device (verify runs the model eagerly; the others cut parameters before the chunks "
            "hold them); build the model on the host for these"
        )


def place(model: nn.Module, plan: Any) -> torch.device | None:
    """The compute device of `plan` (None: 'auto' without an accelerator, the model's own).
    The model is never moved whole: with the chunk engine its parameters stay where they are
    (host or meta) and are paged to the device, and its buffers (small) move there; without
    it the model must be on the device already."""
    device = resolve_device(plan)
    if device is None or (plan.device == "auto" and plan.device_memory is None):
        return None  # nothing to page: the model computes where it is
    if plan.device_memory is None:
        elsewhere = sorted({str(p.device) for p in model.parameters() if p.device != device})
        if elsewhere:
            raise UsageError(
                f"plan.device is {plan.device!r} but the model's parameters are on "
                f"{', '.join(elsewhere)}: set plan.device_memory so the chunk engine pages them "
                f"to {device}, or move the model there first"
            )
        return device
    for module in model.modules():
        for attr, buffer in list(module._buffers.items()):
            if buffer is not None and not buffer.is_meta and buffer.device != device:
                module._buffers[attr] = buffer.to(device)
    return device


def give_buffers_storage(model: nn.Module, device: torch.device | str | None = None) -> list[str]:
    """Zeroed storage (on `device`, default the host) for every buffer on the meta device;
    their values come with the weights. Returns their names."""
    device = "cpu" if device is None else device
    named = []
    for prefix, module in model.named_modules():
        for attr, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.is_meta:
                module._buffers[attr] = torch.zeros(buffer.shape, dtype=buffer.dtype,
                                                    device=device)  # fmt: skip
                named.append(f"{prefix}.{attr}" if prefix else attr)
    return named


def fill(model: nn.Module, weights: Weights, buffers: list[str], *, sharded: bool = False,
         everywhere: bool = False, settled: Callable[[], object] | None = None) -> str:  # fmt: skip
    """Give the model's parameters (views of their chunk homes by now) and the `buffers` that
    had no values their values from `weights`; returns a line for the report. `sharded`
    (data parallel, sharded payloads): the parameters still on the meta device are other
    ranks' chunks, which their owners fill; an init runs on this rank's own alone (cheap),
    or with `everywhere` (release_after_init) on every parameter, the others' on storage
    lent for the init and dropped after: the random numbers are drawn as in one process, so
    each owner's chunks hold the serial model's values."""
    if sharded and everywhere and (callable(weights) or weights == "init"):
        with _lent_storage(model):
            return fill(model, weights, buffers, settled=settled)
    persistent = set(model.state_dict(keep_vars=True))
    unfilled = [name for name in buffers if name not in persistent]
    init = callable(weights) or weights == "init"
    # first: a buffer that cannot be computed is refused before minutes of reading (for a
    # model fxstar cannot compute them for, an init may write them: checked after it)
    if unfilled and (is_transformers(model) or not init):
        compute_buffers(model, unfilled)
        buffers = [name for name in buffers if name in persistent]
    before = _versions(model, buffers) if init else {}
    if callable(weights):
        # as a constructor does: every module's own reset first, then the model's init (one
        # that touches some modules only must not leave the others' homes zero)
        with torch.no_grad():
            for module in model.modules():
                reset = getattr(module, "reset_parameters", None)
                if callable(reset):
                    reset()
    if init:
        elsewhere = [n for n, p in model.named_parameters(remove_duplicate=False)
                     if p.is_meta] if sharded else []  # fmt: skip
        report = initialize(model, {}, init=None if weights == "init" else weights,
                            elsewhere=elsewhere, settled=settled)  # fmt: skip
        _check_written(model, before, report.init)
        return (f"weights: initialised in their chunk homes by {report.init} "
                f"({len(report.modules)} modules, {report.seconds:.2f}s)")  # fmt: skip
    buffers_read = {n: b for n, b in model.named_buffers() if n in persistent}
    with WeightSource(weights) as source:  # named_parameters: one name per tied parameter
        params = dict(model.named_parameters())
        elsewhere = {n for n, p in params.items() if p.is_meta} if sharded else set()
        converted = converted_source(model, source)  # transformers' layouts: experts one by one
        report = materialize({**params, **buffers_read}, converted or source,
                             aliases=tied_names(model), elsewhere=elsewhere,
                             settled=settled)  # fmt: skip
    line = f"weights: read from {os.fspath(weights)} ({report}"
    if converted is not None and converted.conversions():
        parts = converted.conversions()
        line += (f"; {len(parts)} assembled from {sum(map(len, parts.values()))} by "
                 "transformers' conversion rules")  # fmt: skip
    return line + ")"


def _versions(model: nn.Module, names: list[str]) -> dict[str, tuple[torch.Tensor, int, int]]:
    """{name: (buffer, its version counter, its data pointer)}: any write changes one."""
    buffers = dict(model.named_buffers())
    return {n: (buffers[n], buffers[n]._version, buffers[n].data_ptr()) for n in names}


def _check_written(model: nn.Module, before: dict[str, tuple[torch.Tensor, int, int]],
                   init: str) -> None:  # fmt: skip
    """Buffers built on the meta device and given zeroed storage must be written by the init
    that stands in for the checkpoint; one it left alone holds zeros, not its constructor's
    value: refused by name."""
    now = dict(model.named_buffers())
    unwritten = [n for n, (t, version, ptr) in before.items()
                 if now.get(n) is t and t._version == version and t.data_ptr() == ptr]  # fmt: skip
    if unwritten:
        raise UsageError(
            f"buffers {', '.join(unwritten)} were built on the meta device and the init "
            f"({init}) did not write them, so they hold zeros, not the values their constructor "
            "gave them: write them in the init, give them a device in the constructor "
            "(torch.ones(..., device='cpu'): an explicit device wins over torch.device('meta')), "
            "or build the model on the host"
        )


@contextlib.contextmanager
def _lent_storage(model: nn.Module) -> Iterator[None]:
    """Every meta parameter replaced by one with host storage (a tied one by one shared
    replacement) while the block runs, then put back: what was written there is dropped."""
    lent: dict[int, nn.Parameter] = {}
    swapped = []
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                loan = lent.get(id(param))
                if loan is None:
                    loan = lent[id(param)] = nn.Parameter(
                        torch.zeros(param.shape, dtype=param.dtype),
                        requires_grad=param.requires_grad,
                    )
                module._parameters[name] = loan
                swapped.append((module, name, param))
    try:
        yield
    finally:
        for module, name, param in swapped:
            module._parameters[name] = param


def compute_buffers(model: nn.Module, names: list[str]) -> None:
    """Give the non-persistent buffers `names` (in no checkpoint: rotary frequencies, position
    ids, an embedding's scale), built on the meta device, their values without touching a
    parameter. A transformers model computes them as `from_pretrained` does, by its own init
    (`initialize_weights`: each module's `_init_weights`), run while every parameter and every
    other buffer is a meta stand-in marked initialised and the buffers wanted are fresh host
    tensors. It runs twice, on tensors filled with 0 and with 1 under one random state: a
    buffer the init leaves different is not computed by it, and is refused by name. Any other
    model has no such init: its buffers are refused by name."""
    fix = (
        "give them a device in the constructor (torch.arange(..., device='cpu'): an explicit "
        "device wins over torch.device('meta')), or build the model on the host"
    )
    if not is_transformers(model):
        raise UsageError(
            f"buffers {', '.join(names)} are not persistent (no checkpoint holds them) and were "
            f"built on the meta device, so they have no values; fxstar computes such buffers "
            f"through a transformers model's init only, and {type(model).__name__} is none: {fix}"
        )
    runs = []
    state = torch.get_rng_state()
    try:
        for fill_value in (0, 1):
            torch.set_rng_state(state)
            with _stand_ins(model, names, fill_value) as wanted:
                try:
                    model.initialize_weights()  # type: ignore[operator]
                except Exception as err:
                    raise UsageError(
                        f"buffers {', '.join(names)} are not persistent (no checkpoint holds "
                        f"them) and {type(model).__name__}'s init, which computes them, failed "
                        f"on the meta device ({type(err).__name__}: {err}): {fix}"
                    ) from err
            runs.append(wanted)
    finally:
        torch.set_rng_state(state)
    buffers = dict(model.named_buffers(remove_duplicate=False))
    undetermined = [n for n in names if not _determined(runs[0][n], runs[1][n], buffers[n])]
    if undetermined:
        raise UsageError(
            f"buffers {', '.join(undetermined)} are not persistent (no checkpoint holds them), "
            f"were built on the meta device, and {type(model).__name__}'s init "
            f"(_init_weights) does not compute them, so they have no values: {fix}"
        )
    with torch.no_grad():
        for name in names:
            buffers[name].copy_(runs[0][name])


def _determined(first: torch.Tensor, second: torch.Tensor, buffer: torch.Tensor) -> bool:
    """Whether two runs from different fills left one value of the buffer's shape."""
    return (not first.is_meta and not second.is_meta and first.shape == buffer.shape
            and torch.equal(first, second))  # fmt: skip


@contextlib.contextmanager
def _stand_ins(model: nn.Module, names: list[str], fill_value: int) -> Iterator[dict[str, Any]]:
    """While the block runs: every parameter and every buffer but `names` a meta tensor marked
    initialised for transformers' init (a tied one by one shared stand-in), the buffers
    `names` fresh host tensors filled with `fill_value`, every module's initialised mark
    removed; then all of it put back. Yields {name: buffer}, filled in at the end with what
    the block left there (written into, or a tensor of its own put in its place)."""
    wanted = set(names)
    fresh: dict[str, torch.Tensor] = {}
    places: dict[str, tuple[dict, str]] = {}
    stand: dict[int, torch.Tensor] = {}
    swapped: list[tuple[dict, str, Any]] = []
    marks: list[tuple[nn.Module, Any]] = []
    for prefix, module in model.named_modules():
        if "_is_hf_initialized" in module.__dict__:
            marks.append((module, module.__dict__.pop("_is_hf_initialized")))
        for kind in (module._parameters, module._buffers):
            for attr, t in list(kind.items()):
                if t is None:
                    continue
                name = f"{prefix}.{attr}" if prefix else attr
                if name in wanted:
                    new = torch.full(t.shape, fill_value, dtype=t.dtype)
                    places[name] = (kind, attr)
                else:
                    new = stand.get(id(t))
                    if new is None:
                        new = torch.empty(t.shape, dtype=t.dtype, device="meta")
                        if isinstance(t, nn.Parameter):
                            new = nn.Parameter(new, requires_grad=t.requires_grad)
                        new._is_hf_initialized = True  # type: ignore[attr-defined]
                        stand[id(t)] = new
                swapped.append((kind, attr, t))
                kind[attr] = new
    try:
        yield fresh
    finally:
        for name, (kind, attr) in places.items():
            fresh[name] = kind[attr]
        for kind, attr, t in reversed(swapped):
            kind[attr] = t
        for module in model.modules():
            module.__dict__.pop("_is_hf_initialized", None)
        for module, mark in marks:
            module._is_hf_initialized = mark
