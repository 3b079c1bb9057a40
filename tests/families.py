"""transformers families as users have them: small sizes, everything else the config's default
(use_cache=True, dropout, biases, tied or untied heads). Built from configs in code, never
downloaded. Each entry makes (model, kwargs of one batch); the batch carries labels, so the
model returns its loss."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

VOCAB, BATCH, SEQ = 64, 2, 8
SMALL = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 4, "intermediate_size": 64}  # fmt: skip
IDS = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}


def _ids(seed: int, vocab: int = VOCAB, length: int = SEQ) -> torch.Tensor:
    return torch.randint(1, vocab, (BATCH, length), generator=torch.Generator().manual_seed(seed))


def _causal(config_name: str, model_name: str, **extra) -> Callable:
    def make(seed: int = 0):
        t = pytest.importorskip("transformers")
        config = getattr(t, config_name)(**{**SMALL, **IDS, **extra})
        torch.manual_seed(seed)
        return getattr(t, model_name)(config)

    return make


def _lm_batch(seed: int) -> dict:
    return {"input_ids": _ids(seed), "labels": _ids(seed + 1000)}


def _gpt2(seed: int = 0):
    t = pytest.importorskip("transformers")
    config = t.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                          bos_token_id=0, eos_token_id=0)  # fmt: skip
    torch.manual_seed(seed)
    return t.GPT2LMHeadModel(config)


def _t5(seed: int = 0):
    t = pytest.importorskip("transformers")
    config = t.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                        num_heads=4, decoder_start_token_id=0, **IDS)  # fmt: skip
    torch.manual_seed(seed)
    return t.T5ForConditionalGeneration(config)


def _bart(seed: int = 0):
    t = pytest.importorskip("transformers")
    config = t.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                          encoder_attention_heads=4, decoder_attention_heads=4,
                          encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
                          decoder_start_token_id=0, **IDS)  # fmt: skip
    torch.manual_seed(seed)
    return t.BartForConditionalGeneration(config)


def _vit(seed: int = 0):
    t = pytest.importorskip("transformers")
    config = t.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, image_size=16, patch_size=4,
                         num_labels=3)  # fmt: skip
    torch.manual_seed(seed)
    return t.ViTForImageClassification(config)


def _vit_batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(BATCH, 3, 16, 16, generator=g),
            "labels": torch.randint(0, 3, (BATCH,), generator=g)}  # fmt: skip


def _bert(seed: int = 0):
    t = pytest.importorskip("transformers")
    config = t.BertConfig(**SMALL, max_position_embeddings=32, pad_token_id=0)
    torch.manual_seed(seed)
    return t.BertForMaskedLM(config)


FAMILIES: dict[str, tuple[Callable, Callable[[int], dict]]] = {
    "gpt2": (_gpt2, _lm_batch),
    "llama": (
        _causal(
            "LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2, max_position_embeddings=32
        ),
        _lm_batch,
    ),  # fmt: skip
    "mixtral": (
        _causal(
            "MixtralConfig",
            "MixtralForCausalLM",
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=32,
        ),
        _lm_batch,
    ),  # fmt: skip
    "t5": (_t5, _lm_batch),
    "bart": (_bart, _lm_batch),
    "vit": (_vit, _vit_batch),
    "bert": (_bert, _lm_batch),
    "gpt_neox": (
        _causal("GPTNeoXConfig", "GPTNeoXForCausalLM", max_position_embeddings=32),
        _lm_batch,
    ),  # fmt: skip
    "opt": (
        _causal(
            "OPTConfig",
            "OPTForCausalLM",
            ffn_dim=64,
            word_embed_proj_dim=32,
            max_position_embeddings=32,
        ),
        _lm_batch,
    ),  # fmt: skip
    "qwen2": (
        _causal(
            "Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2, max_position_embeddings=32
        ),
        _lm_batch,
    ),  # fmt: skip
}


def _mamba(seed: int = 0):
    t = pytest.importorskip("transformers")
    config = t.MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, **IDS)
    torch.manual_seed(seed)
    return t.MambaForCausalLM(config)


MIXER_FAMILIES: dict[str, tuple[Callable, Callable[[int], dict]]] = {
    "olmo2": (  # RMSNorm on q and k over the whole projection, before the heads' view
        _causal("Olmo2Config", "Olmo2ForCausalLM", max_position_embeddings=32),
        _lm_batch,
    ),
    "cohere": (  # interleaved rotary by aten.stack; parallel attention and MLP; logit scale
        _causal("CohereConfig", "CohereForCausalLM", max_position_embeddings=32),
        _lm_batch,
    ),
    "deepseek_v3": (  # MLA: low-rank q and kv, a rotary part shared by the heads; MoE
        _causal(
            "DeepseekV3Config",
            "DeepseekV3ForCausalLM",
            max_position_embeddings=32,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=8,
            v_head_dim=8,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        ),
        _lm_batch,
    ),
    "mamba": (_mamba, _lm_batch),  # a selective state-space mixer, no attention
}
"""Families whose attention or mixer is unlike the ones above (small sizes, defaults
otherwise): kept apart from FAMILIES, which every family test runs through."""
