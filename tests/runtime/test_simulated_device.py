"""The runtime's asynchronous paths on the simulated device (fxstar.testing.SimulatedDevice),
bit for bit against the same plan on the plain CPU: losses, gradients, parameters and
buffers. On the simulated device every copy between the tiers runs later on a worker thread
and its destination reads as NaN until it has, so a wait the runtime forgot shows as a wrong
value here instead of passing by luck. The engine is put on it with
`fxstar.runtime.device.using_device`; the device then turns prefetch and overlapped gradient
copies on, as a card does ('auto'), while the CPU run has both off.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from conftest import example, tiny_gpt, tokens

import fxstar
from fxstar.dist_launch import spawn
from fxstar.passes.chunk_layout import nonmodel_peak
from fxstar.plan import Plan
from fxstar.runtime.device import using_device
from fxstar.testing.async_device import SimulatedDevice

OPT = {"type": "adamw", "lr": 1e-2, "weight_decay": 0.1}
STEPS = 3
DATA_PARALLEL = {"chunk_size": 4096, "optimizer": {**OPT, "clip_grad_norm": 0.5}}


@functools.cache
def budget(share: float, precision: str = "fp32") -> int:
    """The activations' measured peak plus `share` of the parameter bytes (0.4: paged; 2:
    room to keep some chunks with their optimizer state)."""
    plan = Plan(precision=precision, passes=["shape_memory"])
    program = fxstar.compile(tiny_gpt(), plan, **example("gpt", *tokens())).program
    return nonmodel_peak(program) + int(share * program.param_bytes)


def options(case: str) -> dict:
    if case == "data parallel sharded":  # world 2: group gathers, gradients staged and
        return {**DATA_PARALLEL, "device_memory": "auto"}  # reduced to their owners
    if case == "data parallel replicated":  # every rank's copies, the owners' updates shared
        return {**DATA_PARALLEL, "device_memory": "auto", "data_parallel_shard": "optimizer"}
    tight = {"device_memory": budget(0.4), "optimizer": OPT, "hybrid_adam": False}
    return {
        "prefetch under a tight budget": tight,
        "overlapped gradient copies": {**tight, "overlap_grad_copies": "on"},
        # bf16: gradients in the payloads' room, reloaded with their slots' masters rounded
        # in; two micro-batches: later gradients add into what the copies brought
        "overlapped gradient copies bf16, accumulated": {  # bf16 chunks: half the bytes
            **tight, "device_memory": budget(0.4, "bf16"), "precision": "bf16",
            "optimizer": {**OPT, "accumulation_steps": 2},
        },
        "activation offload and its prefetch": {
            **tight, "checkpoint": "blocks", "offload_activations": True,
        },
        "kept chunks bf16": {
            "device_memory": budget(2.0), "precision": "bf16", "optimizer": OPT,
        },
    }[case]  # fmt: skip


CASES = [
    "prefetch under a tight budget",
    "overlapped gradient copies",
    "overlapped gradient copies bf16, accumulated",
    "activation offload and its prefetch",
    "kept chunks bf16",
]


def snapshot(engine) -> list[torch.Tensor]:
    """Every parameter, gradient and buffer the engine shows, cloned."""
    grads = [p.grad.clone() for p in engine.parameters() if p.grad is not None]
    state = [t.detach().clone() for t in engine.state_dict().values()]
    return grads + state


def train(engine, steps: range, record: list) -> None:
    """Seeded steps (dropout draws alike); the loss and a snapshot before and after each
    optimizer step into `record`."""
    micro = engine.plan.optimizer.accumulation_steps
    for step in steps:
        for i in range(micro):
            ids, targets = tokens(seed=step * micro + i)
            torch.manual_seed(step * micro + i)
            loss = engine(ids, targets)
            loss.backward()
            record.append(loss.detach().clone())
        record.append(snapshot(engine))
        engine.step()
        record.append(snapshot(engine))


@contextlib.contextmanager
def on(device: SimulatedDevice | None):
    with using_device(device) if device is not None else contextlib.nullcontext():
        yield


def run(case: str, device: SimulatedDevice | None, *, checkpoint_dir=None) -> dict:
    """The case's steps on `device` (None: the plain CPU); with `checkpoint_dir`, a save
    after the second step and a load of it after the third, then the third again."""
    plan = Plan(**options(case))
    record: list = []
    with on(device):
        engine = fxstar.compile(tiny_gpt(), plan, **example("gpt", *tokens()))
        engine.chunks.checking = True  # the residency's invariants at every access
        train(engine, range(2), record)
        if checkpoint_dir is not None:
            engine.save(checkpoint_dir / "ckpt")
            train(engine, range(2, 3), record)
            engine.load(checkpoint_dir / "ckpt")
        train(engine, range(2, STEPS), record)
        if device is not None:
            device.synchronize()  # what failed on a worker thread is raised here
        manager = engine.chunks
        groups = manager.data_parallel
        offload = engine.program.decisions.offload_activations
        facts = {
            "evictions": manager.stats.evictions,
            "prefetch hits": manager.stats.prefetch_hits,
            "overlapped": manager.grad_copy_overlap() is not None,
            "kept": len(engine.optimizer.device_chunks),
            "offload prefetched": 0 if offload is None else offload.stats.prefetched,
            "group loads": manager.residency.load_unit > 1,
            "gradients staged": groups is not None and groups.peak_staging_bytes > 0,
            "replicated": groups is not None and not groups.sharded,
        }
        engine.close()
    return {"record": record, "facts": facts}


def assert_bitwise(got: list, want: list) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if isinstance(a, list):
            assert len(a) == len(b), i
            for j, (x, y) in enumerate(zip(a, b, strict=True)):
                assert torch.equal(x, y), (i, j)
        else:
            assert torch.equal(a, b), (i, a, b)


# what each case must have exercised on the simulated device
EXERCISED = {
    "prefetch under a tight budget": ("evictions", "prefetch hits"),
    "overlapped gradient copies": ("evictions", "overlapped"),
    "overlapped gradient copies bf16, accumulated": ("evictions", "overlapped"),
    "activation offload and its prefetch": ("offload prefetched",),
    "kept chunks bf16": ("kept",),
    "data parallel sharded": ("evictions", "group loads", "gradients staged"),
    "data parallel replicated": ("evictions", "overlapped", "replicated"),
}


def check(case: str, *, checkpoint_dir=None) -> None:
    """The case on the simulated device exercised what it is named for and trained bit for
    bit as on the CPU."""
    with SimulatedDevice(seed=1, max_delay=1e-3) as device:
        simulated = run(case, device, checkpoint_dir=checkpoint_dir)
    assert all(simulated["facts"][fact] for fact in EXERCISED[case]), simulated["facts"]
    assert_bitwise(simulated["record"], run(case, None, checkpoint_dir=checkpoint_dir)["record"])


@pytest.mark.parametrize("case", CASES)
def test_bitwise_against_the_cpu(case):
    check(case)


def test_checkpoint_save_and_load_while_chunks_are_resident(tmp_path):
    """Saved after two steps with chunks resident and kept (their homes on the compute
    tier), loaded after a third, the third again: as on the CPU."""
    check("kept chunks bf16", checkpoint_dir=tmp_path)


def _data_parallel(rank: int, world: int) -> None:
    for case in ("data parallel sharded", "data parallel replicated"):
        check(case)


def test_data_parallel_world_2():
    spawn(_data_parallel, 2)
