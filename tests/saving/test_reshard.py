"""Resharding (fxstar/saving/layouts/reshard.py): a checkpoint written at one (data-parallel x
tensor-parallel) mesh resumes at another. Right after the load the engine's parameters and its
optimizer state, consolidated over its ranks, are the saving run's bit for bit, and so are the
RNG states that carry over; training goes on with the uninterrupted run's losses within
rounding (a matmul split another way sums in another order).

Every mesh runs in one spawn of 4 ranks (spawning costs seconds): a mesh of fewer ranks is
`data_parallel=False`, each group of its ranks a model of its own (all alike; the first saves
the checkpoint the targets load). Each parametrized case reads its pair from that run.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import tiny_gpt
from families import FAMILIES, SEQ, VOCAB

import fxstar
from fxstar.dist_launch import spawn
from fxstar.engine import compile
from fxstar.passes.tensor_parallel import shard_of, unshard
from fxstar.plan import Plan
from fxstar.saving import training_state, view_of
from fxstar.saving.layouts import LogicalState, logical_state
from fxstar.saving.layouts.logical_state import take_share

WORLD = 4
ROWS = 4  # one global batch, split over the data-parallel replicas
STEPS, SAVED_AFTER = 4, 2  # the checkpoint is written after step 2 of 4
CHUNKS = {"chunk_size": 4096, "device_memory": "auto",
          "optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.1}}  # fmt: skip
# name "<data parallel>x<tensor parallel>": plan options at a world of 4; chunks and HybridAdam
# everywhere but "/torch" (torch's AdamW over the engine's parameters, without chunks)
MESHES = {
    "1x1": {**CHUNKS, "data_parallel": False},
    "1x2": {**CHUNKS, "tensor_parallel": {"size": 2}, "data_parallel": False},
    "4x1": CHUNKS,
    "2x2": {**CHUNKS, "tensor_parallel": {"size": 2}},
    "1x4": {**CHUNKS, "tensor_parallel": {"size": 4}},
    "1x1/torch": {"optimizer": CHUNKS["optimizer"], "data_parallel": False},
    "1x2/torch": {"optimizer": CHUNKS["optimizer"], "tensor_parallel": {"size": 2},
                  "data_parallel": False},
}  # fmt: skip
for _mesh in ("1x1", "1x2"):  # torch's SGD with momentum, without chunks
    MESHES[f"{_mesh}/sgd"] = {**MESHES[f"{_mesh}/torch"], "optimizer": {"type": "sgd", "lr": 0.1}}
for _mesh in ("1x1", "1x2", "2x2"):  # fp16 (a loss scaler); Adam's moments in bf16, in 8 bits
    MESHES[f"{_mesh}/fp16"] = {**MESHES[_mesh], "precision": "fp16"}
    for _dtype in ("bf16", "8bit"):
        MESHES[f"{_mesh}/{_dtype} moments"] = {
            **MESHES[_mesh],
            "optimizer": {**CHUNKS["optimizer"], "state_dtype": _dtype},
        }
# the tiny GPT (2 heads, tied vocab-parallel head, fused q/k/v: parts of a column split), and
# GPT-NeoX at transformers' defaults (4 heads, q/k/v fused per head, untied head, no dropout)
PAIRS = {
    "gpt": [("1x2", "1x1"), ("1x1", "1x2"), ("2x2", "1x1"), ("4x1", "2x2"), ("2x2", "1x2"),
            ("1x2/torch", "1x1/torch")],
    "gpt_neox": [("2x2", "1x4")],
}  # fmt: skip
SLOW_PAIRS = {
    "gpt": [("1x1", "2x2"), ("2x2", "4x1"), ("1x2", "4x1"), ("1x1/torch", "1x2/torch"),
            ("1x2/fp16", "2x2/fp16"), ("2x2/bf16 moments", "1x1/bf16 moments"),
            ("1x2/8bit moments", "1x1/8bit moments"), ("1x2/sgd", "1x1/sgd")],
    "gpt_neox": [("1x4", "2x2"), ("1x4", "1x1"), ("1x1", "1x4"), ("4x1", "1x2")],
}  # fmt: skip
# after the resume: the losses of the uninterrupted run within rounding of another split
# (measured: at most 1.2e-7 in fp32; an fp16 loss within one of its ulps, 2**-8 near 4)
LOSS_RTOL = {"fp32": 1e-6, "fp16": 1e-3}
# 8-bit moments' blocks follow each rank's shard: they do not reshard across tensor-parallel
# sizes, and the load says so
REFUSED = {("1x2/8bit moments", "1x1/8bit moments")}


def _model(name: str):
    if name == "gpt":
        return tiny_gpt(0, dropout=0.0)
    make, _ = FAMILIES[name]
    return make(0)


def _batch(name: str, step: int, rows: slice) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    ids, targets = (torch.randint(1, VOCAB, (ROWS, SEQ), generator=g) for _ in range(2))
    if name == "gpt":
        return {"idx": ids[rows], "targets": targets[rows]}
    return {"input_ids": ids[rows], "labels": targets[rows]}


def _loss(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.loss


class _Rank:
    """Where this process sits in a mesh of WORLD ranks: its model (a group of ranks training
    one model) and the rows of the global batch its replica trains on."""

    def __init__(self, mesh: str, rank: int):
        options = MESHES[mesh]
        tp = options.get("tensor_parallel", {}).get("size", 1)
        dp = 1 if options.get("data_parallel", True) is False else WORLD // tp
        self.model = rank // (tp * dp)  # which model of the world it trains (0: the first)
        replica = rank % (tp * dp) // tp
        self.rows = slice(replica * ROWS // dp, (replica + 1) * ROWS // dp)
        self.plan = Plan.from_dict(options)


def _engine(name: str, mesh: str, rank: int):
    at = _Rank(mesh, rank)
    return compile(_model(name), at.plan, example_kwargs=_batch(name, 0, at.rows)), at


def _train(engine, name: str, rows: slice, steps: range) -> list[float]:
    losses = []
    for step in steps:
        loss = _loss(engine(**_batch(name, step, rows)))
        loss.backward()
        engine.step()
        losses.append(loss.item())
    return losses


def _snapshot(engine) -> dict:
    """What a rank holds: the whole parameters (engine.state_dict), its own shards, its
    optimizer's state by parameter name, how the pass split each parameter, where the rank
    sits, its RNG states, step counters and loss scaler."""
    view = view_of(engine)
    state = training_state(view)
    names = [n for group in state["optimizer_params"] for n in group]
    world = view.world
    return {
        "params": {k: v.clone() for k, v in engine.state_dict().items()},
        "local": {n: p.detach().clone() for n, p in engine.named_parameters() if not p.is_meta},
        "optimizer": {
            names[i]: {k: v.clone() for k, v in entry.items()}
            for i, entry in state["optimizer"]["state"].items()
        },
        "splits": dict(view.tensor_splits),
        "tp": world.tensor_parallel,
        "tp_rank": world.mesh.tp_rank(world.rank()),
        "rng": state["rng"],
        "counters": {key: state[key] for key in ("step", "loss_scaler") if key in state},
    }


def _path(directory: str, mesh: str) -> str:
    return f"{directory}/{mesh.replace('/', '-')}"


def _run(rank: int, world: int, models: dict[str, list[tuple[str, str]]], directory: str):
    """Every model's pairs, by model name (see _pairs)."""
    return {name: _pairs(rank, name, pairs, f"{directory}/{name}")
            for name, pairs in models.items()}  # fmt: skip


