"""transformers checkpoints whose layout is not the model's (experts stored one by one, old
names, a fused tensor split on loading, tensors the model no longer keeps) read by transformers'
own rules, one checkpoint tensor at a time, into destinations: what from_pretrained loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from fxstar.hf_checkpoint import converted_source
from fxstar.weights import WeightsError, WeightSource, materialize, tied_names

transformers = pytest.importorskip("transformers")

SMALL = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
MOE = {
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                   "shared_expert_intermediate_size": 32}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    {"q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4,
                     "qk_nope_head_dim": 8, "v_head_dim": 8, "n_routed_experts": 4,
                     "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                     "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}),
}  # fmt: skip


def moe(family: str, seed: int = 0, **extra) -> nn.Module:
    config_name, model_name, sizes = MOE[family]
    config = getattr(transformers, config_name)(**{**SMALL, **sizes, **extra})
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(config)


def on_meta(make, *args, **kwargs) -> nn.Module:
    with torch.device("meta"):
        return make(*args, **kwargs)


def destinations(meta: nn.Module) -> dict[str, torch.Tensor]:
    """Empty host tensors for what a checkpoint gives: parameters (one name per tied one) and
    persistent buffers."""
    persistent = set(meta.state_dict(keep_vars=True))
    named = dict(meta.named_parameters())
    named.update((n, b) for n, b in meta.named_buffers() if n in persistent)
    return {n: torch.empty(t.shape, dtype=t.dtype) for n, t in named.items()}


def read(meta: nn.Module, directory: Path, **kwargs) -> tuple[dict[str, torch.Tensor], object]:
    dests = destinations(meta)
    with WeightSource(directory) as source:
        converted = converted_source(meta, source)
        assert converted is not None
        report = materialize(dests, converted, aliases=tied_names(meta), **kwargs)
    return dests, report


def assert_state_equal(dests: dict[str, torch.Tensor], model: nn.Module) -> None:
    state = model.state_dict()
    for name, got in dests.items():
        assert torch.equal(got, state[name]), name


@pytest.mark.parametrize("family", list(MOE))
def test_experts_stored_one_by_one_are_read_into_their_slices_of_the_fused_tensor(
    tmp_path, family, monkeypatch
):
    host = moe(family)
    host.save_pretrained(tmp_path)
    stored = WeightSource(tmp_path).names()
    assert any(".experts.0." in n for n in stored)  # transformers 5 writes them one by one
    assert not any(n.endswith("experts.gate_up_proj") for n in stored)
    reads = []
    real = WeightSource.read_into

    def read_into(self, name, out):
        reads.append((name, out))
        return real(self, name, out)

    def no_temporary(self, name):
        raise AssertionError(f"{name} read into a tensor of its own")

    monkeypatch.setattr(WeightSource, "read_into", read_into)
    monkeypatch.setattr(WeightSource, "read", no_temporary)
    meta = on_meta(moe, family)
    dests, report = read(meta, tmp_path)
    assert_state_equal(dests, host)  # bitwise what the model holds
    assert report.tensors == len(dests)  # a fused tensor counts once, with its parts' bytes
    assert report.bytes == sum(t.nbytes for t in load_file(tmp_path / "model.safetensors")
                               .values())  # fmt: skip
    fused = {n: t for n, t in dests.items() if n.endswith(("gate_up_proj", "down_proj"))
             and ".experts." in n}  # fmt: skip
    assert fused
    spans = [(t.data_ptr(), t.data_ptr() + t.nbytes) for t in fused.values()]
    experts = [(n, out) for n, out in reads if ".experts." in n]
    assert len(experts) == sum(".experts." in n for n in stored)
    for name, out in experts:  # each expert tensor straight into its rows of the fused home
        assert out.is_contiguous() and any(a <= out.data_ptr() < b for a, b in spans), name


def test_transformers_from_pretrained_reads_the_same(tmp_path):
    """The ground truth: what from_pretrained loads from the same files."""
    host = moe("mixtral")
    host.save_pretrained(tmp_path)
    loaded = transformers.MixtralForCausalLM.from_pretrained(tmp_path)
    dests, _ = read(on_meta(moe, "mixtral"), tmp_path)
    assert_state_equal(dests, loaded)


def test_a_fused_tensor_of_the_wrong_size_names_it_and_its_parts(tmp_path):
    moe("qwen2_moe").save_pretrained(tmp_path)
    meta = on_meta(moe, "qwen2_moe", moe_intermediate_size=8)
    with pytest.raises(WeightsError) as err:
        read(meta, tmp_path)
    text = str(err.value)
    assert "'model.layers.0.mlp.experts.gate_up_proj', converted by transformers' rules" in text
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in text
    assert "[4, 32, 32]" in text and "[4, 16, 32]" in text  # the parts' result, the model's


def test_old_names_and_tensors_the_model_no_longer_keeps(tmp_path):
    """A BERT checkpoint of the old layout: LayerNorm.gamma / .beta (renamed by transformers'
    legacy rules) and position_ids, persistent once (ignored by the model's own rules)."""
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64,
                                     max_position_embeddings=32)  # fmt: skip
    torch.manual_seed(0)
    host = transformers.BertModel(config)
    host.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    old = {n.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias",
           "LayerNorm.beta"): t for n, t in state.items()}  # fmt: skip
    old["embeddings.position_ids"] = torch.arange(32)[None]
    save_file(old, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert "embeddings.LayerNorm.gamma" in old
    with torch.device("meta"):
        meta = transformers.BertModel(config)
    dests, report = read(meta, tmp_path)
    assert_state_equal(dests, host)
    assert_state_equal(dests, transformers.BertModel.from_pretrained(tmp_path))
    assert report.unexpected == []  # position_ids is left out, as from_pretrained leaves it


LLAMA = {**SMALL, "num_key_value_heads": 4, "tie_word_embeddings": False}


def test_a_conversion_that_does_more_than_arrange_runs_on_its_own_tensors(tmp_path, monkeypatch):
    """A mapping registered with transformers: q, k and v stored fused (Chunk, which splits:
    run for real on that one tensor) and down_proj stored transposed (Transpose: read straight
    into its transposed home). Read like from_pretrained reads it."""
    from transformers import conversion_mapping
    from transformers.core_model_loading import Chunk, Transpose, WeightConverter

    conversion_mapping.get_checkpoint_conversion_mapping("llama")  # the cache exists
    rules = [
        WeightConverter("self_attn.qkv_proj.weight", ["self_attn.q_proj.weight",
                        "self_attn.k_proj.weight", "self_attn.v_proj.weight"], [Chunk(dim=0)]),
        WeightConverter("mlp.down_proj.weight_t", "mlp.down_proj.weight", [Transpose(0, 1)]),
    ]  # fmt: skip
    monkeypatch.setitem(conversion_mapping._checkpoint_conversion_mapping_cache, "llama", rules)
    torch.manual_seed(0)
    host = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    state = {n: t.detach().clone() for n, t in host.state_dict().items()}
    for layer in range(LLAMA["num_hidden_layers"]):
        attn, mlp = f"model.layers.{layer}.self_attn.", f"model.layers.{layer}.mlp."
        state[attn + "qkv_proj.weight"] = torch.cat([state.pop(f"{attn}{x}_proj.weight")
                                                     for x in "qkv"])  # fmt: skip
        state[mlp + "down_proj.weight_t"] = state.pop(mlp + "down_proj.weight").t().contiguous()
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    host.config.save_pretrained(tmp_path)
    temporaries = []
    real = WeightSource.read

    def spy(self, name):
        temporaries.append(name)
        return real(self, name)

    monkeypatch.setattr(WeightSource, "read", spy)
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    dests, _ = read(meta, tmp_path)
    assert_state_equal(dests, host)
    assert sorted(temporaries) == sorted(n for n in state if n.endswith("qkv_proj.weight"))
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    assert_state_equal(dests, loaded)


def test_models_and_checkpoints_that_need_nothing_are_left_alone(tmp_path):
    save_file({"weight": torch.ones(2, 2), "bias": torch.ones(2)}, tmp_path / "a.safetensors")
    with WeightSource(tmp_path / "a.safetensors") as source:
        assert converted_source(nn.Linear(2, 2), source) is None  # no transformers model
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    llama.save_pretrained(tmp_path / "llama")
    with WeightSource(tmp_path / "llama") as source:
        assert converted_source(llama, source) is None  # its own names: read as they are
