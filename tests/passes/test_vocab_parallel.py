"""Vocab-parallel embedding, head and cross-entropy, and the per-rank dropout streams, on
spawned gloo ranks against the single-process model (loss and consolidated gradients within
rtol=1e-5, atol=1e-6). One spawn per world size checks every model."""

import pytest
import torch
import torch.nn.functional as F
from conftest import SEQ, VOCAB
from test_tensor_parallel import _compare, _inputs, _loss, _make, _plan, _reference

import fxstar
from fxstar.capture import capture
from fxstar.dist_launch import spawn
from fxstar.passes.shape_memory import META_KEY as MEMORY
from fxstar.passes.tp_vocab import find_vocab
from fxstar.runtime import rng_tracker, tp_ops
from fxstar.runtime import vocab_parallel as vp
from fxstar.runtime.rank_group import new_group


def _logits_bytes(engine) -> int:
    """What shape_memory measured for the head's output (the logits) on this rank."""
    linears = (tp_ops.column_linear, torch.ops.aten.linear.default)
    nodes = [n for n in engine.program.graph_module.graph.nodes if n.target in linears]
    return nodes[-1].meta[MEMORY].out_bytes  # the head is the last linear


def _cross_entropy_cases(world: int, rank: int, failures: list[str]) -> None:
    """The loss alone against F.cross_entropy: ignored targets, every reduction, gradients."""
    group = new_group(30)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(12, VOCAB, generator=g, dtype=torch.float64)
    target = torch.randint(0, VOCAB, (12,), generator=g)
    target[[2, 7]] = -100
    for reduction, code in (("mean", 1), ("sum", 2), ("none", 0)):
        full = logits.clone().requires_grad_()
        expected = F.cross_entropy(full, target, reduction=reduction)
        expected.backward(torch.ones_like(expected))
        shard = logits.chunk(world, -1)[rank].clone().requires_grad_()
        got = vp.vocab_cross_entropy(shard, target, None, code, -100, group=group)
        got.backward(torch.ones_like(got))
        if not torch.allclose(got, expected, rtol=1e-12):
            failures.append(f"cross_entropy {reduction}: {got} != {expected}")
        if not torch.allclose(shard.grad, full.grad.chunk(world, -1)[rank], rtol=1e-12):
            failures.append(f"cross_entropy {reduction}: gradient differs")
    _cross_entropy_blocks_and_bf16(world, rank, failures, group, logits, target)


def _cross_entropy_blocks_and_bf16(world, rank, failures, group, logits, target) -> None:
    """Row blocks give the same result as one block; under bf16 what backward keeps is the
    bf16 logits shard and [tokens] vectors, not an fp32 softmax (2x the logits)."""
    for dtype, block in ((torch.float64, VOCAB), (torch.bfloat16, vp.BLOCK_ELEMENTS)):
        low = logits.to(dtype)
        full = low.double().detach().clone().requires_grad_()
        expected = F.cross_entropy(full, target)
        expected.backward()
        shard = low.chunk(world, -1)[rank].detach().clone().requires_grad_()
        saved = []

        def pack(t, saved=saved):
            saved.append(t.nbytes)
            return t

        kept, vp.BLOCK_ELEMENTS = vp.BLOCK_ELEMENTS, block  # VOCAB: a few rows a block
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                got = vp.vocab_cross_entropy(shard, target, None, 1, -100, group=group)
            got.backward()
        finally:
            vp.BLOCK_ELEMENTS = kept
        tol = {"rtol": 1e-12, "atol": 0} if dtype == torch.float64 else {"rtol": 1e-2, "atol": 1e-3}
        if not torch.allclose(got.double(), expected, **tol):
            failures.append(f"cross_entropy {dtype}: {got} != {expected}")
        if not torch.allclose(shard.grad.double(), full.grad.chunk(world, -1)[rank], **tol):
            failures.append(f"cross_entropy {dtype}: gradient differs")
        vectors = 8 * 4 * len(target)  # log-sum-exp, targets, masks: a few per token
        if dtype == torch.bfloat16 and sum(saved) > shard.nbytes + vectors:
            failures.append(f"cross_entropy bf16 saves {sum(saved)} bytes, logits {shard.nbytes}")


