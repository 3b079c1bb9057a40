"""FxstarTrainer: transformers' Trainer whose model runs compiled under an fxstar plan.

A Llama and a GPT-2 (small configs, defaults otherwise: GPT-2 keeps its dropout) train on a
small local text. Every plan pages the parameters (device_memory='auto', the smallest budget
that runs): chunks move between the tiers each step.

What is exact and why:
- against transformers' own Trainer on the same model, data and arguments (weight decay,
  clipping, accumulation with a shorter last window, the linear schedule, dropout), the
  losses agree to 1e-6 relative and the parameters to 1e-5 absolute after six updates: the
  update is HybridAdam's C++ AdamW against torch.optim.AdamW, which round differently, and
  Adam divides each gradient by its own running size, so a gradient that is zero but for
  rounding (GPT-2's attention key biases) moves its parameter by rounding's share of lr;
- a run interrupted at a save_steps checkpoint and resumed from it reproduces the
  uninterrupted run bit for bit (losses, learning rates, gradient norms, final parameters),
  dropout included: the resumed engine loads the same fp32 values and optimizer state, the
  Trainer restores the random state and skips the batches already seen, and the same
  arithmetic runs on the same inputs.
"""

from __future__ import annotations

import copy
import json
import math
import os

import pytest
import torch
import transformers
from torch.utils.data import Subset
from trainer_setup import blocks, make_model

import fxstar
from fxstar.errors import CheckpointError
from fxstar.integrations.transformers import ENGINE_CHECKPOINT, FxstarTrainer
from fxstar.runtime.optim import HybridAdam

PAGED = fxstar.Plan(device_memory="auto")
MEMORY = ("compute_chunks_peak_mib", "compute_kept_mib", "activations_peak_mib", "host_mib")


def arguments(directory, **changes) -> transformers.TrainingArguments:
    options = {"output_dir": str(directory), "per_device_train_batch_size": 4,
               "learning_rate": 3e-3, "logging_steps": 1, "report_to": "none",
               "disable_tqdm": True, "save_strategy": "no", **changes}  # fmt: skip
    return transformers.TrainingArguments(**options)


def step_logs(trainer) -> list[dict]:
    return [entry for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_loss_falls_and_the_scheduler_drives_the_engine(family, tmp_path):
    trainer = FxstarTrainer(model=make_model(family), plan=PAGED, train_dataset=blocks(),
                            args=arguments(tmp_path, max_steps=10, warmup_steps=2))  # fmt: skip
    trainer.train()
    logs = step_logs(trainer)
    assert len(logs) == 10
    assert logs[-1]["loss"] < logs[0]["loss"] - 0.1, [entry["loss"] for entry in logs]
    engine = trainer.engine
    assert len(engine.programs) == 1  # the capture made on the first batch is the one used
    assert engine.chunks is not None and engine.chunks.stats.evictions > 0  # paged
    # the Trainer's schedule is made over the engine's optimizer, which the update reads
    assert trainer.lr_scheduler.optimizer is engine.optimizer
    assert isinstance(engine.optimizer, HybridAdam)
    assert engine.stateful()["scheduler"] is trainer.lr_scheduler
    lrs = [entry["learning_rate"] for entry in logs]
    assert lrs[:3] == pytest.approx([0.0, 1.5e-3, 3e-3])  # warmup, then linear decay
    assert all(earlier > later for earlier, later in zip(lrs[2:], lrs[3:]))
    assert engine.optimizer.param_groups[0]["lr"] == trainer.lr_scheduler.get_last_lr()[0]
    for entry in logs:  # what a log line adds under fxstar
        assert entry["tokens_per_second"] > 0 and math.isfinite(entry["grad_norm"])
        assert set(MEMORY) <= set(entry) and entry["host_mib"] > 0
        assert entry["compute_chunks_peak_mib"] > 0


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_evaluation_runs_the_engine_in_eval_mode(family, tmp_path):
    model = make_model(family)
    eager = copy.deepcopy(model)
    args = arguments(tmp_path, max_steps=6, per_device_eval_batch_size=8)
    held_out = Subset(blocks(), range(16))
    trainer = FxstarTrainer(model=model, args=args, train_dataset=blocks(), eval_dataset=held_out,
                            plan=PAGED)  # fmt: skip
    before = trainer.evaluate()["eval_loss"]
    # transformers' Trainer on the eager model: GPT-2's dropout off, the same normalisation
    expected = transformers.Trainer(model=eager, args=args, eval_dataset=held_out).evaluate()
    assert before == pytest.approx(expected["eval_loss"], rel=1e-5)
    trainer.train()
    assert trainer.evaluate()["eval_loss"] < before


@pytest.mark.parametrize(
    "family, precision",
    [("gpt2", "fp32"), ("llama", "bf16"), ("llama", "fp16"), ("llama", "bf16, disk tier")],
)
def test_resume_reproduces_the_uninterrupted_run(family, precision, tmp_path):
    disk = "disk tier" in precision  # the moments and masters in files, saved by streaming

    def run(name: str, resume: str | None = None) -> FxstarTrainer:
        args = arguments(tmp_path / name, max_steps=6, save_strategy="steps", save_steps=3,
                         per_device_train_batch_size=2, gradient_accumulation_steps=2,
                         warmup_steps=2)  # fmt: skip
        plan = PAGED.replace(precision=precision.split(",")[0],
                             disk=str(tmp_path / f"{name}-state") if disk else None)  # fmt: skip
        trainer = FxstarTrainer(model=make_model(family), args=args, train_dataset=blocks(),
                                plan=plan)  # fmt: skip
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    whole = run("whole")
    assert bool(whole.engine.optimizer.on_disk) == disk
    checkpoint = tmp_path / "whole" / "checkpoint-3"
    resumed = run("resumed", resume=str(checkpoint))

    def after_resume(trainer):
        return [(e["step"], e["loss"], e["learning_rate"], e.get("grad_norm"))
                for e in step_logs(trainer) if e["step"] > 3]  # fmt: skip

    assert len(after_resume(whole)) == 3
    assert after_resume(resumed) == after_resume(whole)
    if precision == "fp16":  # the loss scaler resumed with the rest (engine.stateful())
        assert resumed.engine.scaler.scale == whole.engine.scaler.scale
    expected = whole.engine.state_dict()
    for name, value in resumed.engine.state_dict().items():
        assert torch.equal(value, expected[name]), name
    files = set(os.listdir(checkpoint))
    assert {ENGINE_CHECKPOINT, "trainer_state.json", "rng_state.pth", "config.json"} <= files
    # the engine's checkpoint holds parameters, optimizer state and scheduler: once
    assert not files & {"optimizer.pt", "scheduler.pt", "model.safetensors", "pytorch_model.bin"}


def drawing_collator(features: list[dict]) -> dict:
    """transformers' default collator, after a draw from torch's generator (as masking
    collators draw): a batch drawn to compile must leave the generator as it was."""
    torch.rand(1)
    return transformers.default_data_collator(features)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_trains_as_the_transformers_trainer(family, tmp_path):
    """10 blocks in batches of 2, two accumulated a step: windows of 2, 2 and 1 batch an
    epoch, two epochs; weight decay, clipping at 1.0, the linear schedule, GPT-2's dropout
    drawn from the generator the collator also draws from."""
    data = Subset(blocks(), range(10))
    args = arguments(tmp_path, num_train_epochs=2, per_device_train_batch_size=2,
                     gradient_accumulation_steps=2, weight_decay=0.1,
                     optim="adamw_torch")  # fmt: skip
    model = make_model(family)
    eager = copy.deepcopy(model)
    fx = FxstarTrainer(model=model, args=args, train_dataset=data, plan=PAGED,
                       data_collator=drawing_collator)  # fmt: skip
    fx.train()
    hf = transformers.Trainer(model=eager, args=args, train_dataset=data,
                              data_collator=drawing_collator)  # fmt: skip
    hf.train()
    assert fx.state.global_step == hf.state.global_step == 6
    ours, theirs = step_logs(fx), step_logs(hf)
    for got, want in zip(ours, theirs, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6, abs=0)
        assert got["learning_rate"] == want["learning_rate"]
    expected = eager.state_dict()
    for name, value in fx.engine.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-5)
    # one engine update per Trainer step, the shorter windows too
    engine = fx.engine
    assert engine.step_count == 6 * 2
    assert {int(state["step"]) for state in engine.optimizer.state.values()} == {6}


