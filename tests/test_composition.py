"""Every pair of memory features, in fp32 and bf16, against eager PyTorch on the same seed.

Features: chunks with evictions, checkpoint='blocks', activation offload, cpu_embedding,
tiled_linear and checkpoint='auto' (tensor parallel pairs: tests/passes/test_tensor_parallel.py,
which spawns ranks). A pair that needs a third feature gets it (offload needs checkpoint
regions); 'blocks' and 'auto' are one option and never pair. The reference GPT (tied, with
dropout) runs every cell by default; GPT-2 (tied) and Llama (untied: cpu_embedding moves its
embedding) cells are slow.

fp32: loss and gradients bitwise, except with tiled_linear (tiles sum in another order:
rtol 1e-5, atol 1e-6). bf16: against eager fp32, the loss within 5% and each gradient within
15% in norm (see tests/test_families.py).
"""

import itertools

import pytest
import torch
from conftest import close_in_norm, example, hf_gpt2, seeded_backward, tiny_gpt, tokens
from passes.test_cpu_embedding import untied_llama

from fxstar.engine import compile
from fxstar.plan import Plan

FEATURES = ("chunks", "blocks", "offload", "cpu_embedding", "tiled", "auto")
PAIRS = [p for p in itertools.combinations(FEATURES, 2) if set(p) != {"blocks", "auto"}]
CELLS = [(f,) for f in FEATURES] + PAIRS


MODELS = {"gpt": tiny_gpt, "gpt2": hf_gpt2, "llama": untied_llama}


def plan_for(features: tuple[str, ...], model: torch.nn.Module, precision: str) -> Plan:
    options: dict = {"precision": precision}
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if {"chunks", "cpu_embedding"} & set(features):
        options.update(device_memory=param_bytes, static_partition=True,
                       warmup_gpu_chunk_mem_ratio=0.7)  # fmt: skip
    if "cpu_embedding" in features:
        options["cpu_embedding"] = True
    if "blocks" in features or ("offload" in features and "auto" not in features):
        options["checkpoint"] = "blocks"
    if "auto" in features:
        options.update(checkpoint="auto", activation_memory=2048)
    if "offload" in features:
        options["offload_activations"] = True
    if "tiled" in features:
        options["tiled_linear"] = {"in_splits": 2, "out_splits": 2, "min_size": 1024}
    return Plan(**options)


def _close(got: torch.Tensor, want: torch.Tensor, precision: str, tiled: bool) -> bool:
    if precision == "bf16":
        return close_in_norm(got, want, 0.15)
    if tiled:
        return torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    return torch.equal(got, want)


def check(model_name: str, features: tuple[str, ...], precision: str) -> None:
    eager, model = MODELS[model_name](), MODELS[model_name]()
    ids, targets = tokens()
    plan = plan_for(features, model, precision)
    engine = compile(model, plan, **example(model_name, ids, targets))
    expected = seeded_backward(model_name, eager, ids, targets, seed=3)
    loss = seeded_backward(model_name, engine, ids, targets, seed=3)
    tiled = "tiled" in features
    if precision == "bf16":
        assert torch.allclose(loss.float(), expected, rtol=5e-2), (loss, expected)
    else:
        assert _close(loss, expected, precision, tiled), (loss, expected)
    grads = engine.gradients()
    for name, p in eager.named_parameters():
        assert (grads[name] is None) == (p.grad is None), name
        if p.grad is not None:
            assert _close(grads[name], p.grad, precision, tiled), (name, features)
    assert engine.step()


# 'auto' at 2 KiB checkpoints every region (and says it cannot meet that budget)
AUTO_WARNING = "ignore:checkpoint='auto'.*cannot be met:UserWarning"


@pytest.mark.filterwarnings(AUTO_WARNING)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("features", CELLS, ids="+".join)
def test_pairs_on_the_reference_gpt(features, precision):
    check("gpt", features, precision)


@pytest.mark.slow
@pytest.mark.filterwarnings(AUTO_WARNING)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("features", CELLS, ids="+".join)
@pytest.mark.parametrize("model_name", ["gpt2", "llama"])
def test_pairs_on_transformers_models(model_name, features, precision):
    check(model_name, features, precision)
