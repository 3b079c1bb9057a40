"""Which Trainer arguments the fxstar engine takes, and what they become in the plan.

The Trainer's arguments keep their meaning: the learning rate, Adam's betas and epsilon,
weight decay (on the parameters `Trainer.get_decay_parameter_names` picks), gradient clipping
and accumulation become the plan's optimizer options, so a run set up for `Trainer` trains
the same optimizer under `FxstarTrainer`. What the engine does itself (precision, activation
checkpointing, compilation, the optimizer) or does not do inside a Trainer (several
processes, DeepSpeed or FSDP around it) is refused by name before anything is built: an
argument silently ignored would train something other than what was asked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from fxstar.errors import PlanError, UsageError
from fxstar.plan import OptimizerConfig, Plan

__all__ = [
    "OPTIMIZER_FROM_ARGUMENTS",
    "SUPPORTED_OPTIM",
    "check_trainer_arguments",
    "check_training_arguments",
    "exact_name_pattern",
    "plan_for_trainer",
]

# TrainingArguments.optim values the engine's AdamW (HybridAdam over chunks) stands for
SUPPORTED_OPTIM = ("adamw_torch", "adamw_torch_fused")

# each plan optimizer option the Trainer sets, and where the Trainer takes it from
OPTIMIZER_FROM_ARGUMENTS = {
    "type": "optim",
    "lr": "learning_rate",
    "betas": "adam_beta1 and adam_beta2",
    "eps": "adam_epsilon",
    "weight_decay": "weight_decay",
    "no_decay": "Trainer.get_decay_parameter_names",
    "clip_grad_norm": "max_grad_norm",
    "accumulation_steps": "gradient_accumulation_steps",
}

_PRECISION = "fxstar's precision is the plan's: Plan(precision='bf16' or 'fp16')"
_CHECKPOINTING = "fxstar checkpoints activations by plan: Plan(checkpoint='blocks')"
# TrainingArguments the engine refuses when set, with what to do instead
REFUSED_ARGUMENTS = {
    "deepspeed": "fxstar is the memory engine here (plan.device_memory pages the parameters "
    "and HybridAdam keeps the optimizer state on the host); remove deepspeed",
    "fsdp": "fxstar is the memory engine here (plan.device_memory); remove fsdp",
    "fp16": _PRECISION,
    "bf16": _PRECISION,
    "fp16_full_eval": _PRECISION,
    "bf16_full_eval": _PRECISION,
    "gradient_checkpointing": _CHECKPOINTING,
    "activation_checkpointing": _CHECKPOINTING,
    "torch_compile": "fxstar compiles the training step itself",
    "use_liger_kernel": "it replaces the model's modules after fxstar compiled them",
    "neftune_noise_alpha": "its embedding hook is not part of the compiled graph's plan",
    "label_smoothing_factor": "the Trainer's label smoother finds a causal LM by the model's "
    "class name, which the engine hides; pass compute_loss_func instead",
    "load_best_model_at_end": "checkpoints hold the engine's state, not model.safetensors; "
    "load the best checkpoint's fxstar/ directory with trainer.engine.load",
}


def check_training_arguments(args: Any) -> None:
    """Refuse, all at once and each by name, the TrainingArguments the engine cannot honour."""
    problems = [
        f"{name}={getattr(args, name)!r}: {remedy}"
        for name, remedy in REFUSED_ARGUMENTS.items()
        if getattr(args, name, None)
    ]
    optim = getattr(args.optim, "value", args.optim)
    if optim not in SUPPORTED_OPTIM:
        problems.append(
            f"optim={optim!r}: the engine's optimizer is AdamW (HybridAdam over the chunks); "
            f"use one of {', '.join(map(repr, SUPPORTED_OPTIM))}"
        )
    if args.world_size > 1:
        problems.append(
            f"world_size={args.world_size}: FxstarTrainer runs one process; fxstar's own data "
            "and tensor parallelism run under torchrun without the Trainer (docs/parallel.md)"
        )
    if args.n_gpu > 1:
        problems.append(
            f"n_gpu={args.n_gpu}: the engine trains on one device per process; choose one "
            "with CUDA_VISIBLE_DEVICES"
        )
    _refuse("TrainingArguments", problems)


def check_trainer_arguments(arguments: Mapping[str, Any]) -> None:
    """Refuse Trainer arguments that replace what the plan decides (the optimizer) or that
    rebuild the model after it was compiled (model_init)."""
    problems = []
    if any(part is not None for part in arguments.get("optimizers", (None, None))):
        problems.append(
            "optimizers: the optimizer and its state are the engine's (the plan's AdamW over "
            "the chunks); set learning_rate, weight_decay, adam_* and lr_scheduler_type in "
            "TrainingArguments instead"
        )
    if arguments.get("optimizer_cls_and_kwargs") is not None:
        problems.append("optimizer_cls_and_kwargs: the optimizer is the engine's (see optimizers)")
    if arguments.get("model_init") is not None:
        problems.append("model_init: pass the model itself; the engine compiles it once")
    _refuse("Trainer", problems)


def _refuse(what: str, problems: list[str]) -> None:
    if problems:
        raise UsageError(
            f"FxstarTrainer cannot honour these {what} arguments:\n  " + "\n  ".join(problems)
        )


def plan_for_trainer(plan: Plan, args: Any, no_decay: Iterable[str]) -> Plan:
    """`plan` with the optimizer the TrainingArguments describe. `no_decay`: the parameter
    names the Trainer exempts from weight decay. A plan that sets one of those options
    itself is refused: two places deciding one value would leave one of them ignored."""
    default = OptimizerConfig()
    for option, argument in OPTIMIZER_FROM_ARGUMENTS.items():
        if getattr(plan.optimizer, option) != getattr(default, option):
            raise PlanError(
                f"optimizer.{option}: FxstarTrainer takes it from the Trainer ({argument}); "
                "leave it out of the plan"
            )
    options = {
        "type": "adamw",
        "lr": args.learning_rate,
        "betas": (args.adam_beta1, args.adam_beta2),
        "eps": args.adam_epsilon,
        "weight_decay": args.weight_decay,
        "no_decay": tuple(exact_name_pattern(name) for name in no_decay),
        "clip_grad_norm": args.max_grad_norm if (args.max_grad_norm or 0) > 0 else None,
        "accumulation_steps": args.gradient_accumulation_steps,
    }
    return plan.replace(optimizer=dataclasses.replace(plan.optimizer, **options))


def exact_name_pattern(name: str) -> str:
    """A no_decay pattern matching `name` alone: the first character in brackets makes it a
    glob (OptimizerConfig.decays matches a plain pattern as a substring, so 'head.weight'
    would also exempt 'lm_head.weight'), and glob characters in the name match themselves."""
    return "".join(f"[{c}]" if i == 0 or c in "*?[" else c for i, c in enumerate(name))
