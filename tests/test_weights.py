"""fxstar.weights: safetensors read tensor by tensor into given homes; meta models bound to
their homes and initialised there."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from fxstar import weights
from fxstar.errors import FxstarError
from fxstar.testing.peak_rss import peak_rss, reset_peak_rss, rss
from fxstar.weights import (
    WeightsError,
    WeightSource,
    bind,
    initialize,
    materialize,
    tied_names,
)

LLAMA = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True,
)  # fmt: skip


def homes(shapes: dict[str, tuple[torch.Size, torch.dtype]]) -> dict[str, torch.Tensor]:
    """Destinations as views into one flat buffer per dtype, the way chunk homes are."""
    out, flats = {}, {}
    for dtype in {d for _, d in shapes.values()}:
        n = sum(s.numel() for s, d in shapes.values() if d == dtype)
        flats[dtype] = [torch.full((n,), float("nan")).to(dtype), 0]
    for name, (shape, dtype) in shapes.items():
        flat, offset = flats[dtype]
        out[name] = flat[offset : offset + shape.numel()].view(shape)
        flats[dtype][1] += shape.numel()
    return out


def param_homes(module: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    return homes({n: (p.shape, dtype or p.dtype) for n, p in module.named_parameters()})


# -- one file ------------------------------------------------------------------------------------

TENSORS = {
    "f32": torch.randn(3, 4),
    "bf16": torch.randn(5).bfloat16(),
    "f16": torch.randn(2, 2).half(),
    "f64": torch.tensor(3.5, dtype=torch.float64),  # a scalar
    "i64": torch.arange(6).view(2, 3),
    "u8": torch.arange(7, dtype=torch.uint8),
    "bool": torch.tensor([True, False, True]),
    "empty": torch.randn(0, 3),
}


@pytest.fixture
def one_file(tmp_path: Path) -> Path:
    path = tmp_path / "w.safetensors"
    save_file(TENSORS, path)
    return path


def test_shapes_dtypes_and_values_match_safetensors(one_file: Path) -> None:
    with WeightSource(one_file) as src, safe_open(one_file, "pt") as f:
        assert sorted(src.names()) == sorted(f.keys())
        for name in src.names():
            piece = f.get_slice(name)
            assert list(src.shape(name)) == piece.get_shape()
            assert src.dtype(name) == TENSORS[name].dtype
            out = torch.empty(src.shape(name), dtype=src.dtype(name))
            src.read_into(name, out)
            assert torch.equal(out, TENSORS[name]), name
        assert torch.equal(src.read("i64"), TENSORS["i64"])


def test_casts_both_ways_and_in_pieces(one_file: Path, monkeypatch) -> None:
    with WeightSource(one_file) as src:
        low = torch.empty(3, 4, dtype=torch.bfloat16)
        src.read_into("f32", low)
        assert torch.equal(low, TENSORS["f32"].bfloat16())  # round to nearest even, as .to()
        high = torch.empty(5)
        src.read_into("bf16", high)
        assert torch.equal(high, TENSORS["bf16"].float())
        monkeypatch.setattr(weights, "SCRATCH", 8)  # two elements at a time
        src._scratch = None
        low.fill_(0)
        src.read_into("f32", low)
        assert torch.equal(low, TENSORS["f32"].bfloat16())


def test_strided_and_parameter_destinations(one_file: Path) -> None:
    with WeightSource(one_file) as src:
        out = torch.empty(4, 3).t()  # not contiguous
        src.read_into("f32", out)
        assert torch.equal(out, TENSORS["f32"])
        param = nn.Parameter(torch.empty(3, 4))  # requires grad: written without autograd
        src.read_into("f32", param)
        assert torch.equal(param.detach(), TENSORS["f32"]) and param.grad_fn is None


def test_wrong_shape_or_kind_names_tensor_file_and_shapes(one_file: Path) -> None:
    with WeightSource(one_file) as src:
        with pytest.raises(WeightsError) as err:
            src.read_into("f32", torch.empty(4, 3))
        assert all(s in str(err.value) for s in ("'f32'", str(one_file), "[3, 4]", "[4, 3]"))
        assert isinstance(err.value, FxstarError)
        with pytest.raises(WeightsError, match="'i64'.*int64.*float32"):
            src.read_into("i64", torch.empty(2, 3))
        with pytest.raises(WeightsError, match="'f32': its destination is on the meta device"):
            src.read_into("f32", torch.empty(3, 4, device="meta"))
        with pytest.raises(WeightsError, match="'f3' is not in .*close: f32"):
            src.shape("f3")


def test_damaged_files_are_named(tmp_path: Path, one_file: Path) -> None:
    data = one_file.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:-4])
    with pytest.raises(WeightsError, match="damaged or truncated"):
        WeightSource(cut)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file at all")
    with pytest.raises(WeightsError, match="junk.safetensors is not a safetensors file"):
        WeightSource(junk)
    with pytest.raises(WeightsError, match="no such file"):
        WeightSource(tmp_path / "absent.safetensors")


# -- directories ---------------------------------------------------------------------------------


def test_directory_layouts(tmp_path: Path) -> None:
    a, b = {"x": torch.ones(2)}, {"y": torch.zeros(3)}
    single = tmp_path / "single"
    single.mkdir()
    save_file(a, single / "model.safetensors")
    save_file(b, single / "training.safetensors")  # an fxstar checkpoint: not model weights
    assert WeightSource(single).names() == ["x"]

    several = tmp_path / "several"
    several.mkdir()
    save_file(a, several / "part1.safetensors")
    save_file(b, several / "part2.safetensors")
    assert sorted(WeightSource(several).names()) == ["x", "y"]

    save_file({"x": torch.ones(1)}, several / "part3.safetensors")
    with pytest.raises(WeightsError, match="'x' is in both .*part1.* and .*part3"):
        WeightSource(several)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(WeightsError, match="holds no .safetensors file"):
        WeightSource(empty)


def test_index_is_checked(tmp_path: Path) -> None:
    save_file({"x": torch.ones(2)}, tmp_path / "s1.safetensors")
    index = tmp_path / weights.INDEX
    index.write_text(json.dumps({"weight_map": {"x": "../s1.safetensors"}}))
    with pytest.raises(WeightsError, match="not a file in"):
        WeightSource(tmp_path)
    index.write_text(json.dumps({"weight_map": {"x": "s1.safetensors", "z": "s1.safetensors"}}))
    with pytest.raises(WeightsError, match="puts 'z' in s1.safetensors, which does not hold it"):
        WeightSource(tmp_path)
    index.write_text(json.dumps({"weight_map": {"x": "s2.safetensors"}}))
    with pytest.raises(WeightsError, match="not there.*s2.safetensors"):
        WeightSource(tmp_path)
    index.write_text("{}")
    with pytest.raises(WeightsError, match="not a transformers index"):
        WeightSource(tmp_path)


def _hub_snapshot(root: Path, shards: dict[str, dict[str, torch.Tensor]]) -> Path:
    """A Hugging Face hub cache repository as huggingface_hub lays it out: the files in
    blobs/<hash>, each snapshot's names symbolic links into ../../blobs."""
    repo = root / "hub" / "models--org--tiny"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    index = {"metadata": {}, "weight_map": {n: f for f, ts in shards.items() for n in ts}}
    files = {f: None for f in shards} | {weights.INDEX: json.dumps(index)}
    for i, (name, content) in enumerate(files.items()):
        blob = blobs / f"{i:040x}"
        if content is None:
            save_file(shards[name], blob)
        else:
            blob.write_text(content)
        (snapshot / name).symlink_to(Path("..", "..", "blobs", blob.name))
    return snapshot


