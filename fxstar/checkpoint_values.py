"""What a checkpoint may hold: every value read back is checked as a Plan's options are, by
the same checks (fxstar/plan.py), before any of it reaches torch.

A checksum (fxstar/saving/) tells a damaged file from a whole one; it cannot tell an edited
file whose checksums were written again, or a checkpoint of another tool, from a good one.
These checks stand between such a file and the optimizer: the learning rate, betas, eps,
weight decay, the step counts, the loss scaler's fields and the RNG states are numbers (or
tensors) of the right type, shape and range, and a file name is a file of the checkpoint.
A value out of place is a `CheckpointError` naming its field and the file. Values that only
the engine can judge (the moments' shapes against its parameters) are checked by
`check_fits` before anything is restored.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from fxstar.errors import CheckpointError, PlanError
from fxstar.plan import (
    MAX_EPS,
    MAX_LOSS_SCALE,
    MAX_LR,
    MAX_WEIGHT_DECAY,
    MIN_EPS,
    _betas,
    _boolean,
    _integer,
    _optional_boolean,
    _real,
    _type_error,
)
from fxstar.runtime.moments import ABSMAX, CODES, quant_blocks

__all__ = ["check_fits", "check_meta", "check_records", "check_state", "is_file_name", "named"]

FIX = "restore it from a copy, or save the checkpoint again"
CRC = re.compile(r"[0-9a-f]{8}")
MT_WORDS = 624  # the Mersenne Twister's state: Python's and NumPy's generators
# the per-parameter optimizer state that has its parameter's shape (torch's Adam, AdamW, SGD,
# RMSprop; fxstar's HybridAdam); other optimizers' keys are compared with their own state
MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg")

Check = Callable[[Any, str], Any]


@contextmanager
def named(file: Path) -> Iterator[None]:
    """A check's PlanError (it names the field) as a CheckpointError naming `file` too."""
    try:
        yield
    except PlanError as error:
        raise CheckpointError(f"{file}: {error}; the file was edited or damaged; {FIX}") from None


def _rate(v: Any, name: str) -> Any:
    """A learning rate as a scheduler leaves it: 0 (a warmup's first step) up to the plan's
    largest."""
    return _real(0, MAX_LR)(_number(v), name)


def _number(v: Any) -> Any:
    """A one-element tensor as its number (torch allows a tensor lr and step)."""
    return v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v


def is_file_name(v: Any) -> bool:
    """A file name with no directory part: all a checkpoint's records may give."""
    return isinstance(v, str) and v not in ("", ".", "..") and not any(c in v for c in "/\\\0")


def _plain_name(v: Any, name: str) -> str:
    if not is_file_name(v):
        raise _type_error(name, "the name of a file in the checkpoint's directory", v)
    return v


def _mapping(v: Any, name: str) -> Mapping:
    if not isinstance(v, Mapping):
        raise _type_error(name, "a JSON object", v)
    return v


def _sequence(v: Any, name: str, length: int | None = None) -> list | tuple:
    if not isinstance(v, list | tuple) or (length is not None and len(v) != length):
        raise _type_error(name, "a list" + (f" of {length}" if length is not None else ""), v)
    return v


def _tensor(v: Any, name: str, dtype: torch.dtype | None = None, numel: int | None = None) -> Any:
    if (
        not isinstance(v, torch.Tensor)
        or (dtype is not None and v.dtype != dtype)
        or (numel is not None and (v.dim() != 1 or v.numel() != numel))
    ):
        what = f"a {dtype or ''} tensor".replace("  ", " ")
        raise _type_error(name, what + (f" of {numel} elements" if numel else ""), v)
    return v


def _finite_everywhere(v: Any, name: str) -> None:
    """Every number inside `v` (lists, dicts, one-element tensors) is finite."""
    v = _number(v)
    if isinstance(v, float) and not math.isfinite(v):
        raise PlanError(f"{name}: must be finite, got {v!r}")
    if isinstance(v, Mapping):
        for key, item in v.items():
            _finite_everywhere(item, f"{name}.{key}")
    elif isinstance(v, list | tuple):
        for i, item in enumerate(v):
            _finite_everywhere(item, f"{name}[{i}]")


