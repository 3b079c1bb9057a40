"""HybridAdam with leaner moments (plan.optimizer.state_dtype 'bf16' and '8bit'): one step
against the C++ kernel run parameter by parameter and against torch's AdamW, on the host and
on chunks kept on the compute tier (both of its kernels); checkpoints bitwise, and converted
from another state dtype; data parallelism at world 2 against one process, bitwise; the
report's bytes; what is refused, by name."""

from pathlib import Path

import pytest
import torch
from conftest import activation_budget, tiny_gpt, tokens

import fxstar
from fxstar.checkpoint_values import check_state
from fxstar.dist_launch import spawn
from fxstar.errors import CheckpointError, PlanError
from fxstar.plan import Plan
from fxstar.runtime.moments import QUANT_BLOCK, AdamMoments
from fxstar.saving import STATE, restore_training_state, view_of

OPT = {"type": "adamw", "lr": 1e-2, "weight_decay": 0.1}
LEAN = ["bf16", "8bit"]


def gpt() -> torch.nn.Module:
    return tiny_gpt(dropout=0.0)


def roomy() -> int:
    """A budget whose margin keeps some chunks and their moments on the compute tier."""
    return activation_budget(gpt, 2.0, example_inputs=tokens())


def engine_for(state_dtype: str, *, kept: bool = False, **options) -> fxstar.Engine:
    plan = Plan(device_memory=roomy() if kept else "auto", hybrid_adam=kept, chunk_size=4096,
                optimizer={**OPT, "state_dtype": state_dtype}, **options)  # fmt: skip
    return fxstar.compile(gpt(), plan, example_inputs=tokens())


def train(engine, steps: range) -> list[torch.Tensor]:
    losses = []
    for step in steps:
        loss = engine(*tokens(seed=step))
        loss.backward()
        engine.step()
        losses.append(loss.detach().clone())
    return losses


def params(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.named_parameters()}


def states(engine) -> dict[str, dict[str, torch.Tensor]]:
    name_of = {id(p): n for n, p in engine.named_parameters()}
    return {name_of[id(p)]: {k: v.clone() for k, v in s.items()}
            for p, s in engine.optimizer.state.items()}  # fmt: skip


@pytest.mark.parametrize("where", ["host", "kept"])
@pytest.mark.parametrize("state_dtype", LEAN)
def test_one_step_is_the_kernel_on_each_parameter_and_near_torch_adamw(state_dtype, where):
    """The step through HybridAdam (runs merged across parameters, chunks kept on the compute
    tier or not) gives each parameter's bytes of the C++ kernel called on it alone from zero
    moments, and is torch's AdamW but for how the moments are stored."""
    engine = engine_for(state_dtype, kept=where == "kept")
    engine(*tokens()).backward()
    before = params(engine)
    grads = {n: p.grad.clone() for n, p in engine.named_parameters()}
    decays = {
        id(p) for g in engine.optimizer.param_groups if g["weight_decay"] for p in g["params"]
    }
    weight_decay = {n: OPT["weight_decay"] if id(p) in decays else 0.0
                    for n, p in engine.named_parameters()}  # fmt: skip
    assert engine.step()
    if where == "kept":
        assert engine.optimizer.device_chunks, "no chunk kept on the compute tier"
    moments = AdamMoments(state_dtype)
    got = states(engine)
    for name, param in engine.named_parameters():
        hyper = dict(step=1, lr=OPT["lr"], weight_decay=weight_decay[name])
        want, fresh = before[name].clone(), moments.fresh(before[name])
        moments.step(want.view(-1), grads[name].view(-1), moments.run(fresh, want.numel()),
                     **hyper)  # fmt: skip
        assert torch.equal(param, want), name
        for key in moments.keys:
            assert torch.equal(got[name][key], fresh[key]), (name, key)
        # torch's AdamW, its moments stored as this state dtype stores them
        reference = before[name].clone().requires_grad_()
        reference.grad = grads[name].clone()
        adamw = torch.optim.AdamW([reference], lr=OPT["lr"], weight_decay=weight_decay[name])
        adamw.step()
        torch.testing.assert_close(param, reference.detach(), rtol=1e-5, atol=1e-6)
        exp_avg, exp_avg_sq = moments.values(got[name])
        for value, key in ((exp_avg, "exp_avg"), (exp_avg_sq, "exp_avg_sq")):
            exact = adamw.state[reference][key].view(-1)
            if state_dtype == "bf16":  # rounded to nearest: half a bf16 ulp
                assert torch.all((value - exact).abs() <= exact.abs() * 2**-8), (name, key)
            else:  # the nearest code: half the widest step of the map, times the block's absmax
                pad = -exact.numel() % QUANT_BLOCK
                blocks = torch.nn.functional.pad(exact.abs(), (0, pad)).view(-1, QUANT_BLOCK)
                scale = blocks.amax(1).repeat_interleave(QUANT_BLOCK)[: exact.numel()]
                assert torch.all((value - exact).abs() <= 0.0071 * scale), (name, key)


