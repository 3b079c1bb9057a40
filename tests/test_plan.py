import dataclasses
import json

import pytest
import torch

from fxstar import plan as plan_module
from fxstar.plan import (
    LossScaleConfig,
    OptimizerConfig,
    Plan,
    PlanError,
    TensorParallelConfig,
    TiledLinearConfig,
    option_names,
    resolve_device,
)
from fxstar.sizes import Share

PATRICKSTAR = {
    "optimizer": {
        "type": "Adam",
        "params": {
            "lr": 0.001,
            "betas": [0.9, 0.999],
            "eps": 1e-6,
            "weight_decay": 0,
            "use_hybrid_adam": True,
        },
    },
    "fp16": {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 10,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "default_chunk_size": 67108864,
    "release_after_init": False,
    "use_cpu_embedding": False,
    "client": {
        "mem_tracer": {
            "use_async_mem_monitor": True,
            "warmup_gpu_chunk_mem_ratio": 0.1,
            "overall_gpu_mem_ratio": 0.8,
            "overall_cpu_mem_ratio": 0.8,
            "margin_use_ratio": 0.8,
            "use_fake_dist": False,
            "with_static_partition": False,
        },
        "opts": {"with_mem_saving_comm": False, "with_mem_cache": True, "with_async_move": False},
    },
}


def test_defaults():
    p = Plan()
    assert p.device_memory is None and p.host_memory is None and p.activation_memory is None
    assert p.chunk_size == "auto" and p.precision == "fp32"
    assert p.optimizer == OptimizerConfig()
    assert p.optimizer.type == "adamw" and p.optimizer.lr == 1e-3
    assert p.optimizer.betas == (0.9, 0.999) and p.optimizer.eps == 1e-8
    assert p.optimizer.no_decay == ("bias", "norm", "ln_", "layernorm")
    assert p.optimizer.clip_grad_norm is None and p.optimizer.accumulation_steps == 1
    assert p.loss_scale == LossScaleConfig(0.0, 16, 1000, 2, 1.0)
    assert p.hybrid_adam is True and p.checkpoint is None and p.checkpoint_every == 1
    assert p.tiled_linear is None and p.tensor_parallel is None
    assert (p.warmup_gpu_chunk_mem_ratio, p.overall_gpu_mem_ratio) == (0.1, 0.8)
    assert (p.overall_cpu_mem_ratio, p.margin_use_ratio) == (0.8, 0.8)
    assert p.mem_cache == 2 and p.passes == () and p.verify is False
    assert p.loss_fn is None and p.seed is None and p.notes == []
    assert TiledLinearConfig().min_size == 1 << 20
    assert TensorParallelConfig().rules == {}


def test_every_option_has_a_doc_and_a_feature():
    for f in dataclasses.fields(Plan):
        if f.name != "notes":
            assert f.metadata["doc"] and f.metadata["feature"], f.name


def test_design_doc_example():
    p = Plan(
        device_memory="4GiB",
        precision="bf16",
        checkpoint="blocks",
        offload_activations=True,
        cpu_embedding=True,
        tiled_linear={"in_splits": 2, "out_splits": 2},
        optimizer={"type": "adamw", "lr": 3e-4, "weight_decay": 0.1},
    )
    assert p.device_memory == 4 * 1024**3
    assert p.tiled_linear == TiledLinearConfig(in_splits=2, out_splits=2)
    assert p.optimizer == OptimizerConfig(lr=3e-4, weight_decay=0.1)


def test_nested_dicts_take_defaults_for_missing_keys():
    p = Plan(optimizer={"lr": 3e-4}, loss_scale={"hysteresis": 4}, tensor_parallel={"size": 2})
    assert p.optimizer == OptimizerConfig(lr=3e-4)
    assert p.loss_scale == LossScaleConfig(hysteresis=4)
    assert p.tensor_parallel == TensorParallelConfig(size=2)
    assert Plan(loss_scale=128).loss_scale == LossScaleConfig(loss_scale=128.0)


def test_normalisation():
    p = Plan(
        precision="BF16",
        optimizer={"type": "AdamW", "betas": [0.8, 0.9], "no_decay": ["bias"]},
        checkpoint=["h.*", "lm_head"],
        passes=["capture", "chunk_schedule"],
        tensor_parallel={"rules": {"*.c_attn": "Column"}},
    )
    assert p.precision == "bf16" and p.optimizer.type == "adamw"
    assert p.optimizer.betas == (0.8, 0.9) and p.optimizer.no_decay == ("bias",)
    assert p.checkpoint == ("h.*", "lm_head") and p.passes == ("capture", "chunk_schedule")
    assert p.tensor_parallel.rules == {"*.c_attn": "column"}
    assert Plan(checkpoint=[]).checkpoint is None


def test_sizes_and_share_resolution():
    p = Plan(device_memory="30%", host_memory="1.5 GB", activation_memory=1000)
    assert p.device_memory == Share(30.0)
    assert p.host_memory == 1_500_000_000
    assert p.resolve_size("device_memory", 10_000) == 3000
    assert p.resolve_size("host_memory", 10_000) == 1_500_000_000
    assert p.resolve_size("activation_memory", 10_000) == 1000
    assert Plan().resolve_size("device_memory", 10_000) is None
    with pytest.raises(PlanError, match="mem_cache: not a size option"):
        p.resolve_size("mem_cache", 10)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"margin_use_ratio": 1.5}, r"margin_use_ratio: must be in \(0, 1\], got 1.5"),
        ({"overall_gpu_mem_ratio": 0}, r"overall_gpu_mem_ratio: must be in \(0, 1\], got 0"),
        ({"warmup_gpu_chunk_mem_ratio": float("nan")}, "warmup_gpu_chunk_mem_ratio: must be in"),
        ({"checkpoint_every": 0}, "checkpoint_every: must be >= 1, got 0"),
        ({"mem_cache": -1}, "mem_cache: must be >= 0, got -1"),
        ({"chunk_size": 0}, "chunk_size: must be 'auto' or an int > 0"),
        ({"chunk_size": "big"}, "chunk_size: must be 'auto' or an int > 0"),
        ({"precision": "fp8"}, "precision: must be one of 'fp32', 'bf16', 'fp16', got 'fp8'"),
        ({"device_memory": "4 gigs"}, "device_memory: expected bytes"),
        ({"host_memory": -5}, "host_memory: must be >= 0 bytes"),
        ({"activation_memory": "2000%"}, "activation_memory: a share must be in"),
        ({"optimizer": {"lr": 0}}, r"optimizer.lr: must be in \(0, 10\], got 0"),
        ({"optimizer": {"type": "lamb"}}, "optimizer.type: must be one of"),
        ({"optimizer": {"betas": [0.9, 1.0]}}, r"optimizer.betas\[1\]: must be in \[0, 1\)"),
        ({"optimizer": {"betas": [0.9]}}, "optimizer.betas: must be a pair"),
        ({"optimizer": {"weight_decay": -0.1}}, r"optimizer.weight_decay: must be in \[0, 10\]"),
        ({"optimizer": {"clip_grad_norm": 0}}, "optimizer.clip_grad_norm: must be > 0"),
        ({"optimizer": {"accumulation_steps": 0}}, "optimizer.accumulation_steps: must be >= 1"),
        ({"loss_scale": {"initial_scale_power": 65}}, "loss_scale.initial_scale_power: must be in"),
        ({"loss_scale": {"min_loss_scale": 0}}, r"loss_scale.min_loss_scale: must be in \(0, "),
        ({"tiled_linear": {"in_splits": 0}}, "tiled_linear.in_splits: must be >= 1"),
        ({"tensor_parallel": {"rules": {"h.*": "diagonal"}}}, r"tensor_parallel.rules\['h.\*'\]"),
        ({"seed": -1}, "seed: must be in"),
        ({"seed": 2**70}, r"seed: must be in \[0, 18446744073709551615\]"),  # torch's largest
    ],
)
def test_range_errors_name_the_field_and_range(options, message):
    with pytest.raises(PlanError, match=message):
        Plan(**options)
    with pytest.raises(ValueError, match=message):
        Plan.from_dict(options)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"hybrid_adam": "yes"}, "hybrid_adam: must be a bool, got 'yes' (str)"),
        ({"verify": 1}, "verify: must be a bool, got 1 (int)"),
        ({"margin_use_ratio": "0.8"}, "margin_use_ratio: must be a number"),
        ({"mem_cache": 2.0}, "mem_cache: must be an int"),
        ({"mem_cache": True}, "mem_cache: must be an int"),
        ({"checkpoint_every": None}, "checkpoint_every: must be an int"),
        ({"passes": "capture"}, "passes: must be a list of strings"),
        ({"passes": ["capture", 3]}, "passes: every entry must be a non-empty string"),
        ({"checkpoint": "everything"}, "checkpoint: must be None, 'blocks', 'auto' or a list"),
        ({"optimizer": None}, "optimizer: must be an OptimizerConfig or a dict|optimizer: must be"),
        ({"tiled_linear": 2}, "tiled_linear: must be None, a TiledLinearConfig or a dict"),
        ({"loss_fn": "cross_entropy"}, "loss_fn: must be None or a callable"),
        ({"tensor_parallel": {"sequence_parallel": "no"}}, "tensor_parallel.sequence_parallel"),
    ],
)
def test_type_errors_name_the_field(options, message):
    with pytest.raises(PlanError) as info:
        Plan(**options)
    assert any(part in str(info.value) for part in message.split("|")), str(info.value)


INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"optimizer": {"lr": INF}}, r"optimizer.lr: must be in \(0, 10\], got inf"),
        ({"optimizer": {"lr": NAN}}, r"optimizer.lr: must be in \(0, 10\], got nan"),
        ({"optimizer": {"lr": 1e10}}, r"optimizer.lr: must be in \(0, 10\], got 10000000000.0"),
        ({"optimizer": {"eps": 0}}, r"optimizer.eps: must be in \[1.17549e-38, 1\], got 0"),
        ({"optimizer": {"eps": 1e-45}}, "optimizer.eps: must be in .*, got 1e-45"),
        ({"optimizer": {"eps": INF}}, "optimizer.eps: must be in .*, got inf"),
        ({"optimizer": {"weight_decay": INF}}, r"optimizer.weight_decay: must be in \[0, 10\]"),
        ({"optimizer": {"weight_decay": 1e6}}, r"optimizer.weight_decay: must be in \[0, 10\]"),
        ({"optimizer": {"lr": 2, "weight_decay": 0.5}},
         r"lr \* weight_decay must be < 1 for 'adamw' .* 2 \* 0.5 = 1"),
        ({"optimizer": {"type": "sgd", "lr": 5, "weight_decay": 1}}, "must be < 1 for 'sgd'"),
        ({"optimizer": {"clip_grad_norm": INF}}, "clip_grad_norm: must be > 0 and finite, got inf"),
        ({"loss_scale": INF}, r"loss_scale.loss_scale: must be in \[0, 1.84467e\+19\], got inf"),
        ({"loss_scale": 1e30}, "loss_scale.loss_scale: must be in"),
        ({"loss_scale": {"min_loss_scale": INF}}, "loss_scale.min_loss_scale: must be in"),
        ({"loss_scale": {"initial_scale_power": 4, "min_loss_scale": 32}},
         r"min_loss_scale: must be at most the initial scale 2\*\*initial_scale_power = 16"),
        ({"loss_scale": {"warn_after_skips": -1}}, "loss_scale.warn_after_skips: must be >= 0"),
    ],
)  # fmt: skip
def test_non_finite_and_absurd_numbers_are_refused(options, message):
    with pytest.raises(PlanError, match=message):
        Plan(**options)