def _embedding_collectives(engine) -> list[str]:
    """Per vocab-parallel embedding node: its sum ('all_reduce' or 'reduce_scatter'), then
    '+scatter' when a scatter_to_seq node cuts its output afterwards."""
    kinds = []
    for node in engine.program.graph_module.graph.nodes:
        if node.target is vp.vocab_embedding:
            kind = "reduce_scatter" if node.kwargs.get("sequence_parallel") else "all_reduce"
            if any(user.target is tp_ops.scatter_to_seq for user in node.users):
                kind += "+scatter"
            kinds.append(kind)
    return kinds


def _check(name: str, world: int, rank: int, failures: list[str], plan_extra: dict) -> dict:
    reference = _reference(name, world)
    args, kwargs = _inputs(name)
    info = {}
    for sp in (False, True):
        plan = _plan(world, sp, passes=("shape_memory",), **plan_extra)
        engine = fxstar.compile(_make(name, world), plan, args, kwargs)
        vocab = engine.program.decisions.tp_sharding.vocab
        if vocab is None:
            failures.append(f"{name} sp={sp}: not vocab-parallel")
            continue
        info[f"tied sp={sp}"] = vocab.tied
        info[f"logits sp={sp}"] = _logits_bytes(engine)
        info[f"embedding sp={sp}"] = _embedding_collectives(engine)
        out = engine(*args, **kwargs)
        _loss(out).backward()
        _compare(engine, reference, out, f"{name} world={world} sp={sp}", failures)
        state = engine.state_dict()  # whole matrices, tied ones one tensor
        for key, value in reference["model"].state_dict().items():
            if not torch.equal(state[key], value):
                failures.append(f"{name} sp={sp}: state_dict[{key}] is not the full weight")
    return info


def _worker(rank: int, world: int, names: list[str]) -> dict:
    torch.manual_seed(0)
    failures: list[str] = []
    _cross_entropy_cases(world, rank, failures)
    infos = {name: _check(name, world, rank, failures, {}) for name in names}
    return {"failures": failures, "infos": infos}


def _single_logits_bytes() -> int:
    args, kwargs = _inputs("gpt")
    plan = fxstar.Plan(passes=("shape_memory",))
    return _logits_bytes(fxstar.compile(_make("gpt", 2), plan, args, kwargs))


def _run(world: int, names: list[str]) -> list[dict]:
    results = spawn(_worker, world, names)
    failures = [f for r in results for f in r["failures"]]
    assert not failures, "\n".join(failures[:20])
    return results


def test_vocab_parallel_world_2_gpt_gpt2_tied_llama_untied():
    """GPT (tied), transformers GPT-2 at its default config (tied) and Llama at its default
    config (untied), with and without sequence parallelism; the logits a rank holds are 1/N."""
    pytest.importorskip("transformers")
    results = _run(2, ["gpt", "gpt2_default", "llama_default"])
    infos = results[0]["infos"]
    assert infos["gpt"]["tied sp=False"] and infos["gpt2_default"]["tied sp=True"]
    assert not infos["llama_default"]["tied sp=False"]
    whole = _single_logits_bytes()
    assert whole == 2 * SEQ * VOCAB * 4
    for r in results:
        assert r["infos"]["gpt"]["logits sp=False"] == whole // 2
        assert r["infos"]["gpt"]["logits sp=True"] == whole // 2
    # under sequence parallelism the embedding's sum and the scatter are one reduce-scatter
    for name in ("gpt", "gpt2_default", "llama_default"):
        assert infos[name]["embedding sp=False"] == ["all_reduce"]
        assert infos[name]["embedding sp=True"] == ["reduce_scatter"]


