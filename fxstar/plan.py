"""Plan: every option fxstar has, with its default, its doc, and its validation in one place.

A Plan is data. It is checked when built (ranges, types, unknown keys with a suggestion), it
round-trips through dicts and JSON, it reads PatrickStar-style configs (fxstar.patrickstar
translates them), and it refuses, through `check_implemented`, to let an option whose feature
does not exist yet pass silently.
Options that only make sense as a group (optimizer, loss scaling, tiling, tensor parallel) are
small dataclasses; wherever a group is expected a dict of its options works too.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import functools
import json
import math
import os
import re
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar

import torch

from fxstar.errors import OptionNotImplementedError, PlanError
from fxstar.sizes import Share, Size, format_size, parse_size

__all__ = [
    "LossScaleConfig",
    "OptimizerConfig",
    "Plan",
    "PlanError",
    "TensorParallelConfig",
    "TiledLinearConfig",
    "check_option_names",
    "option_names",
    "resolve_device",
]


# ---------------------------------------------------------------------------------------------
# Checks: each takes (value, dotted option name) and returns the normalised value or raises.

Check = Callable[[Any, str], Any]


def _type_error(name: str, expected: str, value: object) -> PlanError:
    return PlanError(f"{name}: must be {expected}, got {value!r} ({type(value).__name__})")


def _bound_text(lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> str:
    def show(bound: float) -> str:  # an int bound exactly (2**64 - 1 is no 1.84467e+19)
        return str(bound) if isinstance(bound, int) else f"{bound:g}"

    if lo is None and hi is None:
        return "a finite number"
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{show(lo)}, {show(hi)}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {show(lo)}"
    return f"{'<' if hi_open else '<='} {show(hi)}"


def _in_bounds(v: float, lo, hi, lo_open: bool, hi_open: bool) -> bool:
    above = lo is None or (v > lo if lo_open else v >= lo)
    below = hi is None or (v < hi if hi_open else v <= hi)
    return above and below


def _real(lo=None, hi=None, *, lo_open=False, hi_open=False, optional=False) -> Check:
    """A finite number within the bounds: inf and nan never make sense as an option and would
    reach the kernels as NaN parameters or a loss scale that skips every step."""

    def check(v, name):
        if v is None and optional:
            return None
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise _type_error(name, "a number" + (" or None" if optional else ""), v)
        if not math.isfinite(v) or not _in_bounds(v, lo, hi, lo_open, hi_open):
            bounds = _bound_text(lo, hi, lo_open, hi_open)
            if (lo is None) != (hi is None):
                bounds += " and finite"
            raise PlanError(f"{name}: must be {bounds}, got {v!r}")
        return float(v)

    return check


def _integer(lo: int | None = None, hi: int | None = None, *, optional=False) -> Check:
    def check(v, name):
        if v is None and optional:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            raise _type_error(name, "an int" + (" or None" if optional else ""), v)
        if not _in_bounds(v, lo, hi, False, False):
            raise PlanError(f"{name}: must be {_bound_text(lo, hi, False, False)}, got {v!r}")
        return v

    return check


def _boolean(v, name):
    if not isinstance(v, bool):
        raise _type_error(name, "a bool", v)
    return v


def _optional_boolean(v, name):
    return None if v is None else _boolean(v, name)


def _choice(*options: str) -> Check:
    """One of `options`, matched case-insensitively and stored in the spelling given here."""

    def check(v, name):
        if isinstance(v, str) and v.lower() in options:
            return v.lower()
        raise PlanError(f"{name}: must be one of {', '.join(map(repr, options))}, got {v!r}")

    return check


def _names(v, name) -> tuple[str, ...]:
    if isinstance(v, str) or not isinstance(v, Sequence):
        raise _type_error(name, "a list of strings", v)
    for item in v:
        if not isinstance(item, str) or not item:
            raise PlanError(f"{name}: every entry must be a non-empty string, got {item!r}")
    return tuple(v)


MAX_SIZE = 2**63 - 1  # bytes: an int64 (torch's sizes) and a size_t hold it


def _size(v, name) -> Size | None:
    if v is None:
        return None
    try:
        size = parse_size(v, name)
    except ValueError as error:
        raise PlanError(str(error)) from None
    if isinstance(size, int) and size > MAX_SIZE:
        raise PlanError(
            f"{name}: must be at most 2**63 - 1 bytes (an int64), got {v!r}; give a budget "
            "the machine can hold, like '4GiB' or '30%'"
        )
    return size


def _device_memory(v, name) -> Size | str | None:
    """A size, or 'auto': what the compiled plan needs at the least (a CUDA device's capacity
    times overall_gpu_mem_ratio), known only once the graph is (chunk_layout resolves it)."""
    if v == "auto":
        return v
    try:
        return _size(v, name)
    except PlanError as error:
        raise PlanError(f"{error}; or 'auto'") from None


def _device(v, name) -> str:
    """'auto', 'cpu', 'cuda' or 'cuda:N'; whether this machine has it is checked at compile
    (resolve_device), so a plan written for a GPU machine still loads elsewhere."""
    text = str(v) if isinstance(v, torch.device) else v
    if not isinstance(text, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", text):
        raise PlanError(f"{name}: must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {v!r}")
    return text


def resolve_device(plan: Plan) -> torch.device | None:
    """The compute device `plan.device` names on this machine, made the process's current CUDA
    device (collectives and bare 'cuda' tensors go there); None for 'auto' without an
    accelerator (the model's own device). 'auto' and 'cuda' mean this process's card: under
    torchrun (LOCAL_RANK set) the local rank's, so the ranks of a node take one card each
    (under fake_dist they share the current one). A device the machine does not have is
    refused."""
    name = plan.device
    if name == "auto" and not torch.cuda.is_available():
        return None
    device = torch.device("cuda" if name == "auto" else name)
    if device.type != "cuda":
        return device
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index, which = device.index, repr(name)
    remedy = "use 'auto' (an accelerator if there is one, else the host) or 'cpu'"
    local = os.environ.get("LOCAL_RANK")
    if index is None and local is not None and count and not plan.fake_dist:
        index, which = int(local), f"{name!r} under torchrun (LOCAL_RANK {local}'s card)"
        remedy = ("launch at most one process per card (torchrun --nproc-per-node), or set "
                  "fake_dist for the ranks to share one")  # fmt: skip
    elif index is None:
        index = torch.cuda.current_device() if count else 0
    if index >= count:
        raise PlanError(
            f"device: {which} does not exist here: this machine has {count} CUDA "
            f"device(s){' (torch is a CPU build)' if torch.version.cuda is None else ''}; "
            f"{remedy}"
        )
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _check_warmup_share(plan: Plan) -> None:
    """warmup_gpu_chunk_mem_ratio is PatrickStar's share for chunks while usage is not traced
    yet, which its static partition keeps for the whole run. fxstar traces the step at
    compile time, so it has no warm-up: the share means something only under static_partition,
    and a value set without it is refused rather than ignored."""
    default = Plan.__dataclass_fields__["warmup_gpu_chunk_mem_ratio"].default
    if plan.warmup_gpu_chunk_mem_ratio != default and not plan.static_partition:
        raise PlanError(
            f"warmup_gpu_chunk_mem_ratio={plan.warmup_gpu_chunk_mem_ratio:g} is read only with "
            "static_partition=True (the chunks' fixed share of device_memory): without it the "
            "chunks take, at each moment, what the traced step leaves, and there is no warm-up "
            "to apply a share to; set static_partition=True or leave the ratio out"
        )


def _check_state_dtype(plan: Plan) -> None:
    """Lean moments are HybridAdam's, which runs over chunks: without a budget and in fp32 the
    engine has none, and torch's Adam would keep fp32 moments whatever was asked."""
    state_dtype = plan.optimizer.state_dtype
    if state_dtype != "fp32" and plan.device_memory is None and plan.precision == "fp32":
        raise PlanError(
            f"optimizer.state_dtype: {state_dtype!r} needs HybridAdam, which runs over chunks: "
            "set plan.device_memory (a budget, or 'auto'); without chunks torch's Adam keeps "
            "fp32 moments"
        )


def _check_disk(plan: Plan) -> None:
    """The disk tier holds HybridAdam's moments, which runs over chunks with Adam/AdamW: a
    plan with neither would ignore it."""
    if plan.disk is None:
        return
    if plan.optimizer.type not in ("adam", "adamw"):
        raise PlanError(
            f"disk: the disk tier holds HybridAdam's moments; optimizer.type "
            f"{plan.optimizer.type!r} has none there: use 'adam' or 'adamw', or leave disk out"
        )
    if plan.device_memory is None and plan.precision == "fp32":
        raise PlanError(
            "disk: the disk tier holds the chunks' optimizer state (HybridAdam), and this plan "
            "has no chunks: set plan.device_memory (a budget, or 'auto')"
        )


def _path(v, name) -> str:
    if isinstance(v, str | os.PathLike) and os.fspath(v):
        return os.fspath(v)
    raise _type_error(name, "a directory path", v)


def _disk(v, name):
    if isinstance(v, str | os.PathLike):  # a bare directory
        return DiskConfig(path=_path(v, f"{name}.path"))
    return _group(DiskConfig, optional=True)(v, name)


def _chunk_size(v, name):
    if v == "auto":
        return v
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise PlanError(f"{name}: must be 'auto' or an int > 0 (elements), got {v!r}")
    return v


def _checkpoint(v, name):
    if v is None or v in ("blocks", "auto"):
        return v
    if isinstance(v, Sequence) and not isinstance(v, str):
        return _names(v, name) or None
    raise PlanError(
        f"{name}: must be None, 'blocks', 'auto' or a list of module-name patterns, got {v!r}"
    )


def _betas(v, name):
    if isinstance(v, str) or not isinstance(v, Sequence) or len(v) != 2:
        raise _type_error(name, "a pair of numbers (beta1, beta2)", v)
    return tuple(_real(0, 1, hi_open=True)(b, f"{name}[{i}]") for i, b in enumerate(v))


TP_STYLES = ("column", "row", "replicate")


def _tp_rules(v, name):
    if not isinstance(v, Mapping):
        raise _type_error(name, "a dict of module-name pattern -> style", v)
    out = {}
    for pattern, style in v.items():
        if not isinstance(pattern, str) or not pattern:
            raise PlanError(f"{name}: every pattern must be a non-empty string, got {pattern!r}")
        out[pattern] = _choice(*TP_STYLES)(style, f"{name}[{pattern!r}]")
    return out


def _loss_fn(v, name):
    if v is not None and not callable(v):
        raise _type_error(name, "None or a callable", v)
    return v


def _option(default: Any = MISSING, *, doc: str, check: Check, feature: str = "", factory=None):
    """A dataclass field carrying its doc, its check and the feature that implements it."""
    metadata = {"doc": doc, "check": check, "feature": feature}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


# ---------------------------------------------------------------------------------------------
# Shared machinery for Plan and its groups.


def _options(obj_or_cls) -> list[dataclasses.Field]:
    return [f for f in fields(obj_or_cls) if "doc" in f.metadata]


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not MISSING else f.default


def _unknown(name: str, known: Sequence[str]) -> PlanError:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f" — did you mean {close[0]!r}?" if close else f"; known options: {', '.join(known)}"
    return PlanError(f"unknown option {name!r}{hint}")


def _check_keys(data: Mapping, known: Sequence[str], prefix: str = "") -> None:
    for key in data:
        if key not in known:
            raise _unknown(f"{prefix}{key}", [f"{prefix}{k}" for k in known])


def _validate(obj: Any, prefix: str) -> None:
    for f in _options(obj):
        value = f.metadata["check"](getattr(obj, f.name), prefix + f.name)
        object.__setattr__(obj, f.name, value)


def _plain(value: Any) -> Any:
    """JSON-shaped copy: groups to dicts, tuples to lists, shares to '30%'."""
    if isinstance(value, Share):
        return str(value)
    if isinstance(value, _Group):
        return {f.name: _plain(getattr(value, f.name)) for f in _options(value)}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


class _Group:
    """Base of the option groups: validation in __post_init__, construction from a dict."""

    _prefix: ClassVar[str] = ""

    def __post_init__(self) -> None:
        _validate(self, self._prefix + ".")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]):
        """Build from a dict; missing keys take defaults, unknown keys are a PlanError."""
        if not isinstance(data, Mapping):
            raise _type_error(cls._prefix, f"a {cls.__name__} or a dict of its options", data)
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return _plain(self)