def _pairs(rank: int, name: str, pairs: list[tuple[str, str]], directory: str) -> dict:
    """Per source mesh: train, save after step 2, train on; per target mesh of it: a fresh
    engine (other weights) loads the checkpoint and trains the same steps."""
    out: dict = {}
    for source in dict.fromkeys(s for s, _ in pairs):
        engine, at = _engine(name, source, rank)
        _train(engine, name, at.rows, range(SAVED_AFTER))
        suffix = "" if at.model == 0 else f".copy{at.model}"  # models of their own: theirs
        engine.save(_path(directory, source) + suffix)
        dist.barrier()  # models of their own save apart: the first one's is whole now
        snapshot = _snapshot(engine)
        losses = _train(engine, name, at.rows, range(SAVED_AFTER, STEPS))
        out[source] = {"model": at.model, "state": snapshot, "losses": losses}
        del engine
        for target in [t for s, t in pairs if s == source]:
            torch.manual_seed(1000 + rank)  # the load must not depend on the RNG it finds
            engine, at = _engine(name, target, rank)
            stream_before = _snapshot(engine)["rng"].get("tensor_parallel")
            try:
                engine.load(_path(directory, source))
            except fxstar.CheckpointError as error:
                out[source, target] = {"model": at.model, "refused": str(error)}
                continue
            snapshot = _snapshot(engine)
            losses = _train(engine, name, at.rows, range(SAVED_AFTER, STEPS))
            out[source, target] = {"model": at.model, "state": snapshot, "losses": losses,
                                   "stream_before": stream_before}  # fmt: skip
            del engine
    return out