def test_a_hub_cache_snapshot_loads(tmp_path: Path) -> None:
    shards = {"model-00001-of-00002.safetensors": {"a": torch.randn(3, 2)},
              "model-00002-of-00002.safetensors": {"b": torch.arange(4)}}  # fmt: skip
    snapshot = _hub_snapshot(tmp_path, shards)
    with WeightSource(snapshot) as source:
        assert sorted(source.names()) == ["a", "b"]
        assert torch.equal(source.read("a"), shards["model-00001-of-00002.safetensors"]["a"])
        assert torch.equal(source.read("b"), shards["model-00002-of-00002.safetensors"]["b"])


def test_links_and_names_leading_out_of_a_hub_snapshot_are_refused(tmp_path: Path) -> None:
    shards = {"model-00001-of-00001.safetensors": {"a": torch.randn(3, 2)}}
    snapshot = _hub_snapshot(tmp_path, shards)
    index = snapshot / weights.INDEX
    blob = (snapshot / "model-00001-of-00001.safetensors").resolve()
    # a name with a directory part, even one leading to the right blob
    index.unlink()
    index.write_text(json.dumps({"weight_map": {"a": f"../../blobs/{blob.name}"}}))
    with pytest.raises(WeightsError, match="not a file in"):
        WeightSource(snapshot)
    # a link out of the repository's blobs
    save_file(shards["model-00001-of-00001.safetensors"], tmp_path / "outside.safetensors")
    (snapshot / "evil.safetensors").symlink_to(tmp_path / "outside.safetensors")
    index.write_text(json.dumps({"weight_map": {"a": "evil.safetensors"}}))
    with pytest.raises(WeightsError, match="evil.safetensors.*not a file in"):
        WeightSource(snapshot)
    # the same layout outside a hub cache repository: links into a sibling blobs/ are refused
    plain = tmp_path / "plain"
    (plain / "blobs").mkdir(parents=True)
    (plain / "snap").mkdir()
    save_file(shards["model-00001-of-00001.safetensors"], plain / "blobs" / "x")
    (plain / "snap" / "w.safetensors").symlink_to(Path("..", "blobs", "x"))
    (plain / "snap" / weights.INDEX).write_text(json.dumps({"weight_map": {"a": "w.safetensors"}}))
    with pytest.raises(WeightsError, match="not a file in"):
        WeightSource(plain / "snap")


