"""Ranks that disagree raise one clear error on every rank; a rank that stops makes the others
raise within plan.dist_timeout instead of hanging.

The messages are built in-process from fingerprints; one spawn (world size 2, gloo) checks
what really happens between ranks: a differing plan option, differing initial parameters,
ranks fed different inputs, and a rank that skips a step.
"""

import time

import pytest
import torch
from conftest import tiny_gpt, tokens

import fxstar
from fxstar.dist_launch import spawn
from fxstar.errors import CollectiveError
from fxstar.plan import Plan, PlanError
from fxstar.runtime.agreement import RankMismatchError, fingerprint, mismatch_message
from fxstar.runtime.rank_group import guard

TIMEOUT = 5.0  # seconds, the spawned ranks' plan.dist_timeout


def _plan(**tp_options) -> Plan:
    return Plan(tensor_parallel={"size": 2, **tp_options}, optimizer={"type": "sgd", "lr": 0.1},
                dist_timeout=TIMEOUT)  # fmt: skip


# -- in-process: the messages ---------------------------------------------------------------------


def test_agreeing_fingerprints_give_no_message():
    model = tiny_gpt(dropout=0.0)
    same = fingerprint(_plan(), "graph", dict(model.named_parameters()))
    assert mismatch_message([same, same]) is None


def test_plan_differences_are_named_with_their_values_per_rank():
    base = _plan()
    other = base.replace(
        tensor_parallel={"size": 2, "sequence_parallel": True},
        optimizer={"type": "sgd", "lr": 0.1, "accumulation_steps": 4, "clip_grad_norm": 1.0},
    )
    a, b = fingerprint(base, "g"), fingerprint(other, "g")
    text = mismatch_message([a, b, a, b])
    assert "plan.tensor_parallel.sequence_parallel: ranks 0, 2: False; ranks 1, 3: True" in text
    assert "plan.optimizer.accumulation_steps: ranks 0, 2: 1; ranks 1, 3: 4" in text
    assert "plan.optimizer.clip_grad_norm: ranks 0, 2: None; ranks 1, 3: 1.0" in text
    assert "plan.optimizer.lr" not in text and "parameter" not in text
    assert "build the same Plan on every rank" in text


def test_parameter_and_graph_differences_are_named():
    a = dict(tiny_gpt(0, dropout=0.0).named_parameters())
    b = dict(a, **{"h.1.ln_2.bias": a["h.1.ln_2.bias"] + 1})  # one value changed
    del b["ln_f.weight"]
    texts = ["x = input()\ny = relu(x)\n", "x = input()\ny = gelu(x)\n"]
    prints = [fingerprint(_plan(), t, tensors) for t, tensors in zip(texts, (a, b), strict=True)]
    text = mismatch_message(prints, texts)
    assert "2 parameter(s) or buffer(s) differ" in text
    assert "h.1.ln_2.bias: rank 0: float32[32] crc32=" in text
    assert "ln_f.weight: rank 0: float32[32] crc32=" in text and "rank 1: (absent)" in text
    assert "first at line 2: rank 0: 'y = relu(x)'; rank 1: 'y = gelu(x)'" in text
    assert "same torch.manual_seed" in text and "inputs of the same shapes" in text


def test_a_tied_meta_weight_is_captured_as_the_real_one_is():
    """Sharded payloads leave another rank's chunks meta: its graph must still be the owner's,
    GPT's tied embedding and head read through one placeholder (else the ranks' recaptures
    disagree, and their access plans with them)."""
    from fxstar.capture import capture

    with torch.device("meta"):
        meta = tiny_gpt(dropout=0.0)
    mixed = tiny_gpt(dropout=0.0)  # what a sharded rank holds: some chunks meta
    mixed.wte.weight = mixed.head.weight = torch.nn.Parameter(mixed.wte.weight.to("meta"))
    texts = [capture(m, tokens()).stages[0].text for m in (tiny_gpt(dropout=0.0), meta, mixed)]
    assert texts[1] == texts[0] and texts[2] == texts[0]