def _first_model(results: list[dict], key) -> list[dict]:
    """The runs of the ranks of the first model of a mesh, in rank order."""
    return [r[key] for r in results if r[key]["model"] == 0]


def _consolidated(snapshots: list[dict]) -> dict[str, dict[str, torch.Tensor]]:
    """The optimizer state of a model, each parameter's whole: the shards of the ranks glued by
    the pass's own `unshard` and the splits the pass recorded (checked against the parameters:
    each rank's shard is the whole parameter cut so)."""
    tp = snapshots[0]["tp"]
    held: dict[str, dict[int, dict]] = {}
    for snap in snapshots:
        for param, split in snap["splits"].items():
            whole, mine = snap["params"].get(param), snap["local"].get(param)
            if whole is not None and mine is not None:
                assert torch.equal(shard_of(whole, *split, tp, snap["tp_rank"]), mine), param
        for param, entry in snap["optimizer"].items():
            held.setdefault(param, {}).setdefault(snap["tp_rank"], entry)
    whole_state = {}
    for param, shards in held.items():
        split = snapshots[0]["splits"].get(param)
        assert split is not None or list(shards) == [0] or tp > 1, param
        whole_state[param] = {
            key: value if split is None or value.dim() == 0
            else unshard([shards[t][key] for t in range(tp)], *split)
            for key, value in shards[0].items()
        }  # fmt: skip
    return whole_state


def _same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), (what, sorted(a.keys() ^ b.keys()))
    for key, value in a.items():
        if isinstance(value, dict):
            _same(value, b[key], f"{what}.{key}")
        elif isinstance(value, torch.Tensor):
            assert torch.equal(value, b[key]), f"{what}.{key}"
        else:
            assert value == b[key], f"{what}.{key}"


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> _Matrix:
    return _Matrix(tmp_path_factory.mktemp("reshard"))