def test_a_compute_loss_func_trains_on_the_engines_outputs(tmp_path):
    """The model is called without labels (the Trainer hands them to the function), and the
    loss is computed outside the compiled graph from its logits."""

    def next_token_loss(outputs, labels, num_items_in_batch=None):
        logits = outputs.logits[:, :-1]
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten())

    trainer = FxstarTrainer(model=make_model("llama"), plan=PAGED, train_dataset=blocks(),
                            compute_loss_func=next_token_loss,
                            args=arguments(tmp_path, max_steps=6))  # fmt: skip
    trainer.train()
    losses = [entry["loss"] for entry in step_logs(trainer)]
    assert losses[-1] < losses[0] - 0.1, losses
    assert len(trainer.engine.programs) == 1  # the capture prepared without labels


def test_save_model_writes_what_from_pretrained_opens(tmp_path):
    trainer = FxstarTrainer(model=make_model("gpt2"), plan=PAGED, train_dataset=blocks(),
                            args=arguments(tmp_path, max_steps=2))  # fmt: skip
    trainer.train()
    trainer.save_model(str(tmp_path / "model"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    ids = blocks()[0]["input_ids"][None]
    trainer.engine.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits,
                                   trainer.engine(input_ids=ids).logits)  # fmt: skip


def test_resume_needs_the_engine_checkpoint(tmp_path):
    args = arguments(tmp_path, max_steps=2, save_strategy="steps", save_steps=2,
                     save_only_model=True)  # fmt: skip
    trainer = FxstarTrainer(model=make_model("llama"), args=args, train_dataset=blocks(),
                            plan=PAGED)  # fmt: skip
    trainer.train()
    checkpoint = tmp_path / "checkpoint-2"
    assert "model.safetensors" in os.listdir(checkpoint)  # save_only_model: a model directory
    again = FxstarTrainer(model=make_model("llama"), args=args, train_dataset=blocks(),
                          plan=PAGED)  # fmt: skip
    with pytest.raises(CheckpointError, match=f"no {ENGINE_CHECKPOINT}/ engine checkpoint"):
        again.train(resume_from_checkpoint=str(checkpoint))


def test_a_checkpoint_whose_trainer_state_disagrees_is_refused(tmp_path):
    args = arguments(tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    FxstarTrainer(model=make_model("llama"), args=args, train_dataset=blocks(), plan=PAGED).train()
    checkpoint = tmp_path / "checkpoint-2"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    state["global_step"] = 1  # as if trainer_state.json came from another run
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    again = FxstarTrainer(model=make_model("llama"), args=args, train_dataset=blocks(), plan=PAGED)
    with pytest.raises(CheckpointError, match="micro-step 2, the Trainer's state at step 1"):
        again.train(resume_from_checkpoint=str(checkpoint))