def test_absurd_numbers_are_not_refused_where_they_are_harmless():
    assert Plan(optimizer={"type": "adam", "lr": 2, "weight_decay": 5}).optimizer.lr == 2
    fixed = Plan(loss_scale={"loss_scale": 8, "initial_scale_power": 0, "min_loss_scale": 64})
    assert fixed.loss_scale.loss_scale == 8  # a fixed scale has no minimum to respect
    assert Plan(loss_scale={"warn_after_skips": 0}).loss_scale.warn_after_skips == 0


@pytest.mark.parametrize("size", [1e30, 2**63, 10**30, "100000000 TiB"])
def test_sizes_beyond_int64_are_a_plan_error(size):
    with pytest.raises(PlanError, match=r"device_memory: must be at most 2\*\*63 - 1 bytes"):
        Plan(device_memory=size)
    assert Plan(host_memory=2**63 - 1).host_memory == 2**63 - 1


def test_unknown_keywords_are_a_plan_error_with_a_suggestion():
    # were dataclass TypeErrors ("unexpected keyword argument 'device_memroy'")
    with pytest.raises(PlanError, match="unknown option 'device_memroy' — did you mean"):
        Plan(device_memroy="4GiB")
    with pytest.raises(PlanError, match="'optimizer.lrr' — did you mean 'optimizer.lr'"):
        OptimizerConfig(lrr=0.1)
    with pytest.raises(PlanError, match="did you mean 'loss_scale.hysteresis'"):
        LossScaleConfig(hysteresys=2)
    with pytest.raises(PlanError, match="unknown option 'notes'"):
        Plan(notes=["x"])


