"""Models built on the meta device: compiled without their weights, which are written into the
chunk homes afterwards (from safetensors, or initialised there), and then train exactly like
the same model built on the host."""

import pytest
import torch
from conftest import call, example, hf_llama, tiny_gpt, tokens
from families import FAMILIES
from torch import nn

import fxstar
from fxstar.errors import UsageError
from fxstar.weights import WeightsError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _on_meta(factory):
    with torch.device("meta"):
        return factory()


def _train(kind, engine, ids, targets, steps=2, batch=None):
    """Losses, the first step's gradients, and the parameters and buffers after `steps` steps
    (dropout draws the same masks on both sides: each step is seeded)."""
    losses, grads = [], None
    for step in range(steps):
        torch.manual_seed(10 + step)
        loss = call(kind, engine, ids, targets) if batch is None else engine(**batch).loss
        loss.backward()
        if grads is None:
            grads = {n: None if g is None else g.clone() for n, g in engine.gradients().items()}
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    state = {n: t.detach().clone() for n, t in engine.model.state_dict().items()}
    return losses, grads, state


def _same(a, b):
    """Bitwise, NaN where NaN (fp16's first step overflows at the initial loss scale)."""
    assert a[0] == b[0]
    assert a[1].keys() == b[1].keys() and a[2].keys() == b[2].keys()
    for got, want in ((a[1], b[1]), (a[2], b[2])):
        for name in got:
            if got[name] is None or want[name] is None:  # frozen: no gradient on either side
                assert got[name] is want[name], name
                continue
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, equal_nan=True,
                                       msg=name)  # fmt: skip


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_gpt_from_safetensors_trains_bitwise_like_the_host_model(tmp_path, precision):
    from safetensors.torch import save_model

    host = tiny_gpt()
    save_model(host, str(tmp_path / "model.safetensors"))  # a tied head is stored once
    ids, targets = tokens()
    plan = fxstar.Plan(device_memory="auto", precision=precision,
                       optimizer={"lr": 1e-2})  # fmt: skip
    reference = _train("gpt", fxstar.compile(host, plan, (ids, targets)), ids, targets)
    meta = _on_meta(tiny_gpt)
    engine = fxstar.compile(meta, plan, (ids, targets), weights=tmp_path)
    assert "weights: read from" in engine.report()
    _same(_train("gpt", engine, ids, targets), reference)
    assert not any(p.is_meta for p in meta.parameters())
    assert meta.head.weight is meta.wte.weight  # still tied, now to its chunk home


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_transformers_sharded_checkpoint_into_a_meta_model(tmp_path, family):
    """transformers' default configs (use_cache, GPT-2's dropout, biases and tied head),
    5 steps with the chunks evicting, bitwise like the host-built model."""
    make, batch_of = FAMILIES[family]
    host = make()
    host.save_pretrained(tmp_path, max_shard_size="20KB")  # several shards and an index
    assert (tmp_path / "model.safetensors.index.json").exists()
    batch = batch_of(1)
    plan = fxstar.Plan(device_memory="auto", optimizer={"lr": 1e-2})
    reference = _train(family, fxstar.compile(host, plan, example_kwargs=batch), None, None,
                       steps=5, batch=batch)  # fmt: skip
    meta = _on_meta(make)
    engine = fxstar.compile(meta, plan, example_kwargs=batch, weights=tmp_path)
    if family == "llama":  # not in the checkpoint: computed again by transformers' init
        torch.testing.assert_close(meta.model.rotary_emb.inv_freq,
                                   host.model.rotary_emb.inv_freq, rtol=0, atol=0)  # fmt: skip
    _same(_train(family, engine, None, None, steps=5, batch=batch), reference)
    assert engine.chunks.stats.evictions > 0


def _mlp_with_batchnorm():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))