def _named_options(cls):
    """Class decorator: an unknown keyword is a PlanError with a suggestion (as from a dict),
    not the dataclass's bare TypeError."""
    init = cls.__init__
    prefix = f"{cls._prefix}." if getattr(cls, "_prefix", "") else ""
    known = [f.name for f in _options(cls)]

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        _check_keys(kwargs, known, prefix)
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


def _group(cls: type[_Group], *, optional: bool, scalar: str | None = None) -> Check:
    def check(v, name):
        if v is None and optional:
            return None
        if isinstance(v, cls):
            return v
        if isinstance(v, Mapping):
            return cls.from_dict(v)
        if scalar and isinstance(v, int | float) and not isinstance(v, bool):
            return cls(**{scalar: v})
        expected = ("None, " if optional else "") + f"a {cls.__name__} or a dict of its options"
        raise _type_error(name, expected, v)

    return check


# ---------------------------------------------------------------------------------------------
# Option groups.

# Beyond these a run only diverges, to NaN parameters or to a loss scale that skips every step.
MAX_LR = 10.0
MIN_EPS = 2.0**-126  # float32's smallest normal: the kernels add eps in float32, and 0 gives 0/0
MAX_EPS = 1.0
MAX_WEIGHT_DECAY = 10.0
MAX_LOSS_SCALE = 2.0**64  # as 2**initial_scale_power at its largest
MAX_DIST_TIMEOUT = 86400.0  # a day: a collective waiting longer has hung
MAX_SEED = 2**64 - 1  # the largest seed torch.manual_seed takes


