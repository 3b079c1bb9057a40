"""What FxstarTrainer takes from the Trainer's arguments, and what it refuses by name."""

from __future__ import annotations

import pytest
import torch
import transformers
from trainer_setup import make_model

import fxstar
from fxstar.errors import PlanError, UsageError
from fxstar.integrations.trainer_args import exact_name_pattern
from fxstar.integrations.transformers import FxstarTrainer
from fxstar.plan import OptimizerConfig


def arguments(tmp_path, **changes) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", **changes)


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"fp16": True}, "fp16=True: fxstar's precision is the plan's"),
        ({"activation_checkpointing": True}, "activation_checkpointing=True: fxstar checkpoints"),
        ({"torch_compile": True}, "torch_compile=True"),
        ({"optim": "sgd"}, "optim='sgd'"),
        ({"label_smoothing_factor": 0.1}, "label_smoothing_factor=0.1"),
        ({"neftune_noise_alpha": 5.0}, "neftune_noise_alpha=5.0"),
        ({"use_liger_kernel": True}, "use_liger_kernel=True"),
        ({"fsdp": True}, "fsdp="),
        (
            {"load_best_model_at_end": True, "eval_strategy": "steps", "save_strategy": "steps"},
            "load_best_model_at_end=True",
        ),
    ],
)
def test_training_arguments_the_engine_cannot_honour_are_named(changes, named, tmp_path):
    with pytest.raises(UsageError, match="FxstarTrainer cannot honour") as raised:
        FxstarTrainer(model=make_model("llama"), args=arguments(tmp_path, **changes),
                      plan=fxstar.Plan())  # fmt: skip
    assert named in str(raised.value)


def test_deepspeed_is_refused_before_the_trainer_builds_it(tmp_path):
    """TrainingArguments(deepspeed=...) needs the deepspeed package; set afterwards, as it is
    where one is installed, the argument reaches FxstarTrainer, which refuses it first."""
    args = arguments(tmp_path)
    args.deepspeed = {"zero_optimization": {"stage": 3}}
    with pytest.raises(UsageError, match="deepspeed=.*fxstar is the memory engine here"):
        FxstarTrainer(model=make_model("llama"), args=args, plan=fxstar.Plan())


def test_every_refused_argument_is_named_at_once(tmp_path):
    args = arguments(tmp_path, fp16=True, torch_compile=True, optim="adafactor")
    with pytest.raises(UsageError) as raised:
        FxstarTrainer(model=make_model("llama"), args=args, plan=fxstar.Plan())
    assert all(name in str(raised.value) for name in ("fp16=", "torch_compile=", "optim="))


@pytest.mark.parametrize("argument", ["optimizers", "optimizer_cls_and_kwargs", "model_init"])
def test_trainer_arguments_that_replace_the_engine_are_named(argument, tmp_path):
    model = make_model("llama")
    given = {
        "optimizers": (torch.optim.SGD(model.parameters(), lr=0.1), None),
        "optimizer_cls_and_kwargs": (torch.optim.SGD, {"lr": 0.1}),
        "model_init": lambda: model,
    }[argument]
    with pytest.raises(UsageError, match=f"{argument}: "):
        FxstarTrainer(model if argument != "model_init" else None, arguments(tmp_path),
                      plan=fxstar.Plan(), **{argument: given})  # fmt: skip


def test_an_engine_is_refused_as_the_model(tmp_path):
    engine = fxstar.compile(make_model("llama"))
    with pytest.raises(UsageError, match="pass the model itself"):
        FxstarTrainer(model=engine, args=arguments(tmp_path), plan=fxstar.Plan())


def test_a_plan_that_sets_what_the_arguments_set_is_refused(tmp_path):
    plan = fxstar.Plan(optimizer={"lr": 0.01})
    with pytest.raises(PlanError, match=r"optimizer\.lr: .*\(learning_rate\)"):
        FxstarTrainer(model=make_model("llama"), args=arguments(tmp_path), plan=plan)


def test_the_plan_takes_the_optimizer_from_the_arguments(tmp_path):
    args = arguments(tmp_path, learning_rate=2e-3, adam_beta1=0.8, adam_beta2=0.95,
                     adam_epsilon=1e-6, weight_decay=0.1, max_grad_norm=0.5,
                     gradient_accumulation_steps=3)  # fmt: skip

    class EmbeddingsUndecayed(FxstarTrainer):
        def get_decay_parameter_names(self, model):
            return [name for name in super().get_decay_parameter_names(model) if "wte" not in name]

    trainer = EmbeddingsUndecayed(model=make_model("gpt2"), args=args, plan=fxstar.Plan())
    options = trainer.engine.plan.optimizer
    assert (options.type, options.lr, options.betas, options.eps) == ("adamw", 2e-3, (0.8, 0.95),
                                                                      1e-6)  # fmt: skip
    assert (options.weight_decay, options.clip_grad_norm, options.accumulation_steps) == (
        0.1, 0.5, 3)  # fmt: skip
    # weight decay on exactly the parameters the Trainer decays, as a subclass chooses them
    decay = set(trainer.get_decay_parameter_names(trainer.model))
    assert "transformer.wte.weight" not in decay and "transformer.h.0.attn.c_attn.bias" not in decay
    for name, _ in trainer.model.named_parameters():
        assert options.decays(name) == (name in decay), name


def test_no_clipping_when_max_grad_norm_is_zero(tmp_path):
    trainer = FxstarTrainer(model=make_model("llama"), args=arguments(tmp_path, max_grad_norm=0),
                            plan=fxstar.Plan())  # fmt: skip
    assert trainer.engine.plan.optimizer.clip_grad_norm is None


def test_an_exact_name_pattern_matches_that_name_alone():
    options = OptimizerConfig(no_decay=(exact_name_pattern("head.weight"),
                                        exact_name_pattern("w[0]*")))  # fmt: skip
    assert not options.decays("head.weight")
    assert options.decays("lm_head.weight") and options.decays("head.weight2")
    assert not options.decays("w[0]*") and options.decays("w0x")