def test_dist_timeout_is_validated():
    assert Plan().dist_timeout == 300.0
    for bad in (0, -1, float("inf"), "5"):
        with pytest.raises(PlanError, match="dist_timeout"):
            Plan(dist_timeout=bad)


def test_lost_peers_become_collective_errors_and_other_errors_pass():
    timed_out = r"(?s)all_reduce in row_linear forward .*timed out.*another rank probably failed"
    with (
        pytest.raises(CollectiveError, match=timed_out),
        guard("all_reduce in row_linear forward"),
    ):
        raise RuntimeError("[pair.cc:78] Timed out waiting 5000ms for recv operation")
    with pytest.raises(CollectiveError, match="lost its connection"), guard("all_gather"):
        raise RuntimeError("Connection closed by peer [127.0.0.1]:2447")
    with pytest.raises(RuntimeError, match="^bad shape$"), guard("all_gather"):
        raise RuntimeError("bad shape")  # not a lost peer: unchanged


# -- spawned: two ranks ---------------------------------------------------------------------------


def _compile_error(model, plan, args) -> str | None:
    try:
        fxstar.compile(model, plan, args)
    except RankMismatchError as error:
        return str(error)
    return None


def _worker(rank: int, world: int) -> dict:
    args = tokens()
    out = {}
    # rank 1 turns on sequence parallelism: tp_sharding decides differently, nothing hangs
    plan = _plan(sequence_parallel=rank == 1)
    out["plan"] = _compile_error(tiny_gpt(dropout=0.0), plan, args)
    # the ranks built their models under different seeds
    out["params"] = _compile_error(tiny_gpt(seed=rank, dropout=0.0), _plan(), args)
    # agreeing ranks train; then rank 1 skips a step and rank 0 must not wait for it for long
    engine = fxstar.compile(tiny_gpt(dropout=0.0), _plan(), args)
    engine(*args).backward()
    # each rank fed its own batch (data sharded over every rank, not over replicas): both
    # refuse it at the forward's first collective, then train on
    try:
        engine(*tokens(seed=2 + rank)).backward()
    except CollectiveError as error:
        out["inputs"] = str(error)
    engine(*args).backward()
    if rank == 0:
        start = time.monotonic()
        try:
            engine(*args).backward()
        except CollectiveError as error:
            out["skipped"] = str(error)
        out["waited"] = time.monotonic() - start
    torch.distributed.barrier()  # the default group: rank 1 waits here for rank 0's error
    return out


def test_ranks_that_disagree_or_stop_raise_clear_errors_on_every_rank():
    results = spawn(_worker, 2)
    plan_errors = [r["plan"] for r in results]
    assert plan_errors[0] is not None and plan_errors[0] == plan_errors[1]
    assert "plan.tensor_parallel.sequence_parallel: rank 0: False; rank 1: True" in plan_errors[0]
    param_errors = [r["params"] for r in results]
    assert param_errors[0] is not None and param_errors[0] == param_errors[1]
    assert "wte.weight: rank 0: float32[64,32] crc32=" in param_errors[0]
    assert "plan." not in param_errors[0]  # only the parameters differ
    inputs = [r.get("inputs") for r in results]
    assert inputs[0] is not None and inputs[0] == inputs[1]
    assert "the tensor-parallel ranks were fed different inputs: rank 0: crc32=" in inputs[0]
    assert "feed every rank of a tensor-parallel group the same batch" in inputs[0]
    skipped = results[0]["skipped"]
    # the first collective of the forward: the vocab-parallel embedding's sum
    assert "in vocab_embedding forward on rank 0 of 2 timed out after 5 s" in skipped
    assert "another rank probably failed" in skipped
    assert TIMEOUT - 1 < results[0]["waited"] < TIMEOUT + 20