@pytest.mark.parametrize(
    "header",
    [
        b"[" * 50_000 + b"]" * 50_000,  # nested past json's recursion
        json.dumps({"__metadata__": [1, 2]}).encode(),
        json.dumps({"__metadata__": {weights.ALIASES_KEY: "[" * 50_000}}).encode(),
        json.dumps({"__metadata__": {weights.ALIASES_KEY: "[1, 2]"}}).encode(),
    ],
    ids=["deep", "metadata a list", "aliases deep", "aliases a list"],
)
def test_a_hostile_header_is_an_error_naming_the_file(header: bytes, tmp_path: Path) -> None:
    file = tmp_path / "w.safetensors"
    file.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(WeightsError) as err:
        WeightSource(file)
    assert str(file) in str(err.value)


# -- materialize ---------------------------------------------------------------------------------


def test_every_missing_name_and_bad_shape_in_one_error(one_file: Path) -> None:
    dests = {"f32x": torch.empty(3, 4), "bf16": torch.empty(6), "nothing_like_it": torch.empty(1)}
    dests.update({n: torch.zeros_like(t) for n, t in TENSORS.items() if n not in ("f32", "bf16")})
    with pytest.raises(WeightsError) as err:
        materialize(dests, one_file)
    text = str(err.value)
    assert "2 of 9 tensors are not in" in text
    assert "f32x  (close: f32" in text and "nothing_like_it" in text
    assert "'bf16' in" in text and "[5]" in text and "[6]" in text
    assert "1 tensors of" in text and "f32\n" in text  # the unexpected one, strict
    assert not dests["i64"].any()  # nothing was read


def test_unexpected_tensors_warn_when_not_strict(one_file: Path) -> None:
    dests = {"f32": torch.empty(3, 4), "i64": torch.empty(2, 3, dtype=torch.int64)}
    with pytest.warns(UserWarning, match="6 tensors .* belong to no destination"):
        report = materialize(dests, one_file, strict=False)
    assert sorted(report.unexpected) == sorted(set(TENSORS) - {"f32", "i64"})
    assert report.tensors == 2 and report.bytes == 12 * 4 + 6 * 8
    assert torch.equal(dests["f32"], TENSORS["f32"])


def test_aliases_and_tied_destinations(tmp_path: Path) -> None:
    path = tmp_path / "tied.safetensors"
    emb = torch.randn(4, 2)
    save_file({"emb.weight": emb}, path)
    home = torch.empty(4, 2)
    dests = {"emb.weight": home, "head.weight": home.view(4, 2)}  # one tensor, two names
    report = materialize(dests, path, aliases={"head.weight": ["emb.weight"]})
    assert report.tensors == 1 and report.read_as == {"head.weight": "emb.weight"}
    assert torch.equal(home, emb)
    only_head = {"head.weight": torch.empty(4, 2)}
    materialize(only_head, path, aliases={"emb.weight": ["head.weight"]})  # either direction
    assert torch.equal(only_head["head.weight"], emb)