def test_init_writes_each_modules_reset_parameters_into_the_chunk_homes():
    host = _mlp_with_batchnorm()  # built on the host: reset_parameters drew in module order
    meta = _on_meta(_mlp_with_batchnorm)
    x = torch.randn(8, 16)
    plan = fxstar.Plan(device_memory="auto", loss_fn=nn.functional.cross_entropy)
    targets = torch.randint(0, 4, (8,))
    torch.manual_seed(0)  # the seed the host construction drew under
    engine = fxstar.compile(meta, plan, (x, targets), weights="init")
    for (name, got), want in zip(meta.state_dict().items(), host.state_dict().values(),
                                 strict=True):  # fmt: skip
        assert torch.equal(got, want), name
    assert "initialised in their chunk homes by reset_parameters" in engine.report()
    loss = engine(x, targets)
    loss.backward()
    engine.step()
    assert torch.isfinite(loss)
    assert not torch.equal(meta[1].running_mean, host[1].running_mean)  # BatchNorm trained


def test_what_a_meta_model_needs_is_said_by_name(tmp_path):
    ids, targets = tokens()
    with pytest.raises(UsageError, match="meta device.*weights="):
        fxstar.compile(_on_meta(tiny_gpt), fxstar.Plan(device_memory="auto"), (ids, targets))
    with pytest.raises(UsageError, match="set plan.device_memory"):
        fxstar.compile(_on_meta(tiny_gpt), fxstar.Plan(), (ids, targets), weights="init")
    with pytest.raises(UsageError, match="plan.verify.*not supported yet"):
        fxstar.compile(_on_meta(tiny_gpt), fxstar.Plan(device_memory="auto", verify=True),
                       (ids, targets), weights="init")  # fmt: skip
    with pytest.raises(UsageError, match="has them already"):
        fxstar.compile(tiny_gpt(), fxstar.Plan(), (ids, targets), weights="init")
    from safetensors.torch import save_file

    state = {n: t for n, t in tiny_gpt().state_dict().items() if n != "h.1.mlp.c_fc.bias"}
    state.pop("head.weight")  # tied: stored once
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightsError, match="h.1.mlp.c_fc.bias"):
        fxstar.compile(_on_meta(tiny_gpt), fxstar.Plan(device_memory="auto"), (ids, targets),
                       weights=tmp_path)  # fmt: skip