@pytest.mark.parametrize("state_dtype", LEAN)
def test_kept_chunks_stepped_by_torch_follow_the_kernel(state_dtype):
    """The accelerator's path (torch's fused Adam over widened moments, run here on the CPU)
    against the C++ kernel over the same kept chunks."""
    runs = {}
    for kernel in ("cpu", "torch"):
        engine = engine_for(state_dtype, kept=True)
        engine.optimizer.device_kernel = kernel
        train(engine, range(3))
        assert engine.optimizer.device_chunks
        runs[kernel] = params(engine)
    for name, want in runs["cpu"].items():
        torch.testing.assert_close(runs["torch"][name], want, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("state_dtype", LEAN)
def test_moments_move_between_the_tiers_as_they_are(state_dtype):
    """Chunks kept on the compute tier (stepped there by the same C++ kernel), given back to
    the host tier after two steps, and trained on: bitwise the run that kept none."""
    moved, host = engine_for(state_dtype, kept=True), engine_for(state_dtype)
    moved_losses = train(moved, range(2))
    kept = list(moved.optimizer.device_chunks)
    assert kept and moved.optimizer.give_back(0) == kept[::-1]
    moved_losses += train(moved, range(2, 4))
    assert torch.equal(torch.stack(moved_losses), torch.stack(train(host, range(4))))
    after, want = params(moved), params(host)
    assert all(torch.equal(after[n], want[n]) for n in want)
    got, expected = states(moved), states(host)
    assert all(torch.equal(got[n][k], v) for n in expected for k, v in expected[n].items())


@pytest.mark.parametrize("state_dtype", LEAN)
def test_a_checkpoint_resumes_bitwise_with_its_moments_in_their_dtype(state_dtype, tmp_path):
    engine = engine_for(state_dtype, kept=True)
    train(engine, range(2))
    engine.save(tmp_path / "ckpt")
    saved = states(engine)
    resumed = engine_for(state_dtype, kept=True)
    resumed.load(tmp_path / "ckpt")
    got = states(resumed)
    assert got.keys() == saved.keys()
    for name, entry in saved.items():
        for key, value in entry.items():
            assert got[name][key].dtype == value.dtype, (name, key)
            assert torch.equal(got[name][key], value), (name, key)
    assert resumed.optimizer.device_chunks == engine.optimizer.device_chunks
    assert torch.equal(torch.stack(train(engine, range(2, 4))),
                       torch.stack(train(resumed, range(2, 4))))  # fmt: skip
    after, again = params(engine), params(resumed)
    assert all(torch.equal(after[n], again[n]) for n in after)


@pytest.mark.parametrize(("saved", "into"), [("fp32", "8bit"), ("8bit", "bf16")])
def test_a_checkpoint_of_another_state_dtype_is_converted(saved, into, tmp_path):
    """Loaded as the fp32 values the saved moments stand for, stored as `into` stores them."""
    engine = engine_for(saved)
    train(engine, range(2))
    engine.save(tmp_path / "ckpt")
    other = engine_for(into)
    other.load(tmp_path / "ckpt")
    moments, by_name = AdamMoments(into), dict(engine.named_parameters())
    got = states(other)
    for name, entry in states(engine).items():
        want = moments.fresh(by_name[name])
        moments.load(want, entry)
        for key in moments.keys:
            assert torch.equal(got[name][key], want[key]), (name, key)
    train(other, range(2, 3))  # and it trains on


@pytest.mark.parametrize(
    ("key", "change", "message"),
    [
        ("exp_avg_absmax", lambda t: torch.cat([t, t]), "must hold one absmax per block"),
        ("exp_avg_sq_absmax", lambda t: -t - 1, "a block's absmax is finite and not negative"),
        ("exp_avg_codes", lambda t: t.float(), "must be a torch.uint8 tensor"),
        ("exp_avg_sq_codes", lambda t: t.view(-1)[:1], "must have its parameter's shape"),
    ],
)  # fmt: skip
def test_8bit_moments_that_do_not_fit_are_refused_before_anything_is_restored(key, change,
                                                                              message):  # fmt: skip
    engine = engine_for("8bit")
    train(engine, range(1))
    state = engine.training_state()
    before = states(engine)
    saved = state["optimizer"]["state"]
    index = next(iter(saved))
    saved[index] = {**saved[index], key: change(saved[index][key])}  # the live one is torch's
    with pytest.raises(CheckpointError, match=f"{key}: {message}"):
        # what loading does with a checkpoint's training state: its values checked as read,
        # then against the engine, then restored
        check_state(state, Path(STATE))
        restore_training_state(view_of(engine), state)
    after = states(engine)
    assert all(torch.equal(after[n][k], v) for n in before for k, v in before[n].items())


def test_report_and_host_budget_count_the_moments_bytes():
    lines = {}
    for state_dtype in ("fp32", "bf16", "8bit"):
        engine = engine_for(state_dtype)
        train(engine, range(1))
        report = engine.report()
        lines[state_dtype] = next(x for x in report.splitlines() if x.startswith("host memory"))
        nbytes, count = engine.optimizer.state_bytes()["host"]
        assert count == sum(p.numel() for p in engine.parameters())
        line = f"optimizer state: {state_dtype} Adam moments, {nbytes:,} bytes on the host tier"
        assert line in report
        low, high = {"fp32": (8, 8), "bf16": (4, 4), "8bit": (2, 2.1)}[state_dtype]
        assert low <= nbytes / count <= high, nbytes / count
    assert len(set(lines.values())) == 3  # the host budget's line counts them too


def test_lean_state_is_refused_where_it_cannot_apply():
    with pytest.raises(PlanError, match="optimizer.state_dtype: '8bit' needs HybridAdam"):
        Plan(optimizer={"state_dtype": "8bit"})  # no chunks: torch's AdamW
    with pytest.raises(PlanError, match="optimizer.state_dtype: 'bf16' is for Adam's moments"):
        Plan(device_memory="1MiB", optimizer={"type": "sgd", "state_dtype": "bf16"})
    with pytest.raises(PlanError, match="must be one of 'fp32', 'bf16', '8bit', got 'int8'"):
        Plan(device_memory="1MiB", optimizer={"state_dtype": "int8"})


# -- data parallel ------------------------------------------------------------------------------

DATA_PARALLEL = {
    "8bit sharded": {"optimizer": {**OPT, "state_dtype": "8bit"}},
    "bf16 replicated": {"optimizer": {**OPT, "state_dtype": "bf16"},
                        "data_parallel_shard": "optimizer"},
}  # fmt: skip


def data_parallel_run(case: str) -> dict[str, torch.Tensor]:
    """Three steps of every rank on the same whole batch: the average of equal gradients is
    each of them exactly, so any difference from one process is the optimizer's."""
    plan = Plan(device_memory="auto", chunk_size=4096, **DATA_PARALLEL[case])
    engine = fxstar.compile(gpt(), plan, example_inputs=tokens())
    train(engine, range(3))
    return {n: p.detach().clone() for n, p in engine.state_dict().items()}


def _ranks(rank: int, world: int) -> dict:
    return {case: data_parallel_run(case) for case in DATA_PARALLEL}


def test_data_parallel_world_2_steps_as_one_process_bitwise():
    """Each rank steps its own chunks' moments; an 8-bit moment's blocks are its parameter's,
    so how the chunks fall to the ranks changes no byte."""
    ranks = spawn(_ranks, 2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: a matmul's sums follow its threads
    try:
        alone = {case: data_parallel_run(case) for case in DATA_PARALLEL}
    finally:
        torch.set_num_threads(threads)
    for case in DATA_PARALLEL:
        for rank, run in enumerate(ranks):
            for name, want in alone[case].items():
                assert torch.equal(run[case][name], want), (case, rank, name)