def test_fxstar_checkpoint_aliases_are_honoured(tmp_path: Path) -> None:
    emb = torch.randn(4, 2)
    meta = {weights.ALIASES_KEY: json.dumps({"head.weight": "emb.weight"})}
    save_file({"emb.weight": emb}, tmp_path / "model.safetensors", metadata=meta)
    dests = {"emb.weight": torch.empty(4, 2), "head.weight": torch.empty(4, 2)}
    materialize(dests, tmp_path)
    assert torch.equal(dests["head.weight"], emb) and torch.equal(dests["emb.weight"], emb)


def test_progress_bar(one_file: Path, capsys) -> None:
    dests = {n: torch.empty_like(t) for n, t in TENSORS.items()}
    materialize(dests, one_file)  # small and not a terminal: quiet
    assert capsys.readouterr().err == ""
    report = materialize(dests, one_file, progress=True)
    assert "weights" in capsys.readouterr().err
    assert "tensors" in str(report) and report.gb_per_s > 0


# -- transformers checkpoints --------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory) -> tuple[nn.Module, Path]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    directory = tmp_path_factory.mktemp("llama")
    model.save_pretrained(directory, max_shard_size="100KB")
    return model, directory


def meta_llama() -> nn.Module:
    import transformers

    with torch.device("meta"):
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))


def test_transformers_sharded_checkpoint(llama_checkpoint) -> None:
    model, directory = llama_checkpoint
    shards = sorted(directory.glob("*.safetensors"))
    assert (directory / weights.INDEX).is_file() and len(shards) > 2
    src = WeightSource(directory)
    assert "lm_head.weight" not in src  # stored once, under the embedding's name
    meta = meta_llama()
    dests = param_homes(meta)  # named_parameters: the tied head's name is left out
    dests["lm_head.weight"] = dests["model.embed_tokens.weight"]
    with src:
        report = materialize(dests, src, aliases=tied_names(meta))
    assert report.tensors == len(src) and report.read_as == {
        "lm_head.weight": "model.embed_tokens.weight"
    }
    assert report.bytes == sum(p.numel() * 4 for p in model.parameters())
    for name, value in model.state_dict().items():
        if name in dests:
            assert torch.equal(dests[name], value), name
    low = param_homes(meta, torch.bfloat16)
    assert materialize(low, directory, aliases=tied_names(meta)).cast == list(low)
    assert torch.equal(low["model.norm.weight"], model.model.norm.weight.detach().bfloat16())


def test_wrong_prefix_lists_every_name_with_its_close_match(llama_checkpoint, monkeypatch) -> None:
    _, directory = llama_checkpoint
    monkeypatch.setattr(weights, "LISTED", 5)
    meta = meta_llama()
    dests = {f"llama.{n}": t for n, t in param_homes(meta.model).items()}
    with pytest.raises(WeightsError) as err:
        materialize(dests, directory)
    text = str(err.value)
    assert f"{len(dests)} of {len(dests)} tensors are not in" in text
    assert "llama.embed_tokens.weight  (close: model.embed_tokens.weight" in text
    assert "... and" in text  # long lists are cut


def test_meta_llama_loads_through_its_homes(llama_checkpoint) -> None:
    """The whole path: meta model -> homes -> bind/init (buffers) -> read -> same logits."""
    model, directory = llama_checkpoint
    meta = meta_llama()
    shapes = {n: (p.shape, p.dtype) for n, p in meta.named_parameters()}
    shapes.update({n: (b.shape, b.dtype) for n, b in meta.named_buffers()})
    dests = homes(shapes)
    # rotary inv_freq is a buffer computed in __init__ (lost on meta) and not in the
    # checkpoint: transformers' init recomputes it in its home
    assert initialize(meta, dests).meta_buffers == []
    params = {n: dests[n] for n, _ in meta.named_parameters()}
    materialize(params, directory, aliases=tied_names(meta))
    assert meta.lm_head.weight is meta.model.embed_tokens.weight
    assert meta.lm_head.weight.data_ptr() == dests["model.embed_tokens.weight"].data_ptr()
    idx = torch.randint(0, LLAMA["vocab_size"], (2, 8))
    with torch.no_grad():
        assert torch.equal(meta(idx).logits, model(idx).logits)


# -- initialise in place -------------------------------------------------------------------------