def test_the_compute_device_is_a_plan_option():
    from fxstar.plan import PlanError, resolve_device

    ids, targets = tokens()
    with pytest.raises(PlanError, match="device: must be 'auto', 'cpu', 'cuda' or 'cuda:N'"):
        fxstar.Plan(device="gpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(PlanError, match=f"'cuda:{count}' does not exist here"):
        fxstar.compile(tiny_gpt(), fxstar.Plan(device=f"cuda:{count}"), (ids, targets))
    assert fxstar.Plan.from_dict(fxstar.Plan(device="cuda:1").to_dict()).device == "cuda:1"
    if count == 0:
        assert resolve_device(fxstar.Plan()) is None  # 'auto' on a CPU-only machine: the host
    # an explicit device: inputs go there, a meta model's buffers get storage there, and
    # training follows the host model bit for bit
    plan = fxstar.Plan(device="cpu", device_memory="auto", optimizer={"lr": 1e-2})
    reference = _train("gpt", fxstar.compile(tiny_gpt(), plan, (ids, targets)), ids, targets)
    engine = fxstar.compile(tiny_gpt(), plan, (ids, targets))
    assert engine.device == torch.device("cpu")
    _same(_train("gpt", engine, ids, targets), reference)


def test_a_sharded_checkpoint_is_read_straight_into_the_chunk_homes(tmp_path, monkeypatch):
    """No second copy of the model on the host: every tensor of the shards is read into the
    chunk home of its parameter (the destination shares the homes' memory), never into a
    tensor of its own; only what the homes do not hold (buffers) goes elsewhere."""
    from fxstar.weights import WeightSource

    host = hf_llama()
    host.save_pretrained(tmp_path, max_shard_size="20KB")
    ids, targets = tokens()
    destinations = []
    real = WeightSource.read_into

    def read_into(self, name, out):
        destinations.append((name, out))
        return real(self, name, out)

    monkeypatch.setattr(WeightSource, "read_into", read_into)
    engine = fxstar.compile(_on_meta(hf_llama), fxstar.Plan(device_memory="auto"),
                            **example("llama", ids, targets), weights=tmp_path)  # fmt: skip
    homes = [c.payload for c in engine.chunks.chunks]
    spans = [(h.data_ptr(), h.data_ptr() + h.nbytes) for h in homes]
    params = {n for n, _ in host.named_parameters()}
    read = {name for name, _ in destinations}
    assert params <= read | {"lm_head.weight"}  # tied: stored under the embedding's name
    for name, out in destinations:
        if name in params:
            assert any(a <= out.data_ptr() < b for a, b in spans), f"{name} read elsewhere"


def test_an_init_function_runs_after_every_modules_own_reset():
    """weights=<function of one module>, like nanoGPT's _init_weights, which touches linears
    and embeddings only: the layer norms still get their reset (ones), as in construction."""
    meta = _on_meta(tiny_gpt)
    ids, targets = tokens()
    engine = fxstar.compile(meta, fxstar.Plan(device_memory="auto"), (ids, targets),
                            weights=meta._init_weights)  # fmt: skip
    assert torch.equal(meta.ln_f.weight, torch.ones_like(meta.ln_f.weight))
    assert float(meta.h[0].mlp.c_fc.weight.std()) == pytest.approx(0.02, rel=0.2)  # its init
    assert "initialised in their chunk homes by GPT._init_weights" in engine.report()
    loss = engine(ids, targets)
    loss.backward()
    engine.step()
    assert torch.isfinite(loss)


class _FrozenStem(nn.Module):
    """A frozen part run under no_grad, then BatchNorm (buffers that train) and a head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(16, 32).requires_grad_(False)
        self.bn = nn.BatchNorm1d(32)
        self.head = nn.Linear(32, 4)

    def forward(self, x, y):
        with torch.no_grad():
            h = self.stem(x)
        return nn.functional.cross_entropy(self.head(torch.relu(self.bn(h))), y)


def test_a_frozen_part_and_batchnorm_from_safetensors_train_like_the_host_model(tmp_path):
    from safetensors.torch import save_model

    host = _FrozenStem()
    with torch.no_grad():
        host.bn.running_mean.uniform_(-1, 1)  # a checkpoint's statistics, not the defaults
    save_model(host, str(tmp_path / "model.safetensors"))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    plan = fxstar.Plan(device_memory="auto", optimizer={"lr": 1e-2})
    reference = _train("gpt", fxstar.compile(host, plan, (x, y)), x, y, steps=3)
    meta = _on_meta(_FrozenStem)
    _same(_train("gpt", fxstar.compile(meta, plan, (x, y), weights=tmp_path), x, y, steps=3),
          reference)  # fmt: skip
    assert not meta.stem.weight.requires_grad  # still frozen
    assert "bn.running_mean" in reference[2] and "bn.num_batches_tracked" in reference[2]


@pytest.mark.parametrize(
    "option",
    [{"verify": True}, {"tiled_linear": {"in_splits": 2}}, {"tensor_parallel": {"size": 2}}],
)
def test_features_not_built_for_meta_models_are_refused_by_name(option):
    """Each refusal names the option and the remedy (build the model on the host)."""
    (name,) = option
    plan = fxstar.Plan(device_memory="auto", **option)
    with pytest.raises(UsageError, match=rf"plan\.{name}: not supported yet.*on the host"):
        fxstar.compile(_on_meta(tiny_gpt), plan, tokens(), weights="init")


# -- transformers families whose checkpoints or buffers are unlike the model's -------------------


def _hf(config_name, model_name, **sizes):
    """A transformers model at its defaults but for small sizes (one layer, 4 heads)."""

    def make(seed=0):
        t = pytest.importorskip("transformers")
        small = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                 "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "max_position_embeddings": 32}  # fmt: skip
        config = getattr(t, config_name)(**{**small, **sizes})
        torch.manual_seed(seed)
        return getattr(t, model_name)(config)

    return make


def _clip(seed=0):
    t = pytest.importorskip("transformers")
    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
             "num_attention_heads": 4}  # fmt: skip
    config = t.CLIPConfig(
        text_config={**sizes, "vocab_size": 64, "max_position_embeddings": 16,
                     "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1},
        vision_config={**sizes, "image_size": 16, "patch_size": 8},
        projection_dim=16,
    )  # fmt: skip
    torch.manual_seed(seed)
    return t.CLIPModel(config)


def _lm_batch():
    g = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(2, 64, (2, 8), generator=g),
            "labels": torch.randint(2, 64, (2, 8), generator=g)}  # fmt: skip


def _clip_batch():
    g = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(2, 64, (2, 8), generator=g), "return_loss": True,
            "pixel_values": torch.randn(2, 3, 16, 16, generator=g)}  # fmt: skip


META_FAMILIES = {
    # experts stored one by one (experts.N.gate_proj.weight), held fused (experts.gate_up_proj)
    "qwen2_moe": (_hf("Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=16,
                      shared_expert_intermediate_size=32), _lm_batch),
    # and renamed: block_sparse_moe.experts.N.w1 -> mlp.experts.gate_up_proj
    "mixtral": (_hf("MixtralConfig", "MixtralForCausalLM", num_local_experts=4,
                    num_experts_per_tok=2), _lm_batch),
    # a non-persistent buffer beside a parameter: the embedding's embed_scale
    "gemma3": (_hf("Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=8), _lm_batch),
    # position_ids beside the vision embeddings' class_embedding, and the text's
    "clip": (_clip, _clip_batch),
}  # fmt: skip


@pytest.mark.parametrize("family", list(META_FAMILIES))
def test_families_built_on_meta_read_their_own_checkpoint_and_train_like_the_host(
    tmp_path, family, monkeypatch
):
    """save_pretrained's layout read by transformers' own rules (MoE experts into their fused
    homes, straight from the files) and non-persistent buffers computed by transformers' init
    with no parameter touched: loss, gradients, parameters and buffers bitwise like the host
    model's, with the chunks paging."""
    from fxstar.weights import WeightSource

    make, batch_of = META_FAMILIES[family]
    host = make()
    host.save_pretrained(tmp_path)
    batch = batch_of()
    plan = fxstar.Plan(device_memory="auto", optimizer={"lr": 1e-2})
    reference = _train(family, fxstar.compile(host, plan, example_kwargs=batch), None, None,
                       batch=batch)  # fmt: skip
    reads = []
    real = WeightSource.read_into
    monkeypatch.setattr(
        WeightSource,
        "read_into",
        lambda self, name, out: reads.append((name, out)) or real(self, name, out),
    )
    meta = _on_meta(make)
    engine = fxstar.compile(meta, plan, example_kwargs=batch, weights=tmp_path)
    host_buffers = dict(make().named_buffers())  # before training: none of them trains
    for name, buffer in meta.named_buffers():
        assert torch.equal(buffer, host_buffers[name]), name
    _same(_train(family, engine, None, None, batch=batch), reference)
    assert engine.chunks.stats.evictions > 0
    homes = [
        (c.payload.data_ptr(), c.payload.data_ptr() + c.payload.nbytes)
        for c in engine.chunks.chunks
    ]
    experts = [(n, out) for n, out in reads if ".experts." in n]
    assert bool(experts) == (family in ("qwen2_moe", "mixtral"))
    for name, out in experts:  # straight into its rows of the fused chunk home
        assert any(a <= out.data_ptr() < b for a, b in homes), name


def test_buffers_are_computed_without_touching_a_parameter(monkeypatch):
    """transformers' init runs on meta stand-ins of every parameter: one that writes straight
    into a weight (not through transformers' guarded init functions) writes into nothing, one
    that puts a tensor of its own in a buffer's place is read from there, and the random state
    is as it was."""
    from fxstar.placement import compute_buffers

    model = META_FAMILIES["gemma3"][0]()
    name = "model.embed_tokens.embed_scale"
    expected = model.model.embed_tokens.embed_scale.clone()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.model.embed_tokens.embed_scale.zero_()
    original = type(model)._init_weights

    def hostile(self, module):
        if isinstance(module, nn.Embedding):
            module.weight.data.fill_(7.0)
            module.embed_scale = torch.tensor(module.scalar_embed_scale)  # replaced, not written
            return
        original(self, module)

    monkeypatch.setattr(type(model), "_init_weights", hostile)
    state = torch.get_rng_state()
    compute_buffers(model, [name])
    assert torch.equal(model.model.embed_tokens.embed_scale, expected)
    assert torch.equal(torch.get_rng_state(), state)
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n]), n
        assert not p.is_meta and not hasattr(p, "_is_hf_initialized"), n