def test_unknown_keys_suggest_the_closest_option():
    top = "unknown option 'device_memroy' — did you mean 'device_memory'?"
    with pytest.raises(PlanError, match=top):
        Plan.from_dict({"device_memroy": "4GiB"})
    nested = "unknown option 'optimizer.lrr' — did you mean 'optimizer.lr'?"
    with pytest.raises(PlanError, match=nested):
        Plan.from_dict({"optimizer": {"lrr": 0.1}})
    with pytest.raises(PlanError, match="did you mean 'tiled_linear.in_splits'"):
        Plan(tiled_linear={"in_split": 2})
    known = "unknown option 'zzz'; known options: device, device_memory"
    with pytest.raises(PlanError, match=known):
        Plan.from_dict({"zzz": 1})
    with pytest.raises(PlanError, match="did you mean 'checkpoint'"):
        Plan().replace(checkpiont="blocks")


def test_replace_validates_and_keeps_the_original():
    p = Plan()
    q = p.replace(precision="bf16", optimizer={"lr": 0.1})
    assert p.precision == "fp32" and q.precision == "bf16" and q.optimizer.lr == 0.1
    with pytest.raises(PlanError, match="margin_use_ratio"):
        p.replace(margin_use_ratio=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.precision = "bf16"


def _full_plan() -> Plan:
    return Plan(
        device_memory="30%",
        host_memory="64GiB",
        activation_memory="12.5%",
        chunk_size=1 << 20,
        precision="fp16",
        optimizer={"type": "adam", "lr": 3e-4, "betas": [0.8, 0.95], "clip_grad_norm": 1.0},
        loss_scale={"loss_scale": 0, "initial_scale_power": 12},
        hybrid_adam=False,
        checkpoint=["transformer.h.*"],
        checkpoint_every=2,
        offload_activations=True,
        tiled_linear={"in_splits": 2, "out_splits": 4, "min_size": 4096},
        tensor_parallel={"size": 2, "sequence_parallel": True, "rules": {"*.c_fc": "column"}},
        passes=["capture"],
        mem_cache=0,
        seed=7,
    )


def test_dict_and_json_round_trip(tmp_path):
    p = _full_plan()
    assert Plan.from_dict(p.to_dict()) == p
    assert Plan.from_json(p.to_json()) == p
    data = json.loads(p.to_json())
    assert data["device_memory"] == "30%" and data["optimizer"]["betas"] == [0.8, 0.95]
    assert "loss_fn" not in data
    path = tmp_path / "plan.json"
    p.to_json(path)
    assert Plan.from_json(path) == p
    assert Plan.from_json(str(path)) == p
    assert Plan.from_json(Plan().to_json()) == Plan()
    assert set(Plan().to_dict()) == set(option_names())


def test_loss_fn_round_trips_in_dicts_but_not_json():
    def loss(out, target):
        return out

    p = Plan(loss_fn=loss)
    assert Plan.from_dict(p.to_dict()) == p
    with pytest.raises(ValueError, match="loss_fn"):
        p.to_json()


def test_patrickstar_config():
    p = Plan.from_dict(PATRICKSTAR)
    assert p == Plan.from_patrickstar(PATRICKSTAR)
    assert p.optimizer == OptimizerConfig(type="adam", lr=0.001, betas=(0.9, 0.999), eps=1e-6)
    assert p.hybrid_adam is True
    assert p.precision == "fp16"
    assert p.loss_scale == LossScaleConfig(0.0, 10, 1000, 2, 1.0)
    assert p.chunk_size == 67108864
    assert p.release_after_init is False and p.cpu_embedding is False
    assert p.async_mem_monitor is True and p.fake_dist is False and p.static_partition is False
    assert (p.warmup_gpu_chunk_mem_ratio, p.overall_gpu_mem_ratio) == (0.1, 0.8)
    assert (p.overall_cpu_mem_ratio, p.margin_use_ratio) == (0.8, 0.8)
    assert p.mem_saving_comm is False and p.mem_cache == 2
    assert len(p.notes) == 1 and "with_async_move" in p.notes[0]
    assert PATRICKSTAR["optimizer"]["type"] == "Adam"  # the input is not modified


def test_patrickstar_variants():
    config = {
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "client": {"opts": {"with_mem_cache": False}},
        "gradient_clipping": 1.0,
        "device_memory": "2GiB",  # native options may be mixed in
    }
    p = Plan.from_dict(config)
    assert p.optimizer == OptimizerConfig(type="adamw", lr=0.01, clip_grad_norm=1.0)
    assert p.mem_cache == 0 and p.device_memory == 2 * 1024**3 and p.notes == []
    assert Plan.from_dict({"gradient_clipping": -1}).optimizer.clip_grad_norm is None
    assert Plan.from_dict({"fp16": {"enabled": False}}).precision == "fp32"


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"fp16": {"enabeld": True}}, "'fp16.enabeld' — did you mean 'fp16.enabled'"),
        ({"client": {"mem_tracer": {"use_async_mem_monitr": True}}},
         "did you mean 'client.mem_tracer.use_async_mem_monitor'"),
        ({"client": {"opts": {"with_mem_cach": True}}},
         "did you mean 'client.opts.with_mem_cache'"),
        ({"client": {}, "default_chunk_sise": 1}, "did you mean 'default_chunk_size'"),
        ({"optimizer": {"type": "Adam", "params": {"lrr": 1}}},
         "did you mean 'optimizer.params.lr'"),
        ({"client": {"opts": {"with_mem_cache": "yes"}}},
         "client.opts.with_mem_cache: must be a bool"),
        ({"fp16": {"enabled": True, "hysteresis": 0}}, "loss_scale.hysteresis: must be >= 1"),
    ],
)  # fmt: skip
def test_patrickstar_errors(config, message):
    with pytest.raises(PlanError, match=message):
        Plan.from_dict(config)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_patrickstar_non_finite_gradient_clipping_is_a_plan_error(value):
    # was "unsupported format string passed to NoneType.__format__"
    with pytest.raises(PlanError, match=f"gradient_clipping: must be a finite number, got {value}"):
        Plan.from_dict({"gradient_clipping": value})