@_named_options
@dataclass(frozen=True)
class OptimizerConfig(_Group):
    """The optimizer run over the parameters (over the chunks when hybrid_adam is on)."""

    _prefix: ClassVar[str] = "optimizer"

    type: str = _option(
        "adamw", check=_choice("adamw", "adam", "sgd"),
        doc="'adamw' (decoupled weight decay), 'adam' (L2 added to the gradient) or 'sgd'.",
    )  # fmt: skip
    lr: float = _option(
        1e-3, check=_real(0, MAX_LR, lo_open=True),
        doc="Learning rate. With 'adamw' or 'sgd', lr * weight_decay must stay below 1.",
    )  # fmt: skip
    betas: tuple[float, float] = _option(
        (0.9, 0.999), check=_betas,
        doc="Adam's (beta1, beta2), each in [0, 1); sgd uses beta1 as momentum.",
    )  # fmt: skip
    eps: float = _option(
        1e-8, check=_real(MIN_EPS, MAX_EPS),
        doc="Adam's denominator epsilon (at least float32's smallest normal, 2**-126).",
    )  # fmt: skip
    weight_decay: float = _option(
        0.0, check=_real(0, MAX_WEIGHT_DECAY),
        doc="Weight decay, applied to parameters not matched by no_decay.",
    )  # fmt: skip
    no_decay: tuple[str, ...] = _option(
        ("bias", "norm", "ln_", "layernorm"), check=_names,
        doc="Parameter-name patterns exempt from weight decay. A pattern with a glob character "
        "(* ? [) is matched with fnmatch against the full dotted name; any other pattern is a "
        "case-insensitive substring of the name (so 'norm' matches 'ln_f.LayerNorm.weight'). "
        "See OptimizerConfig.decays.",
    )  # fmt: skip
    clip_grad_norm: float | None = _option(
        None, check=_real(0, lo_open=True, optional=True),
        doc="Clip the global gradient L2 norm to this value before each step; None = off.",
    )  # fmt: skip
    accumulation_steps: int = _option(
        1, check=_integer(1),
        doc="Micro-batches whose gradients are summed before one optimizer step.",
    )  # fmt: skip
    state_dtype: str = _option(
        "fp32", check=_choice("fp32", "bf16", "8bit"),
        doc="How HybridAdam keeps Adam's two moments: 'fp32' (8 bytes per parameter), 'bf16' "
        "(4: computed in fp32, stored rounded to nearest even) or '8bit' (about 2.03: "
        "bitsandbytes' blockwise dynamic quantisation, an fp32 absmax per 256 values of a "
        "parameter). The master weights stay fp32. Needs Adam or AdamW over chunks "
        "(HybridAdam: plan.device_memory set, or precision bf16/fp16); a checkpoint saved in "
        "another state_dtype is converted on loading.",
    )  # fmt: skip

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.type == "sgd" and self.state_dtype != "fp32":
            raise PlanError(
                f"optimizer.state_dtype: {self.state_dtype!r} is for Adam's moments (HybridAdam); "
                "'sgd' keeps a torch momentum buffer in fp32: use type 'adam' or 'adamw', or "
                "state_dtype 'fp32'"
            )
        # adamw and sgd scale each weight by (1 - lr * weight_decay) every step: at 1 or more
        # the weights are zeroed or flip sign
        shrink = self.lr * self.weight_decay
        if self.type in ("adamw", "sgd") and shrink >= 1:
            raise PlanError(
                f"optimizer.weight_decay: lr * weight_decay must be < 1 for {self.type!r} (each "
                f"step scales the weights by 1 - lr * weight_decay), got {self.lr:g} * "
                f"{self.weight_decay:g} = {shrink:g}; lower one of them"
            )

    def decays(self, param_name: str) -> bool:
        """Whether weight decay applies to the parameter called `param_name`."""
        lowered = param_name.lower()
        for pattern in self.no_decay:
            if any(c in pattern for c in "*?["):
                if fnmatch.fnmatchcase(param_name, pattern):
                    return False
            elif pattern.lower() in lowered:
                return False
        return True