class _Matrix:
    """Every model's runs (the default pairs or the slow ones), one spawn for all of them, and
    the checkpoints they wrote."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._runs: dict[bool, list[dict]] = {}

    def runs(self, name: str, slow: bool) -> list[dict]:
        if slow not in self._runs:
            models = SLOW_PAIRS if slow else PAIRS
            if importlib.util.find_spec("transformers") is None:
                models = {k: v for k, v in models.items() if k == "gpt"}
            self._runs[slow] = spawn(_run, WORLD, models, str(self.directory / str(slow)))
        return [rank[name] for rank in self._runs[slow]]

    def checkpoint(self, name: str, slow: bool, mesh: str) -> str:
        self.runs(name, slow)
        return _path(str(self.directory / str(slow) / name), mesh)


def check_pair(results: list[dict], source: str, target: str) -> None:
    """Right after the load: the whole parameters, the consolidated optimizer state and the
    RNG states that carry over, the step counters and the loss scaler are the source's, bit
    for bit; then the losses go on."""
    saved, resumed = _first_model(results, source), _first_model(results, (source, target))
    assert "refused" not in resumed[0], resumed[0]
    _same(resumed[0]["state"]["params"], saved[0]["state"]["params"], "parameters")
    for run in resumed:
        _same(run["state"]["counters"], saved[0]["state"]["counters"], "counters")
    _same(_consolidated([r["state"] for r in resumed]),
          _consolidated([r["state"] for r in saved]), "optimizer")  # fmt: skip
    # the processes' generators: saved rank 0's on every rank
    for run in resumed:
        assert torch.equal(run["state"]["rng"]["torch"], saved[0]["state"]["rng"]["torch"])
    # a tensor-parallel stream: the same coordinate's at the same size, else the engine's own
    for run in resumed:
        stream = run["state"]["rng"].get("tensor_parallel")
        same_size = run["state"]["tp"] == saved[0]["state"]["tp"]
        want = (saved[run["state"]["tp_rank"]]["state"]["rng"]["tensor_parallel"] if same_size
                else run["stream_before"])  # fmt: skip
        assert (stream is None) == (want is None)
        if stream is not None:
            _same(stream, want, "tensor-parallel stream")
    # the mean loss over the model's replicas, step by step
    through = torch.tensor([r["losses"] for r in saved]).mean(0)
    after = torch.tensor([r["losses"] for r in resumed]).mean(0)
    rtol = LOSS_RTOL["fp16" if source.endswith("fp16") else "fp32"]
    torch.testing.assert_close(after, through, rtol=rtol, atol=0)


def _cases(pairs: dict, slow: bool) -> list:
    marks = [pytest.mark.slow] if slow else []
    return [pytest.param(name, s, t, slow, marks=marks, id=f"{name}-{s}-to-{t}")
            for name, listed in pairs.items() for s, t in listed
            if (s, t) not in REFUSED]  # fmt: skip


@pytest.mark.parametrize(("name", "source", "target", "slow"),
                         _cases(PAIRS, False) + _cases(SLOW_PAIRS, True))  # fmt: skip
def test_a_checkpoint_resumes_on_another_mesh(matrix, name, source, target, slow):
    if name != "gpt":
        pytest.importorskip("transformers")
    check_pair(matrix.runs(name, slow), source, target)


@pytest.mark.slow
def test_8bit_moments_are_refused_at_another_tensor_parallel_size(matrix):
    """Their blocks follow each rank's shard: the load names why, before anything changed."""
    for source, target in REFUSED:
        for run in _first_model(matrix.runs("gpt", True), (source, target)):
            assert "not its parameter's" in run["refused"] and "8-bit" in run["refused"]


def test_the_logical_state_glues_a_parameter_at_a_time(matrix, monkeypatch):
    """A tensor-parallel checkpoint's logical state: a split parameter's whole moments, glued
    from the ranks' shards (the other rank's read from its file, only that parameter's), equal
    the saving run's consolidated state; a state that is not per element is not cut."""
    checkpoint = fxstar.load(matrix.checkpoint("gpt", False, "1x2"))
    saved = _consolidated([r["state"] for r in _first_model(matrix.runs("gpt", False), "1x2")])
    reads = []
    read = logical_state._Deferred.read
    monkeypatch.setattr(logical_state._Deferred, "read",
                        lambda self, key: reads.append(key) or read(self, key))  # fmt: skip
    logical = LogicalState(checkpoint)
    assert reads == []
    name = "h.0.attn.c_attn.weight"  # q, k and v fused: each cut on its own
    assert logical.splits[name] == (0, 3)
    whole = logical.entry(name)
    index = [n for group in checkpoint.state["optimizer_params"] for n in group].index(name)
    assert sorted(reads) == [f"optimizer/state/{index}/{key}" for key in ("exp_avg", "exp_avg_sq")]
    _same(whole, saved[name], name)
    assert whole["exp_avg"].shape == checkpoint.parameters[name].shape
    quantised = {"exp_avg_absmax": torch.zeros(3)}  # 8-bit moments' blocks: not per element
    with pytest.raises(fxstar.CheckpointError, match="not its parameter's.*8-bit"):
        take_share(logical, name, quantised, (0, 3), 2, 0)