# -- training.json's own fields -----------------------------------------------------------------


def check_meta(meta: Mapping[str, Any], file: Path) -> None:
    """The fields of training.json that say where its parts are: ranks, file names, the
    tensor-parallel size, the records of its files."""
    with named(file):
        ranks = _integer(1)(meta.get("ranks", 1), "ranks")
        _integer(1)(meta.get("data_parallel", 1), "data_parallel")
        _plain_name(meta.get("tensors"), "tensors")
        parameters = _mapping(meta.get("parameters", {}), "parameters")
        for i, name in enumerate(_sequence(parameters.get("files", []), "parameters.files")):
            _plain_name(name, f"parameters.files[{i}]")
        if "rank_states" in meta:
            for key, entry in _mapping(meta["rank_states"], "rank_states").items():
                if not (isinstance(key, str) and key.isdigit() and 0 < int(key) < ranks):
                    raise PlanError(f"rank_states: {key!r} is no rank in [1, {ranks})")
                entry = _mapping(entry, f"rank_states.{key}")
                _plain_name(entry.get("tensors"), f"rank_states.{key}.tensors")
        plan = meta.get("plan")
        split = plan.get("tensor_parallel") if isinstance(plan, Mapping) else None
        if isinstance(split, Mapping):
            _integer(1)(split.get("size", 1), "plan.tensor_parallel.size")
        if "files" in meta:
            check_records(meta["files"], "files")


def check_records(records: Any, name: str) -> Mapping[str, Any]:
    """The size and CRC-32 of each file (and of each tensor of a safetensors file)."""
    for file, record in _mapping(records, name).items():
        _plain_name(file, f"{name} key")
        record = _mapping(record, f"{name}.{file}")
        _integer(0)(record.get("bytes"), f"{name}.{file}.bytes")
        if not (isinstance(record.get("crc32"), str) and CRC.fullmatch(record["crc32"])):
            raise _type_error(f"{name}.{file}.crc32", "8 hex digits", record.get("crc32"))
        for tensor, crc in _mapping(record.get("tensors", {}), f"{name}.{file}.tensors").items():
            if not (isinstance(crc, str) and CRC.fullmatch(crc)):
                raise _type_error(f"{name}.{file}.tensors.{tensor}", "8 hex digits", crc)
    return records


# -- the training state -------------------------------------------------------------------------


def check_state(state: Any, file: Path) -> None:
    """A training state as `engine.training_state()` gave it (tensors in place): its step,
    RNG, optimizer and loss-scaler values."""
    with named(file):
        state = _mapping(state, "state")
        step = _mapping(state.get("step"), "step")
        micro = _integer(0)(step.get("micro_steps"), "step.micro_steps")
        taken = _integer(0)(step.get("optimizer_steps"), "step.optimizer_steps")
        if taken > micro:
            raise PlanError(
                f"step.optimizer_steps: must be at most step.micro_steps ({micro}), got {taken}"
            )
        _check_rng(_mapping(state.get("rng"), "rng"), "rng")
        _check_optimizer(_mapping(state.get("optimizer"), "optimizer"), "optimizer")
        if "loss_scaler" in state:
            _check_loss_scaler(_mapping(state["loss_scaler"], "loss_scaler"), "loss_scaler")


def _rng_bytes() -> int:
    return torch.get_rng_state().numel()