class _Masked(nn.Module):
    """A non-persistent buffer made in the constructor: on meta, nothing can compute it."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(64, 64)
        self.inner.register_buffer("mask", torch.ones(64), persistent=False)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.inner(x) * self.inner.mask, y)


def test_a_buffer_nothing_computes_is_refused_by_its_full_name(tmp_path):
    from safetensors.torch import save_model

    from fxstar.placement import compute_buffers

    save_model(_Masked(), str(tmp_path / "model.safetensors"))
    x, y = torch.randn(2, 64), torch.randn(2, 64)
    with pytest.raises(UsageError, match=r"buffers inner\.mask are not persistent.*device='cpu'"):
        fxstar.compile(_on_meta(_Masked), fxstar.Plan(device_memory="auto"), (x, y),
                       weights=tmp_path)  # fmt: skip
    # a transformers model whose init computes one buffer but not the other
    meta = _on_meta(META_FAMILIES["gemma3"][0])
    meta.model.layers[0].mlp.register_buffer("scale", torch.ones(3), persistent=False)
    with pytest.raises(UsageError) as err:
        compute_buffers(meta, ["model.embed_tokens.embed_scale", "model.layers.0.mlp.scale"])
    text = str(err.value)
    assert "buffers model.layers.0.mlp.scale are not persistent" in text
    assert "Gemma3ForCausalLM's init (_init_weights) does not compute them" in text
    assert "embed_scale" not in text and "device='cpu'" in text


def test_an_init_gets_the_buffers_computed_or_must_write_them():
    """weights=<function> on a transformers model: its non-persistent buffers are computed as
    for a checkpoint (rotary frequencies, not zeros); on another model a buffer the init
    leaves alone would hold zeros, not its constructor's value, and is refused by name."""
    ids, targets = tokens()
    host, meta = hf_llama(), _on_meta(hf_llama)
    fxstar.compile(meta, fxstar.Plan(device_memory="auto"), **example("llama", ids, targets),
                   weights=lambda module: None)  # fmt: skip
    assert torch.equal(meta.model.rotary_emb.inv_freq, host.model.rotary_emb.inv_freq)
    x, y = torch.randn(2, 64), torch.randn(2, 64)
    plan = fxstar.Plan(device_memory="auto")
    with pytest.raises(UsageError, match=r"buffers inner\.mask were built on the meta device "
                       r"and the init \(reset_parameters\) did not write them"):  # fmt: skip
        fxstar.compile(_on_meta(_Masked), plan, (x, y), weights="init")

    def init(module):
        if isinstance(module, nn.Linear) and hasattr(module, "mask"):
            module.mask.fill_(1.0)

    meta = _on_meta(_Masked)
    fxstar.compile(meta, plan, (x, y), weights=init)
    assert torch.equal(meta.inner.mask, torch.ones(64))