def test_check_implemented():
    Plan().check_implemented()  # defaults never count as used
    Plan(
        optimizer={"lr": 0.1, "clip_grad_norm": 1.0, "accumulation_steps": 4},
        passes=["capture"],
        verify=True,
        seed=0,
        loss_fn=len,
    ).check_implemented()
    # the features as the Plan first shipped them: which options later issues implement
    # must not change what this test checks
    shipped = {"optimizer", "passes", "verify", "loss_fn", "seed"}
    with pytest.raises(NotImplementedError) as info:
        Plan(offload_activations=True, precision="bf16").check_implemented(shipped)
    message = str(info.value)
    assert (
        "Plan option 'offload_activations' is not implemented yet (it is part of the activation "
        "passes); remove it or set it to its default"
    ) in message
    assert "'precision'" in message and "mixed precision" in message
    with pytest.raises(NotImplementedError, match="'loss_scale.hysteresis'.*fp16 loss scaling"):
        Plan(loss_scale={"hysteresis": 3}).check_implemented(shipped)
    with pytest.raises(NotImplementedError, match="'tiled_linear'"):
        Plan(tiled_linear={}).check_implemented(shipped)
    Plan(offload_activations=True).check_implemented({"offload_activations"})
    Plan(loss_scale={"hysteresis": 3}).check_implemented({"loss_scale.hysteresis"})