def _check_rng(rng: Mapping[str, Any], name: str) -> None:
    _tensor(rng.get("torch"), f"{name}.torch", torch.uint8, _rng_bytes())
    for i, s in enumerate(_sequence(rng.get("cuda", []), f"{name}.cuda")):
        _tensor(s, f"{name}.cuda[{i}]", torch.uint8)
    if "python" in rng:  # random.getstate(): (version, 624 words and an index, gauss)
        version, internal, gauss = _sequence(rng["python"], f"{name}.python", 3)
        _integer(1)(version, f"{name}.python[0]")
        internal = _sequence(internal, f"{name}.python[1]", MT_WORDS + 1)
        for i, word in enumerate(internal[:MT_WORDS]):
            _integer(0, 2**32 - 1)(word, f"{name}.python[1][{i}]")
        _integer(0, MT_WORDS)(internal[MT_WORDS], f"{name}.python[1][{MT_WORDS}]")
        _real(optional=True)(gauss, f"{name}.python[2]")
    if "numpy" in rng:  # np.random.get_state(): kind, 624 words, position, gauss
        kind, keys, pos, has_gauss, gauss = _sequence(rng["numpy"], f"{name}.numpy", 5)
        if kind != "MT19937":
            raise _type_error(f"{name}.numpy[0]", "'MT19937'", kind)
        for i, word in enumerate(_sequence(keys, f"{name}.numpy[1]", MT_WORDS)):
            _integer(0, 2**32 - 1)(word, f"{name}.numpy[1][{i}]")
        _integer(0, MT_WORDS)(pos, f"{name}.numpy[2]")
        _integer(0, 1)(has_gauss, f"{name}.numpy[3]")
        _real()(gauss, f"{name}.numpy[4]")
    if "tensor_parallel" in rng:  # runtime/rng_tracker.py's RankStream
        stream = _mapping(rng["tensor_parallel"], f"{name}.tensor_parallel")
        _integer(0)(stream.get("seed"), f"{name}.tensor_parallel.seed")
        _tensor(stream.get("cpu"), f"{name}.tensor_parallel.cpu", torch.uint8, _rng_bytes())
        for key, s in _mapping(stream.get("cuda", {}), f"{name}.tensor_parallel.cuda").items():
            if not (isinstance(key, str) and key.isdigit()):
                raise _type_error(f"{name}.tensor_parallel.cuda key", "a device index", key)
            _tensor(s, f"{name}.tensor_parallel.cuda.{key}", torch.uint8)


# optimizer param-group fields: the plan's checks where the plan has the option
GROUP_FIELDS: dict[str, Check] = {
    "lr": _rate,
    "initial_lr": _rate,  # set by an lr scheduler
    "betas": lambda v, name: _betas([_number(b) for b in _sequence(v, name, 2)], name),
    "eps": lambda v, name: _real(MIN_EPS, MAX_EPS)(_number(v), name),
    "weight_decay": lambda v, name: _real(0, MAX_WEIGHT_DECAY)(_number(v), name),
    "momentum": lambda v, name: _real(0, 1, hi_open=True)(_number(v), name),
    "dampening": lambda v, name: _real(0, 1)(_number(v), name),
    **dict.fromkeys(("amsgrad", "maximize", "nesterov", "capturable"), _boolean),
    **dict.fromkeys(("differentiable", "decoupled_weight_decay"), _boolean),
    **dict.fromkeys(("foreach", "fused"), _optional_boolean),
}


def _check_optimizer(optimizer: Mapping[str, Any], name: str) -> None:
    groups = _sequence(optimizer.get("param_groups"), f"{name}.param_groups")
    seen: set[int] = set()
    for g, group in enumerate(groups):
        where = f"{name}.param_groups[{g}]"
        group = _mapping(group, where)
        for i, index in enumerate(_sequence(group.get("params"), f"{where}.params")):
            _integer(0)(index, f"{where}.params[{i}]")
            if index in seen:
                raise PlanError(f"{where}.params[{i}]: parameter {index} is in two groups")
            seen.add(index)
        for key, value in group.items():
            if key in GROUP_FIELDS:
                GROUP_FIELDS[key](value, f"{where}.{key}")
            elif key != "params":
                _finite_everywhere(value, f"{where}.{key}")
    for index, state in _mapping(optimizer.get("state", {}), f"{name}.state").items():
        where = f"{name}.state[{index!r}]"
        if index not in seen:
            raise PlanError(f"{where}: no param group holds parameter {index!r}")
        for key, value in _mapping(state, where).items():
            if key == "step":
                _real(0)(_number(value), f"{where}.step")
            elif key in MOMENTS and not (
                isinstance(value, torch.Tensor) and value.is_floating_point()
            ):
                raise _type_error(f"{where}.{key}", "a floating-point tensor", value)
            elif key in CODES:  # HybridAdam's 8-bit moments (runtime/moments.py)
                _tensor(value, f"{where}.{key}", torch.uint8)
            elif key in ABSMAX:
                _tensor(value, f"{where}.{key}", torch.float32)
                if not bool(torch.isfinite(value).all() and (value >= 0).all()):
                    raise PlanError(f"{where}.{key}: a block's absmax is finite and not negative")
            else:
                _finite_everywhere(value, f"{where}.{key}")
    if optimizer.get("fxstar_device_chunks") is not None:  # HybridAdam's device half
        chunks = _sequence(optimizer["fxstar_device_chunks"], f"{name}.fxstar_device_chunks")
        for i, chunk in enumerate(chunks):
            _integer(0)(chunk, f"{name}.fxstar_device_chunks[{i}]")
    if "fxstar_data_parallel" in optimizer:
        _integer(1)(optimizer["fxstar_data_parallel"], f"{name}.fxstar_data_parallel")


