"""Tensor parallel: the sharding analysis in-process, the rewrite on spawned gloo ranks.

The oracle is the single-process model: loss and every gradient (shards all-gathered) within
rtol=1e-5, atol=1e-6. Spawning costs seconds, so each world size is one spawn that checks
every model and mode; the modes (sync/async x keep/recompute, mem_saving_comm) only change
the keyword arguments of the collective nodes, so one compile per model and sequence-parallel
setting serves all of them (one compile per model also comes straight from the plan).
"""

import itertools

import pytest
import torch
from conftest import SEQ, VOCAB, tiny_gpt, tokens

import fxstar
from fxstar.capture import capture
from fxstar.dist_launch import spawn
from fxstar.passes import PassManager, passes_for
from fxstar.passes.tp_sharding import META_KEY, TPShardingError
from fxstar.plan import Plan
from fxstar.runtime import dist as tp

TOL = {"rtol": 1e-5, "atol": 1e-6}
MODES = list(itertools.product((False, True), repeat=2))  # (async, recompute)


def gpt(seed: int = 0) -> torch.nn.Module:
    from fxstar.models.gpt import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=32,
                         dropout=0.0))  # fmt: skip


def gpt2(seed: int = 0) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ * 2, n_embd=32, n_layer=2, n_head=4, use_cache=False,
        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        loss_type="ForCausalLM",
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


def llama(seed: int = 0, kv_heads: int = 2) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=SEQ * 2,
        tie_word_embeddings=True, use_cache=False, bos_token_id=0, eos_token_id=0,
        pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def _inputs(name: str):
    ids, targets = tokens()
    if name == "gpt":
        return (ids, targets), {}
    return (), {"input_ids": ids, "labels": targets}


def _make(name: str, world: int) -> torch.nn.Module:
    if name == "llama":
        return llama(kv_heads=world)  # kv heads split too: 2 (GQA) at world size 2
    return {"gpt": gpt, "gpt2": gpt2}[name]()


def _loss(out):
    return out if isinstance(out, torch.Tensor) else out.loss


def _plan(world: int, sp: bool, async_comm=False, recompute=False, **extra) -> Plan:
    return Plan(
        tensor_parallel={"size": world, "sequence_parallel": sp,
                         "async_communication": async_comm, "recompute_allgather": recompute},
        optimizer={"type": "sgd", "lr": 0.1}, **extra,
    )  # fmt: skip


# -- in-process: the analysis ---------------------------------------------------------------------


def _analyse(model, args, kwargs, plan):
    program = capture(model, args, kwargs, plan=plan)
    return PassManager(["tp_sharding"]).run(program)


def test_sharding_finds_linears_fused_qkv_and_per_rank_shapes():
    args, kwargs = _inputs("gpt")
    program = _analyse(gpt(), args, kwargs, _plan(2, sp=True))
    s = program.meta[META_KEY]
    styles = [(site.module, site.style, site.parts) for site in s.sites[:4]]
    assert styles == [("h.0.attn.c_attn", "column", 3), ("h.0.attn.c_proj", "row", 1),
                      ("h.0.mlp.c_fc", "column", 1), ("h.0.mlp.c_proj", "row", 1)]  # fmt: skip
    assert s.args["split"][1] == 16  # 32 per projection -> 16 per rank
    assert s.args["view"][1] == [2, 16, 2, 8]  # 4 heads -> 2 per rank
    assert s.args["view_3"][1] == [2, 16, 16]
    assert {e.producer for e in s.scatters} == {"embedding", "embedding_1"}
    assert [(e.producer, e.consumer) for e in s.gathers] == [("layer_norm_4", "linear_8")]
    assert "p_h_0_ln_1_weight" in {e.producer for e in s.grad_reduces}
    text = fxstar.dump(program)
    assert "tp=columnx3" in text and "tp=seq" in text


def test_plan_enables_the_pass_and_rules_override_defaults():
    plan = _plan(2, sp=False)
    plan.check_implemented()  # tensor_parallel and mem_saving_comm are implemented
    _plan(2, sp=False, mem_saving_comm=True).check_implemented()
    assert "tensor_parallel" in passes_for(plan)
    assert "tensor_parallel" not in passes_for(Plan())
    args, kwargs = _inputs("gpt")
    rules = {"h.*.mlp.*": "replicate"}
    plan = Plan(tensor_parallel={"size": 2, "rules": rules})
    s = _analyse(gpt(), args, kwargs, plan).meta[META_KEY]
    assert all(".mlp." not in site.module for site in s.sites)