@_named_options
@dataclass(frozen=True)
class LossScaleConfig(_Group):
    """Loss scaling for fp16 (ignored for fp32 and bf16); names follow DeepSpeed/PatrickStar."""

    _prefix: ClassVar[str] = "loss_scale"

    loss_scale: float = _option(
        0.0, check=_real(0, MAX_LOSS_SCALE),
        doc="A fixed loss scale; 0 = dynamic scaling (the settings below).",
    )  # fmt: skip
    initial_scale_power: int = _option(
        16, check=_integer(0, 64), doc="Dynamic scaling starts at 2**initial_scale_power."
    )
    loss_scale_window: int = _option(
        1000, check=_integer(1), doc="Steps without overflow before the scale is doubled."
    )
    hysteresis: int = _option(
        2, check=_integer(1), doc="Overflows tolerated before the scale is halved."
    )
    min_loss_scale: float = _option(
        1.0, check=_real(0, MAX_LOSS_SCALE, lo_open=True),
        doc="Dynamic scaling never goes below this; at most 2**initial_scale_power.",
    )  # fmt: skip
    warn_after_skips: int = _option(
        10, check=_integer(0),
        doc="Warn, once per streak, when this many steps in a row were skipped for overflow: "
        "scaling alone is not fixing it (a NaN loss, too high an lr). 0 = never.",
    )  # fmt: skip

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.loss_scale == 0 and self.min_loss_scale > 2.0**self.initial_scale_power:
            raise PlanError(
                f"loss_scale.min_loss_scale: must be at most the initial scale "
                f"2**initial_scale_power = {2.0**self.initial_scale_power:g}, got "
                f"{self.min_loss_scale:g}; lower it or raise initial_scale_power"
            )


@_named_options
@dataclass(frozen=True)
class TiledLinearConfig(_Group):
    """Split large linears into tiles so one tile's weight, not the whole, is resident."""

    _prefix: ClassVar[str] = "tiled_linear"

    in_splits: int = _option(1, check=_integer(1), doc="Tiles along the input features.")
    out_splits: int = _option(1, check=_integer(1), doc="Tiles along the output features.")
    min_size: int = _option(
        1 << 20, check=_integer(0), doc="Only weights with at least this many elements are tiled."
    )


@_named_options
@dataclass(frozen=True)
class DiskConfig(_Group):
    """The disk tier (DeepSpeed ZeRO-Infinity's NVMe offload of optimizer state): the Adam
    moments of the chunks kept on the host, and (bf16/fp16) their fp32 masters, live in files
    under `path`, streamed through host memory a few chunks at a time during each step."""

    _prefix: ClassVar[str] = "disk"

    path: str = _option(
        "", check=_path,
        doc="Directory of the state files (made if missing; one engine at a time: a lock "
        "refuses a second). Under several ranks each uses its subdirectory rank<N>.",
    )  # fmt: skip
    keep: bool = _option(
        False, check=_boolean,
        doc="Leave the state files when the engine closes; False removes them (and the "
        "directory if the engine made it). Files the engine did not make are never touched.",
    )  # fmt: skip
    depth: int = _option(
        3, check=_integer(2, 64),
        doc="Pieces whose state is in host memory at once during a step: the one updated, "
        "the next being read and the last being written.",
    )  # fmt: skip
    piece: int = _option(
        1 << 21, check=_integer(4096),
        doc="Elements of a chunk a step updates from host memory at once (DeepSpeed's "
        "sub_group_size; rounded down to a multiple of 4096): the host holds `depth` pieces' "
        "master and moments, 12 bytes an element with fp32 moments, whatever the chunk size. "
        "With 8-bit moments a piece is a whole chunk.",
    )  # fmt: skip
    masters: bool = _option(
        True, check=_boolean,
        doc="bf16/fp16: the chunks' fp32 masters on the disk tier too (4 bytes per parameter "
        "off the host); the stable parameters are then mapped views of their files, read in "
        "when touched. False keeps them on the host (a step under gradient accumulation reads "
        "them in each forward after the first).",
    )  # fmt: skip