def plain() -> nn.Module:
    return nn.Sequential(
        nn.Embedding(50, 16), nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(),
        nn.Linear(32, 8, bias=False), nn.RMSNorm(8), nn.Conv1d(8, 4, 3),
    )  # fmt: skip


def test_reset_parameters_on_meta_equals_cpu_bit_for_bit() -> None:
    torch.manual_seed(0)
    cpu = plain()
    with torch.device("meta"):
        meta = plain()
    dests = param_homes(meta)
    before = {n: p for n, p in meta.named_parameters()}
    torch.manual_seed(0)
    report = initialize(meta, dests)
    assert report.init == "reset_parameters" and report.modules == ["0", "1", "2", "4", "5", "6"]
    for (name, want), (_, got) in zip(cpu.named_parameters(), meta.named_parameters()):
        assert got is before[name]  # the same Parameter object, now holding real storage
        assert got.data_ptr() == dests[name].data_ptr(), name
        assert torch.equal(got, want), name


def test_fxstar_gpt_matches_cpu_when_construction_is_replayed() -> None:
    """nanoGPT draws twice on the CPU (each layer's reset_parameters, then _init_weights):
    replaying both, in that order, gives its CPU values exactly."""
    import math

    from fxstar.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(0)
    cpu = GPT(cfg)
    with torch.device("meta"):
        meta = GPT(cfg)
    torch.manual_seed(0)
    initialize(meta, param_homes(meta))  # construction's draws (into the homes)
    initialize(meta, {}, init=meta._init_weights)  # __init__'s self.apply(self._init_weights)
    with torch.no_grad():
        for name, p in meta.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))
    assert meta.head.weight is meta.wte.weight
    for (name, want), got in zip(cpu.named_parameters(), meta.parameters()):
        assert torch.equal(got, want), name


