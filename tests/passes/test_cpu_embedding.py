"""cpu_embedding: the lookup on the host, the matrix out of the chunks (untied models)."""

import pytest
import torch
from conftest import activation_budget, call, example, tiny_gpt, tokens

from fxstar.dump import dump
from fxstar.engine import compile
from fxstar.plan import Plan

VOCAB = 512  # large enough that the embedding is the largest parameter


def untied_llama(seed: int = 0):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        tie_word_embeddings=False, use_cache=False, bos_token_id=0, eos_token_id=0,
        pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, 16), generator=g), torch.randint(
        0, VOCAB, (2, 16), generator=g
    )


def test_smallest_chunk_size_shrinks_on_an_untied_model(capsys):
    """The smallest feasible chunk size is the largest parameter in the chunks: the embedding
    leaves them with cpu_embedding, and the (untied, as large) lm head shrinks when tiled."""
    ids, targets = batch()
    tiles = {"in_splits": 2, "out_splits": 2, "min_size": 4096}
    sizes = {}
    for label, options in (("neither", {}), ("cpu_embedding", {"cpu_embedding": True}),
                           ("cpu_embedding + tiled 2x2", {"cpu_embedding": True,
                                                          "tiled_linear": tiles})):  # fmt: skip
        plan = Plan(
            device_memory=activation_budget(untied_llama, 1.0, **example("llama", *batch())),
            **options,
        )
        engine = compile(untied_llama(), plan, **example("llama", ids, targets))
        layout = engine.chunks.layout
        sizes[label] = max(p.numel for c in layout.chunks for p in c.params)
    with capsys.disabled():
        print(f"\nsmallest feasible chunk size, untied Llama (vocab {VOCAB}, width 32): "
              + ", ".join(f"{k} {v:,}" for k, v in sizes.items()))  # fmt: skip
    assert sizes["neither"] == VOCAB * 32  # the embedding and the head
    assert sizes["cpu_embedding"] == VOCAB * 32  # the head alone
    assert sizes["cpu_embedding + tiled 2x2"] == VOCAB * 32 // 4


def test_untied_training_matches_eager_bitwise():
    eager, model = untied_llama(), untied_llama()
    plan = Plan(
        device_memory=activation_budget(untied_llama, 1.0, **example("llama", *batch())),
        cpu_embedding=True,
        optimizer={"lr": 1e-3},
    )
    engine = compile(model, plan, **example("llama", *batch()))
    assert engine.program.decisions.cpu_embedding.host == ["model.embed_tokens.weight"]
    assert "ops.to_host" in dump(engine) and "cpu_embedding=on the host" in dump(engine)
    ids, targets = batch()
    expected = call("llama", eager, ids, targets)
    expected.backward()
    loss = call("llama", engine, ids, targets)
    loss.backward()
    assert torch.equal(loss, expected)
    pairs = zip(eager.named_parameters(), engine.named_parameters(), strict=True)
    for (name, p), (_, q) in pairs:
        assert torch.equal(p.grad, q.grad), name
    before = model.model.embed_tokens.weight.detach().clone()
    assert engine.step()
    assert not torch.equal(before, model.model.embed_tokens.weight)  # updated on the host
    assert model.model.embed_tokens.weight.grad is None


def test_a_tied_embedding_stays_in_the_chunks_and_says_so():
    ids, targets = tokens()
    engine = compile(tiny_gpt(), Plan(device_memory="1MiB", cpu_embedding=True), (ids, targets))
    decision = engine.program.decisions.cpu_embedding
    assert (decision.host, decision.kept) == (["wpe.weight"], ["head.weight"])
    assert "cpu_embedding=kept in chunks: also read by" in dump(engine)
    assert "head.weight" in engine.chunks.layout.slots()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_keeps_the_host_embedding_as_its_fp32_master(precision):
    """The lookup reads the fp32 master on the host, the rows come back rounded; training
    follows the same run without cpu_embedding closely (only where rounding happens moves)."""
    runs = {}
    for cpu_embedding in (False, True):
        model = untied_llama()
        plan = Plan(precision=precision, cpu_embedding=cpu_embedding, optimizer={"lr": 1e-3})
        engine = compile(model, plan, **example("llama", *batch()))
        losses = []
        for step in range(5):
            ids, targets = batch(seed=step)
            loss = call("llama", engine, ids, targets)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        runs[cpu_embedding] = engine, model, losses
    engine, model, losses = runs[True]
    weight = model.model.embed_tokens.weight
    assert engine.program.decisions.cpu_embedding.host == ["model.embed_tokens.weight"]
    assert weight.dtype == torch.float32 and "model.embed_tokens.weight" not in (
        engine.chunks.layout.slots()
    )
    assert dict(engine.named_parameters())["model.embed_tokens.weight"] is weight
    assert f"torch.{COMPUTE[precision]}" in dump(engine)
    assert losses == pytest.approx(runs[False][2], rel=2e-2)
    assert not torch.equal(weight, untied_llama().model.embed_tokens.weight)  # trained
    torch.testing.assert_close(weight, runs[False][1].model.embed_tokens.weight, atol=2e-3,
                               rtol=0)  # fmt: skip


COMPUTE = {"bf16": "bfloat16", "fp16": "float16"}