def _unbuilt(monkeypatch, option):
    """Every plan option has a feature today: take `option` from the engine's list so it has
    none (the refusal of an option nothing implements stays tested)."""
    from fxstar import engine

    kept = tuple(o for o in engine.ENGINE_OPTIONS if o != option)
    monkeypatch.setattr(engine, "ENGINE_OPTIONS", kept)


def test_a_registered_pass_declares_the_options_it_implements(monkeypatch):
    from fxstar import passes

    _unbuilt(monkeypatch, "release_after_init")

    class ReleaseAfterInit(passes.Pass):
        name = "t_release_after_init"
        implements = ("release_after_init", "loss_scale.hysteresis")

    plan = Plan(release_after_init=True)
    with pytest.raises(NotImplementedError, match="release_after_init"):
        plan.check_implemented()
    passes.register(ReleaseAfterInit)
    try:
        plan.check_implemented()
        Plan(loss_scale={"hysteresis": 3}).check_implemented()
    finally:
        passes.unregister("t_release_after_init")
    with pytest.raises(NotImplementedError, match="release_after_init"):
        plan.check_implemented()  # gone with its pass

    class Misspelt(passes.Pass):
        name = "t_misspelt"
        implements = ("release_after_int",)

    with pytest.raises(PlanError, match="pass 't_misspelt'.*did you mean 'release_after_init'"):
        passes.register(Misspelt)
    assert "t_misspelt" not in passes.registered()


def test_describe_lists_every_option():
    p = Plan(device_memory="4GiB", tiled_linear={"in_splits": 2})
    text = p.describe()
    for f in dataclasses.fields(Plan):
        if f.name != "notes":
            assert f.name in text, f.name
            assert f.metadata["doc"].split()[0] in text
    for cls in [OptimizerConfig, LossScaleConfig, TiledLinearConfig, TensorParallelConfig]:
        for f in dataclasses.fields(cls):
            assert f"{cls._prefix}.{f.name}" in text
    changed = [line.split()[1] for line in text.splitlines() if line.startswith("*")]
    assert changed == ["device_memory", "tiled_linear", "tiled_linear.in_splits"]
    assert "4GiB" in text


def test_no_decay_matching():
    opt = OptimizerConfig(no_decay=("bias", "norm", "*.wpe.*"))
    assert not opt.decays("h.0.attn.c_attn.bias")
    assert not opt.decays("h.0.LayerNorm.weight")
    assert not opt.decays("transformer.wpe.weight")
    assert opt.decays("wpe.weight")  # a glob matches the full name only
    assert opt.decays("h.0.mlp.c_fc.weight")


def test_plan_errors_are_fxstar_errors_and_value_errors():
    from fxstar.errors import FxstarError, OptionNotImplementedError

    with pytest.raises(PlanError) as info:
        Plan(device_memroy="1GiB")
    assert isinstance(info.value, FxstarError) and isinstance(info.value, ValueError)
    assert PlanError is plan_module.PlanError  # re-exported where it always was
    with pytest.raises(OptionNotImplementedError) as refused:
        Plan(release_after_init=True).check_implemented(set())
    assert isinstance(refused.value, FxstarError)
    assert isinstance(refused.value, NotImplementedError)


