"""Hugging Face's Trainer with an fxstar plan.

    trainer = FxstarTrainer(model=model, args=TrainingArguments(...), train_dataset=data,
                            plan=fxstar.Plan(device_memory="40%"))
    trainer.train()

The Trainer keeps its loop, arguments, callbacks, logs and checkpoint directories; at its own
override points the engine takes over what it must own:

- the model is compiled under the plan (`trainer.engine`); training and evaluation call the
  engine (`_wrap_model`), accelerate never wraps or moves it, and the engine places the
  parameters (`_move_model_to_device` leaves them). Capture runs when training starts, on
  the first batch of the train dataloader, with every random generator left as it was, so
  the data order and dropout are the ones the Trainer would draw without fxstar;
- the optimizer is the plan's AdamW with the TrainingArguments' settings
  (integrations/trainer_args.py); `trainer.optimizer` stands for the engine's update, one
  per Trainer step, the micro-batches' gradients summed in the engine between
  (integrations/engine_optimizer.py). Clipping (`max_grad_norm`) happens inside that
  update, and the logged `grad_norm` is the norm it measured;
- the learning-rate scheduler is the Trainer's own, made over `engine.optimizer` and attached
  to the engine, so its checkpoints hold it;
- log lines add `tokens_per_second` (wall time between two logs) and memory per tier
  (integrations/train_metrics.py);
- a checkpoint `checkpoint-N/` holds `fxstar/`, the engine's checkpoint (parameters, optimizer
  state, scheduler, micro-step count), beside the Trainer's trainer_state.json, rng_state.pth,
  training_args.bin, config and tokenizer; no model.safetensors, optimizer.pt or scheduler.pt
  repeat what `fxstar/` holds. `resume_from_checkpoint` loads it into the engine with the
  process's random state left to the Trainer, which restores rng_state.pth where its loop
  resumes, as it does without fxstar;
- `save_model()` writes a transformers model directory from `engine.state_dict()`.

Arguments the engine cannot honour are refused by name before anything is built.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from transformers import Trainer
from transformers.trainer_pt_utils import remove_dummy_checkpoint
from transformers.utils import SAFE_WEIGHTS_NAME, WEIGHTS_NAME

import fxstar
from fxstar.engine import Engine
from fxstar.errors import CheckpointError, UsageError
from fxstar.integrations.engine_optimizer import EngineOptimizer
from fxstar.integrations.train_metrics import Throughput, tier_memory
from fxstar.integrations.trainer_args import (
    check_trainer_arguments,
    check_training_arguments,
    plan_for_trainer,
)
from fxstar.plan import Plan
from fxstar.saving.rng import rng_state, set_rng_state

__all__ = ["ENGINE_CHECKPOINT", "FxstarTrainer"]

ENGINE_CHECKPOINT = "fxstar"  # the engine's checkpoint inside a Trainer's checkpoint-N


class FxstarTrainer(Trainer):
    """`transformers.Trainer` whose model runs compiled under `plan` (see the module doc)."""

    def __init__(self, model: nn.Module | None = None, args: Any = None, *trainer_args: Any,
                 plan: Plan, **trainer_kwargs: Any):  # fmt: skip
        bound = inspect.signature(Trainer.__init__).bind(
            self, model, args, *trainer_args, **trainer_kwargs
        )
        check_trainer_arguments(bound.arguments)
        if isinstance(model, Engine):
            raise UsageError("model: pass the model itself with plan=; FxstarTrainer compiles it")
        if args is not None:  # before the Trainer builds anything (deepspeed, fsdp) from them
            check_training_arguments(args)
        self._writing_checkpoint = False
        self._throughput = Throughput()
        super().__init__(model, args, *trainer_args, **trainer_kwargs)
        if args is None:
            check_training_arguments(self.args)
        self.engine: Engine = fxstar.compile(
            self.model, plan_for_trainer(plan, self.args, self._no_decay_names())
        )

    def _no_decay_names(self) -> list[str]:
        """The parameters the Trainer exempts from weight decay (get_decay_parameter_names,
        which a subclass may change)."""
        decay = set(self.get_decay_parameter_names(self.model))
        return [name for name, _ in self.model.named_parameters() if name not in decay]

    # -- the model: the engine runs it and places it ------------------------------------------

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """The engine places the parameters (plan.device; chunks under device_memory)."""

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None):
        return self.engine

    # -- training -----------------------------------------------------------------------------

    def _prepare_for_training(
        self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: str | None
    ) -> tuple[Engine, Any]:
        """Trainer's preparation without accelerate's wrapping of model and optimizer.

        Why this order: the engine compiles first, since its optimizer is made over the
        parameters the compile leaves (chunks); the scheduler is made over that optimizer;
        a checkpoint is loaded into all three once they exist."""
        if self._created_lr_scheduler:  # a second train() makes its schedule afresh
            self.lr_scheduler = None
            self._created_lr_scheduler = False
        self._compile_on_first_batch(train_dataloader)
        self.create_optimizer()
        self.create_scheduler(num_training_steps=max_steps)
        self.model_wrapped = self.engine
        if resume_from_checkpoint is not None:
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        self._throughput = Throughput()
        return self.engine, train_dataloader

    def _compile_on_first_batch(self, train_dataloader: Any) -> None:
        """Capture the training step on the first batch, as compute_loss will call it, with
        every random generator left as it was (the batch drawn, and capture, draw nothing
        the run would)."""
        saved = rng_state()
        try:
            batch = next(iter(train_dataloader), None)
            if batch is None:
                raise UsageError("train_dataset: its dataloader gives no batch to train on")
            num_items = self._get_num_items_in_batch([batch], self.args.device)
            self.engine.train()
            self.engine.prepare(**self._forward_kwargs(self._prepare_inputs(batch), num_items))
        finally:
            set_rng_state(saved)

    def _forward_kwargs(self, inputs: Mapping[str, Any], num_items_in_batch: Any) -> dict:
        """What Trainer.compute_loss calls the model with: labels taken out for a
        compute_loss_func, num_items_in_batch added for a model that accepts loss kwargs."""
        kwargs = {k: v for k, v in inputs.items()
                  if not (k == "labels" and self.compute_loss_func is not None)}  # fmt: skip
        if self.model_accepts_loss_kwargs and num_items_in_batch is not None:
            kwargs["num_items_in_batch"] = num_items_in_batch
        return kwargs

    def create_optimizer(self, model: nn.Module | None = None) -> EngineOptimizer:
        if self.optimizer is None:
            self.optimizer = EngineOptimizer(self.engine)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        """The Trainer's schedule over the engine's optimizer, saved with its checkpoints."""
        scheduler = super().create_scheduler(num_training_steps, optimizer=self.engine.optimizer)
        self.engine.attach_scheduler(scheduler)
        return scheduler

    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: Any = None) -> torch.Tensor:  # fmt: skip
        tokens = inputs.get(getattr(self.model, "main_input_name", "input_ids"))
        if isinstance(tokens, torch.Tensor):
            self._throughput.add(tokens.numel())
        loss = super().training_step(model, inputs, num_items_in_batch)
        return loss.to(self.args.device)  # where the Trainer sums losses (plan.device may differ)

    def _clip_grad_norm(self, model: nn.Module) -> None:
        """Clipping is part of the engine's update (plan.optimizer.clip_grad_norm)."""
        return None

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> None:
        """Known once the update ran: EngineOptimizer.grad_norm (_maybe_log_save_evaluate)."""
        return None

    def _maybe_log_save_evaluate(self, tr_loss: torch.Tensor, grad_norm: Any, *args: Any,
                                 **kwargs: Any) -> None:  # fmt: skip
        return super()._maybe_log_save_evaluate(tr_loss, self.optimizer.grad_norm, *args,
                                                **kwargs)  # fmt: skip

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # a training step's line
            logs = {**logs, "tokens_per_second": round(self._throughput.per_second(), 1),
                    **tier_memory(self.engine)}  # fmt: skip
        super().log(logs, start_time)

    # -- checkpoints --------------------------------------------------------------------------

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        self._writing_checkpoint = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._writing_checkpoint = False

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """A model directory from the engine's parameters; inside a checkpoint, whose
        fxstar/ holds the parameters, the rest of one (config, tokenizer, arguments), as the
        Trainer writes a DeepSpeed ZeRO-3 checkpoint."""
        if self._writing_checkpoint and not self.args.save_only_model:
            super()._save(output_dir, state_dict={})
            remove_dummy_checkpoint(self.args.should_save, output_dir or self.args.output_dir,
                                    [WEIGHTS_NAME, SAFE_WEIGHTS_NAME])  # fmt: skip
            return
        super()._save(output_dir, self.engine.state_dict() if state_dict is None else state_dict)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The engine's checkpoint: parameters, optimizer state, scheduler, micro-steps."""
        self.engine.save(os.path.join(output_dir, ENGINE_CHECKPOINT))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Checked here, before training starts; loaded once the engine compiled
        (_load_optimizer_and_scheduler)."""
        if not os.path.isdir(os.path.join(resume_from_checkpoint, ENGINE_CHECKPOINT)):
            raise CheckpointError(
                f"{resume_from_checkpoint} has no {ENGINE_CHECKPOINT}/ engine checkpoint: "
                "FxstarTrainer resumes from its own checkpoints (not from one written with "
                "save_only_model=True or by another Trainer)"
            )

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The engine's checkpoint, without the process's random state: the Trainer restores
        that from rng_state.pth where its loop resumes (_load_rng_state)."""
        if checkpoint is None:
            return
        self.engine.load(os.path.join(checkpoint, ENGINE_CHECKPOINT), rng=False)
        accumulation = self.engine.plan.optimizer.accumulation_steps
        if self.engine.step_count != self.state.global_step * accumulation:
            raise CheckpointError(
                f"{checkpoint}: the engine's checkpoint is at micro-step "
                f"{self.engine.step_count}, the Trainer's state at step "
                f"{self.state.global_step} x {accumulation} accumulation steps; they come "
                "from different runs (or gradient_accumulation_steps changed)"
            )