def test_transformers_init_in_place() -> None:
    """A meta Llama initialised in its homes equals transformers' own re-initialisation of
    the CPU model with the same seed (not the CPU construction itself: that draws torch's
    default init first, then transformers' own)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(1)
    cpu = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    for mod in cpu.modules():
        mod.__dict__.pop("_is_hf_initialized", None)
    torch.manual_seed(0)
    cpu.initialize_weights()
    meta = meta_llama()
    dests = homes({n: (b.shape, b.dtype) for n, b in meta.named_buffers()})
    dests.update(param_homes(meta))
    torch.manual_seed(0)
    report = initialize(meta, dests)
    assert report.init == "transformers" and report.meta_buffers == []
    assert meta.lm_head.weight is meta.model.embed_tokens.weight
    for name, want in cpu.state_dict().items():
        assert torch.equal(meta.state_dict()[name], want), name


def test_init_callable_runs_children_first() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 3)))
    seen = []

    def init(module: nn.Module) -> None:
        seen.append(type(module).__name__)
        for p in module.parameters(recurse=False):
            p.fill_(len(seen))

    report = initialize(model, param_homes(model), init=init)
    assert seen == ["Linear", "Linear", "Sequential", "Sequential"]
    assert report.modules == ["0", "1.0", "1", ""]
    assert (model[1][0].weight == 2).all() and (model[0].bias == 1).all()


def test_initialize_errors() -> None:
    class Bare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))
            self.proj = nn.Linear(3, 3)

    with torch.device("meta"):
        model = Bare()
    dests = param_homes(model)
    with pytest.raises(WeightsError, match=r"(?s)no reset_parameters.*\(root\) \(Bare\)"):
        initialize(model, dests)
    assert model.scale.is_meta  # nothing was bound
    with pytest.raises(WeightsError, match="proj.weight .* has no destination"):
        initialize(model, {"scale": dests["scale"]}, init=lambda m: None)
    with pytest.raises(WeightsError, match=r"proj.wieght is no parameter.*close: proj.weight"):
        initialize(model, {**dests, "proj.wieght": torch.empty(1)}, init=lambda m: None)
    with pytest.raises(WeightsError, match=r"scale has shape \[3\], its destination \[4\]"):
        bind(model, {**dests, "scale": torch.empty(4)})
    with pytest.raises(WeightsError, match="init='transformers' needs a transformers"):
        initialize(model, dests, init="transformers")
    with pytest.raises(WeightsError, match="is not 'reset_parameters'"):
        initialize(model, dests, init="xavier")

    def replaces(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.weight = nn.Parameter(torch.zeros(3, 3))

    with pytest.raises(WeightsError, match="(?s)replaced these tensors.*proj.weight"):
        initialize(model, dests, init=replaces)


def test_bind_keeps_ties_attributes_and_meta_buffers() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False), nn.BatchNorm1d(5))
    model[1].weight = model[0].weight
    model[0].weight.no_decay = True
    assert tied_names(model) == {"0.weight": ["1.weight"], "1.weight": ["0.weight"]}
    dests = homes({"1.weight": (torch.Size([5, 3]), torch.bfloat16),
                   "2.weight": (torch.Size([5]), torch.float32),
                   "2.bias": (torch.Size([5]), torch.float32)})  # fmt: skip
    left = bind(model, dests)
    assert left == ["2.running_mean", "2.running_var", "2.num_batches_tracked"]
    assert model[1].weight is model[0].weight and model[0].weight.no_decay
    assert model[0].weight.dtype == torch.bfloat16  # the home's dtype wins


# -- host memory ---------------------------------------------------------------------------------


def big_checkpoint(directory: Path, tensors: int = 40, numel: int = 5 * 2**18) -> None:
    """A transformers-style sharded directory of tensors * numel fp32 (200 MiB by default)."""
    weight_map, per_shard = {}, 10
    for shard in range(0, tensors, per_shard):
        file = f"model-{shard // per_shard + 1:05d}.safetensors"
        part = {f"layer.{i}.weight": torch.full((numel // 512, 512), float(i))
                for i in range(shard, min(shard + per_shard, tensors))}  # fmt: skip
        save_file(part, directory / file)
        weight_map.update(dict.fromkeys(part, file))
    (directory / weights.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def measure(path: str, dtypes: Sequence[str]) -> dict[str, Any]:
    """How far the peak RSS rises over the RSS before: materialize (per home dtype) vs the
    usual way (each shard loaded whole with load_file, then copied). Without a resettable
    peak (a fresh process, via main) the rise is an upper bound."""
    src = WeightSource(path)
    files = sorted({str(src.file(n)) for n in src.names()})
    out: dict[str, Any] = {"model": sum(src.nbytes(n) for n in src.names()),
                           "largest": max(src.nbytes(n) for n in src.names())}  # fmt: skip
    for dtype in dtypes:
        dests = {n: torch.zeros(src.shape(n), dtype=getattr(torch, dtype)) for n in src.names()}
        base, _ = rss(), reset_peak_rss()
        report = materialize(dests, src)
        out[dtype] = {"rise": peak_rss() - base, "GB/s": round(report.gb_per_s, 2)}
        src.close()
    base, _ = rss(), reset_peak_rss()
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    for name, tensor in state.items():
        dests[name].copy_(tensor)
    out["load_file"] = {"rise": peak_rss() - base}
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")
def test_peak_host_memory_is_about_one_tensor(tmp_path: Path) -> None:
    big_checkpoint(tmp_path)
    dtypes = ["float32", "bfloat16"]  # read straight into the homes; cast through a scratch
    if reset_peak_rss():
        got = measure(str(tmp_path), dtypes)
    else:  # a fresh process, whose peak before reading is its peak so far
        run = subprocess.run([sys.executable, __file__, str(tmp_path), *dtypes],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        assert run.returncode == 0, run.stderr
        got = json.loads(run.stdout)
    print(f"\npeak RSS rise, bytes: {got}")
    mib = 2**20
    assert got["float32"]["rise"] <= 8 * mib  # no copy at all: read into the homes
    assert got["bfloat16"]["rise"] <= got["largest"] + 8 * mib  # one tensor's scratch at most
    assert got["load_file"]["rise"] >= 0.8 * got["model"]  # and the measure sees a copy


if __name__ == "__main__":  # python tests/test_weights.py DIR DTYPE...: the figures as JSON
    print(json.dumps(measure(sys.argv[1], sys.argv[2:])))


def test_initialize_shows_progress_on_request(capsys) -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    dests = {n: torch.empty(p.shape) for n, p in model.named_parameters()}
    weights.initialize(model, dests)  # small and not a terminal: quiet
    assert capsys.readouterr().err == ""
    weights.initialize(model, dests, progress=True)
    err = capsys.readouterr().err
    assert "init" in err and "/3 " in err and "module" in err  # the Sequential, two Linears