@pytest.mark.slow  # world 2 runs by default
def test_vocab_parallel_world_4_gpt():
    results = _run(4, ["gpt"])
    assert results[0]["infos"]["gpt"]["logits sp=True"] == _single_logits_bytes() // 4


@pytest.mark.slow
def test_vocab_parallel_world_4_transformers():
    pytest.importorskip("transformers")
    _run(4, ["gpt2_default", "llama_default"])


def test_a_model_returning_logits_gets_them_whole_and_rules_turn_it_off():
    """transformers' own output carries the logits: they are gathered for it (the loss
    still runs on the shards); a 'replicate' rule on the head keeps it whole."""
    pytest.importorskip("transformers")
    results = spawn(_returned_worker, 2)
    failures = [f for r in results for f in r["failures"]]
    assert not failures, "\n".join(failures[:20])
    assert "gather_to_3 = vocab_parallel.gather_from_vocab(" in results[0]["dump"]


def _returned_worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    failures: list[str] = []
    reference = _reference("gpt2", world)
    args, kwargs = _inputs("gpt2")
    engine = fxstar.compile(_make("gpt2", world), _plan(world, True), args, kwargs)
    out = engine(*args, **kwargs)
    _loss(out).backward()
    _compare(engine, reference, out, "gpt2 returning logits", failures)
    if not torch.allclose(out.logits, reference["out"].logits, rtol=1e-5, atol=1e-6):
        failures.append("returned logits differ")
    plan = fxstar.Plan(tensor_parallel={"size": world, "rules": {"lm_head": "replicate"}})
    kept = fxstar.compile(_make("gpt2", world), plan, args, kwargs).program.decisions
    if kept.tp_sharding.vocab is not None or "replicate" not in kept.tp_sharding.vocab_off:
        failures.append("the 'replicate' rule did not keep the head whole")
    return {"failures": failures, "dump": fxstar.dump(engine) if rank == 0 else ""}


# -- dropout under tensor parallel ----------------------------------------------------------------


def _gpt_dropout(attention: float, elsewhere: float) -> torch.nn.Module:
    model = _make("gpt", 2)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = elsewhere
        if hasattr(module, "attn_dropout"):
            module.attn_dropout = attention
    return model


def _two_engines(args, world: int) -> list:
    return [fxstar.compile(_gpt_dropout(0.5, 0.1), _plan(world, True), args) for _ in range(2)]