def test_a_model_that_cannot_be_split_names_the_node_and_the_rule():
    args, kwargs = _inputs("gpt")
    with pytest.raises(TPShardingError, match=r"rules=\{'h\.\*\.attn\.c_attn': 'replicate'\}"):
        _analyse(gpt(), args, kwargs, _plan(3, sp=False))  # 32 outputs per part, 3 ranks
    # a column linear whose output reaches a replicated linear, not a row linear
    plan = Plan(tensor_parallel={"size": 2, "rules": {"h.*.mlp.c_proj": "replicate"}})
    with pytest.raises(TPShardingError, match=r"(?s)node linear_3 .*'h\.\*\.mlp\.c_fc': 'repl"):
        _analyse(gpt(), args, kwargs, plan)
    plan = Plan(tensor_parallel={"size": 2, "rules": {"head": "column"}})  # tied to wte
    with pytest.raises(TPShardingError, match=r"also read by \['embedding'\].*'head': 'repl"):
        _analyse(tiny_gpt(dropout=0.0), args, kwargs, plan)
    plan = Plan(tensor_parallel={"size": 2, "rules": {"h.*.attn.c_attn": "replicate"}})
    with pytest.raises(TPShardingError, match=r"row-parallel linear at h.0.attn.c_proj needs"):
        _analyse(gpt(), args, kwargs, plan)


def test_the_rewrite_needs_a_process_group_of_the_planned_size():
    args, _ = _inputs("gpt")
    with pytest.raises(TPShardingError, match="init_process_group"):
        fxstar.compile(gpt(), _plan(2, sp=False), example_inputs=args)


# -- spawned: the rewrite against the single-process model ----------------------------------------


def _set_modes(engine, async_comm: bool, recompute: bool, mem_saving: bool) -> None:
    """Flip the collective nodes' mode arguments in every capture (the graph is the same)."""
    for program in engine.programs.values():
        for node in program.graph_module.graph.nodes:
            if node.op != "call_function" or node.target.__module__ != tp.__name__:
                continue
            kwargs = dict(node.kwargs, mem_saving=mem_saving)
            if node.target in (tp.column_linear, tp.row_linear):
                kwargs["async_comm"] = async_comm
            if node.target is tp.column_linear:
                kwargs["recompute"] = recompute
            node.kwargs = kwargs
        program.graph_module.recompile()


def _compare(engine, reference, out, label: str, failures: list[str]) -> None:
    expected = _loss(reference["out"])
    if not torch.allclose(_loss(out), expected, **TOL):
        failures.append(f"{label}: loss {_loss(out).item()} != {expected.item()}")
    grads = engine.store.consolidate_grads({n: p.grad for n, p in engine.named_parameters()})
    for name, ref in reference["grads"].items():
        got = grads.get(name)
        if got is None or got.shape != ref.shape or not torch.allclose(got, ref, **TOL):
            err = None if got is None or got.shape != ref.shape else (got - ref).abs().max()
            failures.append(f"{label}: grad {name} differs (max err {err})")


def _reference(name: str, world: int):
    model = _make(name, world)
    args, kwargs = _inputs(name)
    out = model(*args, **kwargs)
    _loss(out).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return {"out": out, "grads": grads, "model": model}


def _check_model(name: str, world: int, modes, failures: list[str], rank: int) -> dict:
    reference = _reference(name, world)
    args, kwargs = _inputs(name)
    info = {}
    for sp in (False, True):
        model = _make(name, world)
        first_async, first_recompute = modes[-1]
        engine = fxstar.compile(model, _plan(world, sp, first_async, first_recompute), args,
                                kwargs)  # fmt: skip
        for async_comm, recompute in [modes[-1], *modes[:-1]]:
            for mem_saving in (False, True) if (async_comm, recompute) == modes[-1] else (False,):
                _set_modes(engine, async_comm, recompute, mem_saving)
                label = f"{name} world={world} sp={sp} async={async_comm} " + (
                    f"recompute={recompute} mem_saving={mem_saving}"
                )
                out = engine(*args, **kwargs)
                _loss(out).backward()
                _compare(engine, reference, out, label, failures)
                engine.zero_grad()
        state = engine.state_dict()  # collective: every rank all-gathers the shards
        for key, value in reference["model"].state_dict().items():
            if not torch.equal(state[key], value):
                failures.append(f"{name} sp={sp}: state_dict[{key}] is not the full weight")
        fresh = _make(name, world)
        fresh.load_state_dict(state)
        if sp and rank == 0:
            info["dump"] = fxstar.dump(engine)
    # one SGD step on the shards equals one on the whole model
    engine.zero_grad()
    _loss(engine(*args, **kwargs)).backward()
    engine.step()
    opt = torch.optim.SGD(reference["model"].parameters(), lr=0.1)
    opt.step()
    state = engine.state_dict()
    for key, value in reference["model"].state_dict().items():
        if not torch.allclose(state[key], value, **TOL):
            failures.append(f"{name}: after one step, {key} differs")
    return info


