"""PatrickStar configs as fxstar plans: which keys mean what, and what is read but ignored.

`Plan.from_dict` hands a config here when it looks like PatrickStar's (`is_patrickstar`);
`Plan.from_patrickstar` always does. Only what the config states is mapped; missing keys take
fxstar's defaults, which differ from PatrickStar's in places (e.g. lr and with_mem_cache),
except device_memory: PatrickStar always budgets the card, so a config without it gets 'auto'.

    optimizer.type/params -> optimizer (params.use_hybrid_adam -> hybrid_adam)
    fp16.enabled -> precision 'fp16' or 'fp32'; the other fp16 keys -> loss_scale
    default_chunk_size -> chunk_size; use_cpu_embedding -> cpu_embedding
    gradient_clipping (<= 0 means off) -> optimizer.clip_grad_norm
    client.mem_tracer.* -> the tracer options (use_/with_ prefixes dropped)
    client.mem_tracer.warmup_gpu_chunk_mem_ratio other than 0.1 needs with_static_partition
    no device_memory -> 'auto': the card's memory x overall_gpu_mem_ratio, as PatrickStar's
    client.opts.with_mem_saving_comm -> mem_saving_comm; with_mem_cache -> mem_cache 2 or 0
    client.opts.with_async_move: read and ignored (a note says so)

Native option names may be mixed in and pass through unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

from fxstar.plan import (
    LossScaleConfig,
    OptimizerConfig,
    _boolean,
    _check_keys,
    _real,
    _type_error,
    _unknown,
    option_names,
)

__all__ = ["is_patrickstar", "plan_options"]

# keys only a PatrickStar config has: any of them at the top level marks one
_MARKERS = ("client", "fp16", "default_chunk_size", "use_cpu_embedding", "gradient_clipping")
_TOP = ("optimizer", "release_after_init", *_MARKERS)
_PARAMS = {"lr": "lr", "betas": "betas", "eps": "eps", "weight_decay": "weight_decay"}
_FP16 = ("enabled", *(f.name for f in fields(LossScaleConfig)))
_RENAMES = {"default_chunk_size": "chunk_size", "use_cpu_embedding": "cpu_embedding",
            "release_after_init": "release_after_init"}  # fmt: skip
_TRACER = {
    "use_async_mem_monitor": "async_mem_monitor",
    "warmup_gpu_chunk_mem_ratio": "warmup_gpu_chunk_mem_ratio",
    "overall_gpu_mem_ratio": "overall_gpu_mem_ratio",
    "overall_cpu_mem_ratio": "overall_cpu_mem_ratio",
    "margin_use_ratio": "margin_use_ratio",
    "use_fake_dist": "fake_dist",
    "with_static_partition": "static_partition",
}
_OPTS = ("with_mem_saving_comm", "with_mem_cache", "with_async_move")


def is_patrickstar(data: Mapping[str, Any]) -> bool:
    """Whether `data` is a PatrickStar config: a key only PatrickStar has, or an optimizer
    given as {type, params}."""
    optimizer = data.get("optimizer")
    return any(k in data for k in _MARKERS) or (
        isinstance(optimizer, Mapping) and "params" in optimizer
    )


def plan_options(config: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(native Plan options, notes on what was read but ignored) for a PatrickStar config;
    the mapping is in this module's docstring. Unknown keys are a PlanError with a suggestion.
    """
    native = option_names()
    for key in config:
        if key not in _TOP and key not in native:
            raise _unknown(key, list(_TOP) + [n for n in native if n not in _TOP])
    options = {k: v for k, v in config.items() if k not in _TOP}
    _optimizer(config, options)
    _fp16(config, options)
    options.update({new: config[old] for old, new in _RENAMES.items() if old in config})
    _gradient_clipping(config, options)
    notes = _client(config, options)
    options.setdefault("device_memory", "auto")  # PatrickStar always budgets the card
    return options, notes


def _section(data: Mapping, key: str, known: Sequence[str], prefix: str) -> Mapping:
    """data[key] as a dict with only `known` keys (empty when absent)."""
    section = data.get(key, {})
    if not isinstance(section, Mapping):
        raise _type_error(prefix + key, "a dict", section)
    _check_keys(section, known, f"{prefix}{key}.")
    return section


def _optimizer(config: Mapping, options: dict) -> None:
    """optimizer: {type, params: {lr, betas, eps, weight_decay, use_hybrid_adam}}."""
    if "optimizer" not in config:
        return
    optimizer = config["optimizer"]
    if isinstance(optimizer, Mapping) and "params" in optimizer:
        _check_keys(optimizer, ("type", "params"), "optimizer.")
        params = _section(optimizer, "params", [*_PARAMS, "use_hybrid_adam"], "optimizer.")
        translated = {_PARAMS[k]: v for k, v in params.items() if k in _PARAMS}
        if "type" in optimizer:
            translated["type"] = optimizer["type"]
        if "use_hybrid_adam" in params:
            options["hybrid_adam"] = params["use_hybrid_adam"]
        optimizer = translated
    options["optimizer"] = dict(optimizer) if isinstance(optimizer, Mapping) else optimizer


def _fp16(config: Mapping, options: dict) -> None:
    """fp16: {enabled, loss_scale, initial_scale_power, ...} -> precision and loss_scale."""
    fp16 = _section(config, "fp16", _FP16, "")
    if "enabled" in fp16:
        enabled = _boolean(fp16["enabled"], "fp16.enabled")
        options["precision"] = "fp16" if enabled else "fp32"
    scaling = {k: v for k, v in fp16.items() if k != "enabled"}
    if scaling:
        options["loss_scale"] = scaling


def _gradient_clipping(config: Mapping, options: dict) -> None:
    """gradient_clipping > 0 -> optimizer.clip_grad_norm; <= 0 (PatrickStar's off) is left out."""
    if "gradient_clipping" not in config:
        return
    clip = _real(optional=True)(config["gradient_clipping"], "gradient_clipping")
    if clip is None or clip <= 0:
        return
    optimizer = options.get("optimizer", {})
    if isinstance(optimizer, OptimizerConfig):
        optimizer = optimizer.to_dict()
    if isinstance(optimizer, Mapping):  # anything else fails validation later
        options["optimizer"] = {**optimizer, "clip_grad_norm": clip}


def _client(config: Mapping, options: dict) -> list[str]:
    """client.mem_tracer and client.opts; returns the notes on what was ignored."""
    client = _section(config, "client", ("mem_tracer", "opts"), "")
    tracer = _section(client, "mem_tracer", list(_TRACER), "client.")
    options.update({_TRACER[k]: v for k, v in tracer.items()})
    opts = _section(client, "opts", _OPTS, "client.")
    if "with_mem_saving_comm" in opts:
        options["mem_saving_comm"] = opts["with_mem_saving_comm"]
    if "with_mem_cache" in opts:
        cache = _boolean(opts["with_mem_cache"], "client.opts.with_mem_cache")
        options["mem_cache"] = 2 if cache else 0
    notes = []
    if "with_async_move" in opts:
        _boolean(opts["with_async_move"], "client.opts.with_async_move")
        notes.append(
            f"client.opts.with_async_move={opts['with_async_move']} ignored: fxstar schedules "
            "chunk moves at compile time (prefetch is the runtime's choice, not an option)"
        )
    return notes