# runtime/loss_scale.py's LossScaler, field by field (a test keeps this in step with it)
LOSS_SCALER_FIELDS: dict[str, Check] = {
    "scale": _real(0, MAX_LOSS_SCALE, lo_open=True),
    "dynamic": _boolean,
    "window": _integer(1),
    "hysteresis": _integer(1),
    "min_scale": _real(0, MAX_LOSS_SCALE, lo_open=True),
    "clean_steps": _integer(0),
    "overflows_left": _integer(0),
    "skipped_steps": _integer(0),
    "warn_after": _integer(0),
    "skip_streak": _integer(0),
}


def _check_loss_scaler(state: Mapping[str, Any], name: str) -> None:
    for key, value in state.items():  # an unknown field is LossScaler's own error
        if key in LOSS_SCALER_FIELDS:
            LOSS_SCALER_FIELDS[key](value, f"{name}.{key}")


# -- against the engine -------------------------------------------------------------------------

# torch.optim.lr_scheduler's state: learning rates and counters
SCHEDULER_FIELDS: dict[str, Check] = {
    "last_epoch": _integer(-1),
    "_step_count": _integer(0),
}


def check_fits(
    optimizer_state: Mapping[str, Any],
    params: list[torch.Tensor],
    objects: Mapping[str, Any],
    state: Mapping[str, Any],
    file: Path,
) -> None:
    """What only the engine can judge, before anything is restored: each parameter's moments
    have its shape (a copy would broadcast a wrong one silently), the optimizer has as many
    parameters as the state names, and an lr scheduler's rates and counters are in range.
    `params`: the optimizer's parameters in the order the (remapped) state's ids count."""
    with named(file):
        for index, entry in optimizer_state.get("state", {}).items():
            if not (isinstance(index, int) and 0 <= index < len(params)):
                raise PlanError(
                    f"optimizer.state[{index!r}]: the optimizer has {len(params)} parameters"
                )
            shape = tuple(params[index].shape)
            for key, value in entry.items():
                if key in (*MOMENTS, *CODES) and tuple(value.shape) != shape:
                    raise PlanError(
                        f"optimizer.state[{index}].{key}: must have its parameter's shape "
                        f"{list(shape)}, got {list(value.shape)}"
                    )
                blocks = quant_blocks(params[index].numel())
                if key in ABSMAX and tuple(value.shape) != (blocks,):
                    raise PlanError(
                        f"optimizer.state[{index}].{key}: must hold one absmax per block of its "
                        f"parameter's {params[index].numel():,} values ({blocks}), got "
                        f"{list(value.shape)}"
                    )
        for name, obj in objects.items():
            if isinstance(obj, torch.optim.lr_scheduler.LRScheduler) and name in state:
                saved = _mapping(state[name], name)
                for key in ("base_lrs", "_last_lr"):
                    if key in saved:
                        rates = _sequence(saved[key], f"{name}.{key}", len(obj.base_lrs))
                        for i, rate in enumerate(rates):
                            _rate(rate, f"{name}.{key}[{i}]")
                for key, check in SCHEDULER_FIELDS.items():
                    if key in saved:
                        check(saved[key], f"{name}.{key}")
                _finite_everywhere(saved, name)