def test_from_json_refuses_text_that_is_not_json(tmp_path):
    with pytest.raises(PlanError, match=r"plan JSON: not valid JSON \(Expecting"):
        Plan.from_json('{"device_memory": }')
    path = tmp_path / "plan.json"
    path.write_text("{'precision': 'bf16'}")
    with pytest.raises(PlanError, match=r"plan\.json: not valid JSON"):
        Plan.from_json(path)
    with pytest.raises(FileNotFoundError):
        Plan.from_json(tmp_path / "missing.json")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[1, 2]", r"plan JSON: must be a JSON object of plan options, got \[1, 2\] \(list\)"),
        (b'"adamw"', "plan.json: must be a JSON object of plan options, got 'adamw'"),
        ("[" * 100_000 + "]" * 100_000, "plan JSON: nested too deeply"),
        ('{"optimizer": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
        (b'{"precision": "\xff"}', "plan.json: not UTF-8 text"),
    ],
)
def test_from_json_refuses_json_that_is_no_plan_by_name(text, message, tmp_path):
    """Text or a file alike: never a raw FileNotFoundError, RecursionError or TypeError."""
    path = tmp_path / "plan.json"
    if isinstance(text, bytes):  # a file only (text not starting with { or [ is a path)
        path.write_bytes(text)
    else:
        path.write_text(text)
        with pytest.raises(PlanError, match=message.replace("plan.json", "plan JSON")):
            Plan.from_json(text)
    with pytest.raises(PlanError, match=message.replace("plan JSON", r"plan\.json")):
        Plan.from_json(path)


def test_patrickstar_module():
    from fxstar import patrickstar

    assert patrickstar.is_patrickstar(PATRICKSTAR)
    assert patrickstar.is_patrickstar({"optimizer": {"type": "Adam", "params": {}}})
    assert not patrickstar.is_patrickstar({"optimizer": {"type": "adam"}, "chunk_size": 4})
    options, notes = patrickstar.plan_options(PATRICKSTAR)
    assert options["precision"] == "fp16" and options["chunk_size"] == 67108864
    assert options["optimizer"] == {"type": "Adam", "lr": 0.001, "betas": [0.9, 0.999],
                                    "eps": 1e-6, "weight_decay": 0}  # fmt: skip
    assert len(notes) == 1 and Plan.from_dict(options) == Plan.from_patrickstar(PATRICKSTAR)
    # a native plan is not taken for a PatrickStar one
    assert Plan.from_dict({"optimizer": {"lr": 0.5}}).optimizer.lr == 0.5


@pytest.fixture
def four_cards(monkeypatch):
    """torch.cuda as on a machine with four cards, card 0 current; the cards set current are
    recorded."""
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return chosen


def test_auto_and_cuda_under_torchrun_take_the_local_ranks_card_and_make_it_current(
    four_cards, monkeypatch
):
    assert resolve_device(Plan()) == torch.device("cuda", 0)  # not under torchrun: current
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert resolve_device(Plan()) == torch.device("cuda", 2)
    assert resolve_device(Plan(device="cuda")) == torch.device("cuda", 2)
    assert resolve_device(Plan(device="cuda:1")) == torch.device("cuda", 1)  # named: as named
    assert resolve_device(Plan(device="cpu")) == torch.device("cpu")
    assert four_cards == [0, 2, 2, 1]
    # fake_dist: the ranks share one card, the current one
    assert resolve_device(Plan(fake_dist=True)) == torch.device("cuda", 0)


def test_more_ranks_on_a_node_than_cards_is_refused_by_name(four_cards, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "5")
    message = (r"'auto' under torchrun \(LOCAL_RANK 5's card\) does not exist here: this "
               r"machine has 4 CUDA device.*--nproc-per-node")  # fmt: skip
    with pytest.raises(PlanError, match=message):
        resolve_device(Plan())
    assert four_cards == []


def test_warmup_gpu_chunk_mem_ratio_is_read_only_with_static_partition():
    plan = Plan(device_memory=1 << 20, static_partition=True, warmup_gpu_chunk_mem_ratio=0.3)
    assert plan.warmup_gpu_chunk_mem_ratio == 0.3
    message = r"warmup_gpu_chunk_mem_ratio=0.3 is read only with static_partition=True"
    with pytest.raises(PlanError, match=message):
        Plan(device_memory=1 << 20, warmup_gpu_chunk_mem_ratio=0.3)
    with pytest.raises(PlanError, match=message):
        plan.replace(static_partition=False)
    assert Plan(warmup_gpu_chunk_mem_ratio=0.1).static_partition is False  # the default