def _dropout_worker(rank: int, world: int) -> dict:
    failures: list[str] = []
    args, _ = _inputs("gpt")
    # the functions: own masks on splits, the shared stream elsewhere
    torch.manual_seed(0)
    engine = fxstar.compile(_gpt_dropout(0.1, 0.1), _plan(world, True), args)
    group = engine.topology.tensor_group
    ones = torch.ones(4, 64)
    rank_mask = rng_tracker.rank_dropout(ones, 0.5, True, group=group)
    shared_mask = torch.ops.aten.dropout.default(ones, 0.5, True)
    torch.manual_seed(7)
    whole = torch.ops.aten.dropout.default(torch.ones(2, 8, 4), 0.5, True)
    torch.manual_seed(7)
    sliced = rng_tracker.seq_dropout(torch.ones(2, 8 // world, 4), 0.5, True, group=group)
    if not torch.equal(sliced, tp_ops.own_tokens(whole, world, rank)):
        failures.append("seq_dropout is not the slice of the whole sequence's mask")
    kinds = {}
    for node in engine.program.graph_module.graph.nodes:
        kinds.setdefault(getattr(node.target, "__name__", str(node.target)), []).append(node.name)
    # GPT: attention dropout on split heads; embedding/residual dropouts on sequence slices
    if len(kinds.get("rank_attention", [])) != 2 or len(kinds.get("seq_dropout", [])) != 5:
        failures.append(f"random ops not routed as decided: {kinds}")
    # dropout outside the splits only: the masks are the single process's (loss, gradients)
    for sp in (False, True):
        torch.manual_seed(0)
        reference = _gpt_dropout(0.0, 0.1)
        torch.manual_seed(11)
        loss = reference(*args)
        loss.backward()
        ref = {"out": loss, "grads": {n: p.grad for n, p in reference.named_parameters()}}
        engine = fxstar.compile(_gpt_dropout(0.0, 0.1), _plan(world, sp), args)
        torch.manual_seed(11)
        out = engine(*args)
        out.backward()
        _compare(engine, ref, out, f"dropout outside the splits sp={sp}", failures)
    # recomputed regions replay the rank streams: checkpointed == kept, bit for bit
    grads = []
    for extra in ({}, {"checkpoint": "blocks"}):
        torch.manual_seed(0)
        engine = fxstar.compile(_gpt_dropout(0.5, 0.1), _plan(world, True, **extra), args)
        torch.manual_seed(11)
        engine(*args).backward()
        grads.append(engine.gradients())
        # the graph and its regions hold the engine's group, which holds the rank stream
        group = engine.topology.tensor_group
        holders = [m for m in engine.program.graph_module.modules() if hasattr(m, "tp_group")]
        if len(holders) < 1 + bool(extra) or any(m.tp_group is not group for m in holders):
            failures.append(f"{extra}: the graph or a region does not hold the engine's group")
        if group.stream is None:
            failures.append("the engine's group holds no rank stream")
    # two engines, two groups and two streams: drawing from one leaves the other as it was
    alive = _two_engines(args, world)  # a freed engine releases its group
    first, second = (engine.topology.tensor_group for engine in alive)
    before = second.stream.state_dict()["cpu"]
    rng_tracker.rank_dropout(torch.ones(64), 0.5, True, group=first)
    if first is second or not torch.equal(second.stream.state_dict()["cpu"], before):
        failures.append("two engines share a process group or an RNG stream")
    if any(not torch.equal(grads[0][k], grads[1][k]) for k in grads[0]):
        failures.append("a checkpointed region's recompute drew other rank-stream masks")
    return {"failures": failures, "rank_mask": rank_mask, "shared_mask": shared_mask}


def test_dropout_draws_per_rank_inside_splits_and_the_shared_stream_outside():
    results = spawn(_dropout_worker, 2)
    failures = [f for r in results for f in r["failures"]]
    assert not failures, "\n".join(failures[:20])
    assert not torch.equal(results[0]["rank_mask"], results[1]["rank_mask"])
    assert torch.equal(results[0]["shared_mask"], results[1]["shared_mask"])


class _Head(torch.nn.Module):
    def __init__(self, smoothing: float):
        super().__init__()
        self.wte = torch.nn.Embedding(VOCAB, 32)
        self.lm_head = torch.nn.Linear(32, VOCAB, bias=False)
        self.smoothing = smoothing

    def forward(self, ids, targets):
        logits = self.lm_head(self.wte(ids))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1),
                               label_smoothing=self.smoothing)  # fmt: skip


def test_a_loss_the_shards_cannot_compute_keeps_the_head_whole_and_says_why():
    args, _ = _inputs("gpt")
    plan = fxstar.Plan(tensor_parallel={"size": 2})
    decision, why = find_vocab(capture(_Head(0.0), args, {}, plan=plan), {}, 2)
    assert (decision.tied, decision.embeddings, why) == (False, ["embedding"], "")
    decision, why = find_vocab(capture(_Head(0.1), args, {}, plan=plan), {}, 2)
    assert decision is None and "label smoothing" in why
    decision, why = find_vocab(capture(_Head(0.0), args, {}, plan=plan), {}, 3)
    assert decision is None and "not divisible by tensor_parallel.size=3" in why