@_named_options
@dataclass(frozen=True)
class TensorParallelConfig(_Group):
    """Megatron-style tensor parallelism over the captured graph."""

    _prefix: ClassVar[str] = "tensor_parallel"

    size: int = _option(1, check=_integer(1), doc="Tensor-parallel group size (ranks).")
    sequence_parallel: bool = _option(
        False, check=_boolean, doc="Shard activations along the sequence between TP regions."
    )
    async_communication: bool = _option(
        False, check=_boolean, doc="Overlap the input all-gather with the matmul (nanotron-style)."
    )
    recompute_allgather: bool | None = _option(
        None, check=_optional_boolean,
        doc="Re-gather the input in backward instead of saving the gathered activation; None "
        "(default): when async_communication (overlapped: less memory at the same speed, "
        "benchmarks/tp.py; in sync mode the re-gather is not hidden).",
    )  # fmt: skip
    rules: dict[str, str] = _option(
        check=_tp_rules, factory=dict,
        doc="Module-name pattern (fnmatch) -> 'column' | 'row' | 'replicate'; first match wins; "
        "empty = the pass chooses.",
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The plan.

_CHUNKS = "the chunk manager"
_TRACER = "the memory tracer"
_ACTIVATIONS = "the activation passes"
_DIST = "distributed chunks"


@_named_options
@dataclass(frozen=True)
class Plan:
    """Every option of an fxstar run. Build it directly, or with from_dict/from_json.

    Frozen: change it with `plan.replace(**changes)`, which validates the copy. Sizes are bytes,
    strings like '4GiB', or a share of the model's parameter bytes like '30%' (kept as a
    `Share` until `resolve_size`). `notes` lists what from_patrickstar read but ignored.
    """

    device: str = _option(
        "auto", check=_device, feature=_CHUNKS,
        doc="The compute device: 'auto' (with device_memory the accelerator if there is one; "
        "otherwise the model's device), 'cpu', 'cuda' or 'cuda:N'. The model stays where it is "
        "(host or meta): with device_memory its parameters are paged to the device in chunks; "
        "inputs are moved.",
    )  # fmt: skip
    device_memory: Size | str | None = _option(
        None, check=_device_memory, feature=_CHUNKS,
        doc="Budget of the compute tier, like a GPU's capacity: parameter chunks plus "
        "activations and temporaries. None = no budget (everything fits); 'auto' = the "
        "smallest that works for this plan (on CUDA: the device's capacity times "
        "overall_gpu_mem_ratio).",
    )  # fmt: skip
    host_memory: Size | None = _option(
        None, check=_size, feature=_CHUNKS,
        doc="Budget of the host (CPU) tier for chunk homes, optimizer state and (CPU-only) "
        "the arena, checked at compile; None = overall_cpu_mem_ratio of the machine's memory.",
    )  # fmt: skip
    chunk_size: int | str = _option(
        "auto", check=_chunk_size, feature=_CHUNKS,
        doc="Elements per parameter chunk, or 'auto' to choose from the graph and budgets.",
    )  # fmt: skip
    precision: str = _option(
        "fp32", check=_choice("fp32", "bf16", "fp16"), feature="mixed precision",
        doc="Compute precision: 'fp32', 'bf16', or 'fp16' (with loss scaling); the master "
        "weights and optimizer state stay fp32.",
    )  # fmt: skip
    optimizer: OptimizerConfig = _option(
        check=_group(OptimizerConfig, optional=False), factory=OptimizerConfig,
        feature="the optimizer", doc="Optimizer settings (an OptimizerConfig or a dict).",
    )  # fmt: skip
    loss_scale: LossScaleConfig = _option(
        check=_group(LossScaleConfig, optional=False, scalar="loss_scale"),
        factory=LossScaleConfig, feature="fp16 loss scaling",
        doc="fp16 loss scaling (a LossScaleConfig or a dict); a bare number is a fixed scale.",
    )  # fmt: skip
    hybrid_adam: bool = _option(
        True, check=_boolean, feature="HybridAdam",
        doc="Keep the chunks whose optimizer fits the compute tier's margin (of device_memory) "
        "there for good, updated there; the rest by the C++ CPU Adam. False: all on the host.",
    )  # fmt: skip
    checkpoint: str | tuple[str, ...] | None = _option(
        None, check=_checkpoint, feature="the activation checkpoint pass",
        doc="Activation checkpoint regions: None, 'blocks' (each repeated block), 'auto' (as "
        "activation_memory requires), or a list of module-name patterns (fnmatch).",
    )  # fmt: skip
    checkpoint_every: int = _option(
        1, check=_integer(1), feature="the activation checkpoint pass",
        doc="Checkpoint every k-th region (every=k); 1 = all of them.",
    )  # fmt: skip
    activation_memory: Size | None = _option(
        None, check=_size, feature=_ACTIVATIONS,
        doc="Budget for saved activations on the compute tier; None = what device_memory leaves.",
    )  # fmt: skip
    offload_activations: bool = _option(
        False, check=_boolean, feature=_ACTIVATIONS,
        doc="Move saved activations at checkpoint boundaries to host memory until backward.",
    )  # fmt: skip
    cpu_embedding: bool = _option(
        False, check=_boolean, feature="the CPU embedding pass",
        doc="Keep embedding tables on the host and run their lookups there.",
    )  # fmt: skip
    tiled_linear: TiledLinearConfig | None = _option(
        None, check=_group(TiledLinearConfig, optional=True), feature="the tiled-linear pass",
        doc="Tile large linears (a TiledLinearConfig or a dict); None = off.",
    )  # fmt: skip
    static_partition: bool = _option(
        False, check=_boolean, feature=_TRACER,
        doc="Place chunks once from the budgets instead of moving them by the traced usage.",
    )  # fmt: skip
    warmup_gpu_chunk_mem_ratio: float = _option(
        0.1, check=_real(0, 1, lo_open=True), feature=_TRACER,
        doc="With static_partition: the chunks' share of device_memory for the whole run "
        "(PatrickStar's warm-up share, which its static partition keeps). Refused without "
        "static_partition: the step is traced at compile time, so there is no warm-up.",
    )  # fmt: skip
    overall_gpu_mem_ratio: float = _option(
        0.8, check=_real(0, 1, lo_open=True), feature=_TRACER,
        doc="device_memory='auto' on a CUDA device: this share of the device's capacity.",
    )  # fmt: skip
    overall_cpu_mem_ratio: float = _option(
        0.8, check=_real(0, 1, lo_open=True), feature=_TRACER,
        doc="Without host_memory, the host budget is this share of the machine's memory, "
        "divided among the node's processes (LOCAL_WORLD_SIZE).",
    )  # fmt: skip
    margin_use_ratio: float = _option(
        0.8, check=_real(0, 1, lo_open=True), feature=_TRACER,
        doc="Share of the compute tier a traced step left free that HybridAdam may keep "
        "chunks and their optimizer state in (hybrid_adam).",
    )  # fmt: skip
    async_mem_monitor: bool = _option(
        False, check=_boolean, feature=_TRACER,
        doc="Sample memory use from a background thread instead of only at graph nodes.",
    )  # fmt: skip
    mem_cache: int = _option(
        2, check=_integer(0), feature="the chunk manager's memory cache",
        doc="Freed chunk buffers kept for reuse (capacity); 0 = off.",
    )  # fmt: skip
    overlap_grad_copies: str = _option(
        "auto", check=_choice("auto", "on", "off"), feature="the chunk manager's gradient copies",
        doc="Copy gradients to their chunk buffers beside backward (a copy stream; on a "
        "CPU-only machine a worker thread); 'auto' = on with an accelerator.",
    )  # fmt: skip
    prefetch: str = _option(
        "auto", check=_choice("auto", "on", "off"), feature="the chunk manager's prefetch",
        doc="Start loading the next chunk the plan needs while this one computes, when it fits "
        "without evicting until then (a copy on the copy stream; with sharded data-parallel "
        "payloads the next group's all-gather, or with mem_saving_comm the chunk's broadcast, "
        "beside compute); 'auto' = on with an accelerator (on a CPU-only machine the "
        "background copies and collectives take the cores compute needs).",
    )  # fmt: skip
    grads_in_host: bool = _option(
        True, check=_boolean, feature="the chunk manager's gradient buffers",
        doc="Under bf16/fp16, a chunk's gradient takes the room of its host payload once "
        "backward produced it, and the optimizer step writes the updated parameters over it "
        "(PatrickStar's 14 bytes per parameter); False gives gradients buffers of their own "
        "(2 more bytes per parameter) so they outlive the step.",
    )  # fmt: skip
    mem_saving_comm: bool = _option(
        False, check=_boolean, feature=_DIST,
        doc="Communicate chunk by chunk to save memory (PatrickStar's memory-saving "
        "communication). Sharded data-parallel payloads: a load is one broadcast of the chunk "
        "from its owner instead of an all-gather of its whole group (the compute tier needs "
        "room for chunks, not groups), and gradients are reduced to their owner chunk by "
        "chunk (staging two chunks, not two groups); replicated payloads: N reduces and N "
        "broadcasts in place, no communication buffer; tensor-parallel activations: each "
        "rank's block broadcast into one block-sized buffer.",
    )  # fmt: skip
    release_after_init: bool = _option(
        False, check=_boolean, feature=_CHUNKS,
        doc="One process: once the chunk homes hold the values, free the storage of the "
        "model's original parameter tensors, even where the caller still holds them (the "
        "host never holds the model twice). False (the default): the model's "
        "parameters become the engine's all the same, and the originals are left intact and "
        "untouched by training. A meta-built model goes straight into its chunk homes either "
        "way. Under data parallelism (PatrickStar's meaning): every rank initialises every "
        "chunk as a serial run would and keeps its own, so the sharded model starts as the "
        "serial one bit for bit (fxstar/release.py).",
    )  # fmt: skip
    fake_dist: bool = _option(
        False, check=_boolean, feature=_DIST,
        doc="N data-parallel ranks share one device (PatrickStar's use_fake_dist): each gets "
        "1/N of device_memory, to try a layout for N devices on one (on CPU: N processes on "
        "one machine).",
    )  # fmt: skip
    disk: DiskConfig | None = _option(
        None, check=_disk, feature="the disk tier",
        doc="The disk tier for the optimizer state (a DiskConfig, a dict, or a directory path); "
        "None = everything in memory. Needs HybridAdam (Adam/AdamW over chunks).",
    )  # fmt: skip
    tensor_parallel: TensorParallelConfig | None = _option(
        None, check=_group(TensorParallelConfig, optional=True),
        feature="the tensor-parallel pass",
        doc="Tensor parallelism (a TensorParallelConfig or a dict); None = off.",
    )  # fmt: skip
    data_parallel: bool = _option(
        True, check=_boolean, feature="the distributed runtime",
        doc="Under torch.distributed, train the ranks tensor parallelism leaves as data-parallel "
        "replicas of one model (chunk groups, each chunk's optimizer state on one rank); False: "
        "each process trains a model of its own.",
    )  # fmt: skip
    data_parallel_shard: str = _option(
        "auto", check=_choice("auto", "params", "optimizer"), feature="the distributed runtime",
        doc="What data-parallel ranks divide among them: 'params' (PatrickStar's chunk groups, "
        "ZeRO-3: a rank keeps the host homes of its own chunks only and fetches the others "
        "from their owners when the plan needs them, gradients reduced to the owners during "
        "backward), 'optimizer' (every rank holds every payload, each steps its own chunks: "
        "ZeRO-Offload); 'auto' = 'params' with Adam/AdamW (HybridAdam), else 'optimizer'.",
    )  # fmt: skip
    dist_timeout: float = _option(
        300.0, check=_real(0, MAX_DIST_TIMEOUT, lo_open=True), feature="the distributed runtime",
        doc="Seconds a rank waits in one of the engine's collectives before it raises an error "
        "naming the collective: a rank that failed, stopped or diverged ends the run instead of "
        "hanging it.",
    )  # fmt: skip
    passes: tuple[str, ...] = _option(
        (), check=_names, feature="the pass manager",
        doc="Pass names to run, in order; empty = the built-ins the other options ask for.",
    )  # fmt: skip
    verify: bool = _option(
        False, check=_boolean, feature="verification",
        doc="After compiling, compare loss and gradients with eager on the example inputs.",
    )  # fmt: skip
    loss_fn: Callable[..., Any] | None = _option(
        None, check=_loss_fn, feature="capture",
        doc="Turns the model's outputs (and targets) into the loss; None = the model returns "
        "it. Not written to JSON.",
    )  # fmt: skip
    seed: int | None = _option(
        None, check=_integer(0, MAX_SEED, optional=True), feature="the engine",
        doc="Seed for torch's RNGs before capture and training; None = leave them alone.",
    )  # fmt: skip
    notes: list[str] = field(default_factory=list, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        _validate(self, "")
        _check_warmup_share(self)
        _check_state_dtype(self)
        _check_disk(self)

    # -- building and copying -----------------------------------------------------------------

    def replace(self, **changes: Any) -> Plan:
        """A validated copy with `changes` applied."""
        _check_keys(changes, option_names())
        copy = dataclasses.replace(self, **changes)
        copy.notes.extend(self.notes)
        return copy

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """Build from a dict of options (or a PatrickStar config, detected by its keys)."""
        if not isinstance(data, Mapping):
            raise _type_error("plan", "a dict of options", data)
        from fxstar import patrickstar

        if patrickstar.is_patrickstar(data):
            return cls.from_patrickstar(data)
        return cls(**data)

    @classmethod
    def from_json(cls, text_or_path: str | os.PathLike) -> Plan:
        """Build from JSON text (a str starting with '{' or '['), or from the JSON file at a
        path (a missing file is the FileNotFoundError that open raises; text that is not JSON,
        or JSON that is not an object of options, is a PlanError naming its source)."""
        text = str(text_or_path) if not isinstance(text_or_path, os.PathLike) else None
        source = "plan JSON"
        if text is None or not text.lstrip().startswith(("{", "[")):
            source = os.fspath(text_or_path)
            with open(text_or_path, "rb") as file:
                raw = file.read()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise PlanError(f"{source}: not UTF-8 text ({error})") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise PlanError(f"{source}: not valid JSON ({error})") from None
        except RecursionError:  # json's own decoder recurses once per nesting level
            raise PlanError(f"{source}: nested too deeply to be a plan") from None
        if not isinstance(data, Mapping):
            raise _type_error(source, "a JSON object of plan options", data)
        return cls.from_dict(data)

    @classmethod
    def from_patrickstar(cls, config: Mapping[str, Any]) -> Plan:
        """Build from a PatrickStar config dict; fxstar.patrickstar documents the mapping."""
        from fxstar import patrickstar

        options, notes = patrickstar.plan_options(config)
        plan = cls.from_dict(options)
        plan.notes.extend(notes)
        return plan

    # -- writing --------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every option (groups as dicts, lists, shares as '30%')."""
        return {f.name: _plain(getattr(self, f.name)) for f in _options(self)}

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """JSON text of the plan, also written to `path` if given.

        loss_fn is left out; a plan whose loss_fn is set cannot be written (ValueError), since
        the callable would be lost silently.
        """
        if self.loss_fn is not None:
            raise ValueError(
                "loss_fn: a callable cannot be written to JSON; save plan.replace(loss_fn=None) "
                "and pass the loss function again after loading"
            )
        data = self.to_dict()
        del data["loss_fn"]
        text = json.dumps(data, indent=2)
        if path is not None:
            with open(path, "w", encoding="utf-8") as file:
                file.write(text + "\n")
        return text

    # -- using ----------------------------------------------------------------------------------

    def resolve_size(self, name: str, param_bytes: int) -> int | None:
        """Bytes for the size option `name`; a share is taken of `param_bytes`."""
        if name not in _SIZE_OPTIONS:
            sizes = ", ".join(_SIZE_OPTIONS)
            raise PlanError(f"{name}: not a size option; size options are {sizes}")
        value = getattr(self, name)
        if value == "auto":
            raise PlanError(
                f"{name}: 'auto' depends on the compiled graph; chunk_layout resolves it "
                "(fxstar.passes.chunk_layout.budget_bytes(program))"
            )
        return value.resolve(param_bytes) if isinstance(value, Share) else value

    def used_options(self) -> list[str]:
        """Dotted names of the options set to something other than their default."""
        used = []
        for f in _options(self):
            value, default = getattr(self, f.name), _default(f)
            if isinstance(default, _Group) and isinstance(value, _Group):
                for g in _options(value):
                    if getattr(value, g.name) != getattr(default, g.name):
                        used.append(f"{f.name}.{g.name}")
            elif value != default:
                used.append(f.name)
        return used

    def check_implemented(self, implemented: set[str] | None = None) -> None:
        """Raise NotImplementedError naming every used option whose feature does not exist yet.

        An option counts as implemented if its name, or the name of its group, is in
        `implemented` (default: what the engine and the registered passes declare,
        `fxstar.engine.implemented_options()`). Defaults never count as used.
        """
        if implemented is None:
            from fxstar.engine import implemented_options  # the engine imports this module

            implemented = implemented_options()
        missing = [
            name for name in self.used_options()
            if name not in implemented and name.split(".")[0] not in implemented
        ]  # fmt: skip
        if missing:
            features = {f.name: f.metadata["feature"] for f in _options(self)}
            raise OptionNotImplementedError("\n".join(
                f"Plan option {name!r} is not implemented yet (it is part of "
                f"{features[name.split('.')[0]]}); remove it or set it to its default"
                for name in missing
            ))  # fmt: skip

    def describe(self) -> str:
        """A table of every option: name, default, current value ('*' if changed), doc."""
        rows = []  # (changed, name, default, value, doc)
        for f in _options(self):
            value, default = getattr(self, f.name), _default(f)
            show = _show_size if f.name in _SIZE_OPTIONS else _show
            rows.append((value != default, f.name, show(default), show(value), f.metadata["doc"]))
            group_cls = _group_class(f)
            if group_cls is None:
                continue
            for g in _options(group_cls):
                sub_default = _default(g)
                sub_value = getattr(value, g.name) if value is not None else None
                changed = value is not None and sub_value != sub_default
                shown = _show(sub_value) if value is not None else "-"
                rows.append((changed, f"{f.name}.{g.name}", _show(sub_default), shown,
                             g.metadata["doc"]))  # fmt: skip
        header = (False, "option", "default", "value", "")
        w1, w2 = (max(len(r[i]) for r in [header, *rows]) for i in (1, 2))
        out = []
        for changed, name, default, value, doc in [header, *rows]:
            mark = "*" if changed else " "
            out.append(f"{mark} {name:<{w1}}  {default:<{w2}}  {value}".rstrip())
            out.extend(textwrap.wrap(doc, 96, initial_indent="      ", subsequent_indent="      "))
        return "\n".join(out)


def _group_class(f: dataclasses.Field) -> type[_Group] | None:
    """The option group class a Plan field holds, if any (groups are named after their field)."""
    for cls in (OptimizerConfig, LossScaleConfig, TiledLinearConfig, TensorParallelConfig):
        if cls._prefix == f.name:
            return cls
    return None


def _show_size(value: Size | None) -> str:
    return format_size(value) if isinstance(value, int) and value % 1024 == 0 else _show(value)


def _show(value: Any) -> str:
    if isinstance(value, _Group):
        return type(value).__name__ + "(...)"
    if isinstance(value, Share):
        return str(value)
    if callable(value):
        return getattr(value, "__qualname__", repr(value))
    return repr(list(value)) if isinstance(value, tuple) else repr(value)


def option_names() -> list[str]:
    """Names of the top-level Plan options."""
    return [f.name for f in _options(Plan)]


def _all_option_names() -> list[str]:
    names = []
    for f in _options(Plan):
        names.append(f.name)
        if (cls := _group_class(f)) is not None:
            names.extend(f"{f.name}.{g.name}" for g in _options(cls))
    return names


_SIZE_OPTIONS = ("device_memory", "host_memory", "activation_memory")


def check_option_names(names: Iterable[str], owner: str) -> None:
    """Refuse a misspelt option name where a pass or the engine declares what it implements."""
    known = _all_option_names()
    for name in names:
        if name not in known:
            raise PlanError(f"{owner} declares an {_unknown(name, known)}")