def _worker(rank: int, world: int, names: list[str], modes) -> dict:
    torch.manual_seed(0)
    failures: list[str] = []
    infos = {name: _check_model(name, world, modes, failures, rank) for name in names}
    return {"failures": failures, "infos": infos}


def test_world_size_2_all_modes_match_single_process():
    pytest.importorskip("transformers")
    results = spawn(_worker, 2, ["gpt", "gpt2", "llama"], MODES)
    failures = [f for r in results for f in r["failures"]]
    assert not failures, "\n".join(failures[:20])
    text = results[0]["infos"]["gpt2"]["dump"]
    for expected in ("dist.column_linear(", "dist.row_linear(",
                     "scatter_embedding", "gather_layer_norm_4", "grad_reduce_",
                     "f32[2,16,48]", "f32[2,8,32]"):  # fmt: skip
        assert expected in text, expected


def _saved_by_columns(world: int, recompute: bool) -> dict[str, int]:
    """Bytes each column linear saves for backward, as shape_memory measures them."""
    from fxstar.passes.shape_memory import META_KEY as MEMORY

    args, kwargs = _inputs("gpt")
    plan = _plan(world, True, True, recompute).replace(passes=("shape_memory",))
    program = fxstar.compile(gpt(), plan, args, kwargs).program
    return {
        node.name: node.meta[MEMORY].saved_bytes
        for node in program.graph_module.graph.nodes
        if node.op == "call_function" and node.target is tp.column_linear
    }


def _worker4(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    failures: list[str] = []
    _check_model("gpt", world, [(False, False), (True, True)], failures, rank)
    keep, recompute = _saved_by_columns(world, False), _saved_by_columns(world, True)
    return {"failures": failures, "keep": keep, "recompute": recompute}


def test_world_size_4_matches_single_process_and_recompute_saves_the_shard_only():
    world = 4
    results = spawn(_worker4, world)
    failures = [f for r in results for f in r["failures"]]
    assert not failures, "\n".join(failures[:20])
    gathered = 2 * SEQ * 32 * 4  # the whole [batch, seq, hidden] f32 input of a column linear
    for r in results:
        assert len(r["keep"]) == 4  # c_attn and c_fc in 2 blocks
        for name, kept in r["keep"].items():
            assert kept - r["recompute"][name] == gathered * (world - 1) // world, name


def _compose_worker(rank: int, world: int) -> dict:
    """Tensor parallel under the chunk engine (shards paged through a budget) and under bf16:
    the masters are the shards, cut from the model's fp32 weights."""
    torch.manual_seed(0)
    failures: list[str] = []
    reference = _reference("gpt", world)
    args, kwargs = _inputs("gpt")
    param_bytes = sum(p.numel() * 4 for p in gpt().parameters())
    paged = _plan(world, True, device_memory=param_bytes, static_partition=True,
                  warmup_gpu_chunk_mem_ratio=0.3)  # fmt: skip
    cases = {
        "chunks": (paged, TOL),
        "bf16": (_plan(world, True, precision="bf16"), {"rtol": 5e-2, "atol": 2e-2}),
    }
    for label, (plan, tol) in cases.items():
        engine = fxstar.compile(_make("gpt", world), plan, args, kwargs)
        assert engine.chunks is not None
        out = engine(*args, **kwargs)
        _loss(out).backward()
        if not torch.allclose(_loss(out).float(), reference["out"], **tol):
            failures.append(f"{label}: loss {_loss(out).item()} != {reference['out'].item()}")
        grads = engine.store.consolidate_grads(
            {n: engine.chunks.grad_view(engine.chunks.layout.slots()[n])
             if engine.chunks.low_precision else p.grad for n, p in engine.named_parameters()}
        )  # fmt: skip
        for name, ref in reference["grads"].items():
            got = grads[name].float()
            if got.shape != ref.shape or not torch.allclose(got, ref, **tol):
                failures.append(f"{label}: grad {name} differs")
        state = engine.state_dict()  # the fp32 masters, whole: the model's own weights
        for key, value in reference["model"].state_dict().items():
            if not torch.equal(state[key].float(), value):
                failures.append(f"{label}: state_dict[{key}] is not the model's weight")
    return {"failures": failures}


def test_tensor_parallel_composes_with_chunks_and_bf16():
    results = spawn(_compose_worker, 2)
    failures = [f for r in results for f in r["failures"]]
    assert not failures, "\n".join(failures[:20])
