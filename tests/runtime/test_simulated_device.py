"""The runtime's asynchronous paths on the simulated device (fxstar.testing.SimulatedDevice),
bit for bit against the same plan on the plain CPU: losses, gradients, parameters and
buffers. On the simulated device every copy between the tiers runs later on a worker thread
and its destination reads as NaN until it has, so a wait the runtime forgot shows as a wrong
value here instead of passing by luck. The engine is put on it with
`fxstar.runtime.device.using_device`; the device then turns prefetch and overlapped gradient
copies on, as a card does ('auto'), while the CPU run has both off.

Mutations: each wait the runtime makes was removed in turn, these tests run, and the wait
restored; what failed (B: test_bitwise_against_the_cpu[case], by case):
- residency.Residency.load, the current stream waits for a load's copy at once: B[overlapped
  gradient copies bf16, accumulated], B[kept chunks bf16], the checkpoint test, data parallel
  (the rooms holding gradients rounded in, a kept chunk's fix, a collective on the block).
- Residency._arrived, a prefetch's copy waited for at its access or eviction: B[prefetch under
  a tight budget], B[overlapped gradient copies] and both bf16 cases, checkpoint, data parallel.
- Residency._copied's `current.wait_event(done)` (both of the above): every whole-step test
  (each B case, checkpoint, data parallel).
- Residency.copy to the host, `done.synchronize()`: data parallel (sharded gradients taken at
  once from the reduced buffer).
- GradAccumulator.wait, `done.synchronize()` per copy: every test (elapsed_time refuses an
  event not completed, as CUDA does, and the gradients read poison).
- GradAccumulator, backward's end waits (queue_callback): B[activation offload and its
  prefetch] (elsewhere the tied embedding's second gradient, last in backward, waits first).
- GradAccumulator.take, the wait before adding a second gradient (fp32; bf16/fp16): the
  second-gradient test of that dtype.
- GradAccumulator.zero_grad's wait, ChunkManager._begin's and ChunkManager.close's: the
  zero_grad, next-step and close tests after a backward that raised.
- Engine.step's wait for the gradient copies (StepChunks.wait_for_grads, before the update
  reads them): test_engine_step_after_a_backward_that_raised_steps_the_gradients_that_arrived.
- HybridAdam.step's StepChunks.wait_for_grads (the first wait for a loop that steps
  engine.optimizer itself, where engine.step() has waited already; ChunkGroups.reduce_to_owners
  relies on it): test_the_optimizers_own_step_after_a_backward_that_raised_steps_what_arrived
  and data parallel (replicated, the optimizer's step after a backward that raised on every
  rank).
- Engine.gradients' wait for the gradient copies:
  test_gradients_read_after_a_backward_that_raised_are_those_that_arrived (a parameter's
  `.grad` read directly, a view of a chunk's gradient buffer, has no call to wait in).
- StepChunks.give_back's wait (a kept chunk given back between steps), and its unpin_all:
  test_kept_chunk_given_back_right_after_a_backward_that_raised_on_the_cpu_copy_thread, on
  the plain CPU, where a kept chunk's gradients are copied on the worker thread too. On the
  simulated device, as on a card, they are added on the current stream, so the copies a
  backward that raised leaves in flight write only host-tier buffers of chunks not kept,
  which give_back neither reads nor writes: the simulated test of it fails without the
  unpin_all only.
- offload._Handle.take, `current.wait_event`: B[activation offload and its prefetch].
- ChunkGroups.arrived, the wait for a prefetch's gather (Residency._arrived): data parallel
  (an asynchronous collective's destination reads as poison until its wait:
  SimulatedDevice.collective).
- tensor parallel's overlapped collectives (tp_ops, each `.wait()` of an async_op): the column
  linear's forward gather, its backward all-reduce (T[tensor parallel]), re-gather and
  reduce-scatter, the row linear's backward gather and bias all-reduce (T[tensor parallel,
  sequence]); T: test_tensor_parallel_overlapped_collectives_world_2.
Not a wait, the budget's audit (Residency._audit_budget, on every access here): each moment's
share not leaving room for the sharded gradient staging (Residency.share): data parallel
(chunks, activations and staging over the budget at a backward access).
Not caught here:
- Device.copy_after's `side.wait_stream(current)` (every copy after what the current stream
  queued): GPU only. The simulated current stream runs its work before returning, so there is
  nothing queued for a side stream to wait for.
- `record_stream` (offload, copy_after): GPU only; it keeps the caching allocator from reusing
  memory, and the simulated device's queued work holds its tensors alive.
- StepChunks.gradients_reduced's wait (sharded payloads): nothing is in flight there, on any
  device. Every gradient goes to GradShards, whose reductions hand the owner's share to
  GradAccumulator.take with at_once, a copy done before it returns. Data parallel's sharded
  case steps after a backward that raised with units still staged, which that step reduces.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import pytest
import torch
from conftest import SEQ, example, tiny_gpt, tokens
from torch import nn

import fxstar
from fxstar.dist_launch import spawn
from fxstar.passes.chunk_layout import nonmodel_peak
from fxstar.plan import Plan
from fxstar.runtime import grad_copies
from fxstar.runtime.arena import PooledBlocks
from fxstar.runtime.chunks import ChunkManager
from fxstar.runtime.device import using_device
from fxstar.runtime.grad_copies import GradAccumulator
from fxstar.runtime.layout import AccessPlan, ChunkLayout, ChunkSpec, ParamSlot
from fxstar.testing.async_device import SimulatedDevice

OPT = {"type": "adamw", "lr": 1e-2, "weight_decay": 0.1}
STEPS = 3
DATA_PARALLEL = {"chunk_size": 4096, "optimizer": {**OPT, "clip_grad_norm": 0.5}}
# every copy lands 2 to 5 ms after it could have run: longer than the compute between a
# prefetch and its access here, so what reads a copy it did not wait for reads NaN
DELAYS = {"min_delay": 2e-3, "max_delay": 5e-3}


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
    if case.startswith("tensor parallel"):  # world 2: overlapped collectives (nanotron's)
        sequence = "sequence" in case  # gathers and reduce-scatters, else all-reduces
        tp = {"size": 2, "async_communication": True, "sequence_parallel": sequence}
        return {"tensor_parallel": tp, "optimizer": OPT}
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


def train(engine, steps: range, record: list, seq: int = SEQ) -> None:
    """Seeded steps (dropout draws alike); the loss and a snapshot before and after each
    optimizer step into `record`."""
    micro = engine.plan.optimizer.accumulation_steps
    for step in steps:
        for i in range(micro):
            ids, targets = tokens(seed=step * micro + i, seq=seq)
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
        if engine.chunks is not None:
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
        groups = manager.data_parallel if manager is not None else None
        offload = engine.program.decisions.offload_activations
        facts = {
            "evictions": manager is not None and manager.stats.evictions,
            "prefetch hits": manager is not None and manager.stats.prefetch_hits,
            "overlapped": manager is not None and manager.grad_copy_overlap() is not None,
            "kept": len(getattr(engine.optimizer, "device_chunks", ())),
            "offload prefetched": 0 if offload is None else offload.stats.prefetched,
            "group loads": manager is not None and manager.residency.load_unit > 1,
            "gradients staged": groups is not None and groups.peak_staging_bytes > 0,
            # the staging the plan leaves room for at every moment bounds what was staged
            "staging within its room": groups is not None
            and 0 < groups.peak_staging_bytes <= engine.program.decisions.chunk_plan.staging_bytes,
            "replicated": groups is not None and not groups.sharded,
            "collectives landed at their wait": device is not None and device.collectives > 0,
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
    "data parallel sharded": (
        "evictions",
        "group loads",
        "staging within its room",
        "collectives landed at their wait",
    ),
    "data parallel replicated": ("evictions", "overlapped", "replicated"),
    "tensor parallel": ("collectives landed at their wait",),
    "tensor parallel, sequence": ("collectives landed at their wait",),
}


def check(case: str, *, checkpoint_dir=None) -> None:
    """The case on the simulated device exercised what it is named for and trained bit for
    bit as on the CPU."""
    with SimulatedDevice(seed=1, **DELAYS) as device:
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
    data_parallel_after_a_raised_backward()


def test_data_parallel_world_2():
    """Both cases as on the CPU; then each with a backward that raised on every rank, and
    the optimizer's step after it (one spawn: the workers' start is most of the time)."""
    spawn(_data_parallel, 2)


def _tensor_parallel(rank: int, world: int) -> None:
    for case in TENSOR_PARALLEL:
        check(case)


TENSOR_PARALLEL = [c for c in EXERCISED if c.startswith("tensor parallel")]


def test_tensor_parallel_overlapped_collectives_world_2():
    """Each overlapped collective's destination reads as poison until its wait: the
    column linear's gather in forward, its all-reduce or reduce-scatter and re-gather in
    backward."""
    spawn(_tensor_parallel, 2)


# -- the gradient copies' waits a whole step cannot reach: a slot's second gradient in one
# backward, and what a backward that raised leaves in flight. A manager of two chunks of one
# 8x8 parameter each, on a device whose copies land 20 ms late.

N = 64


def two_chunks(device: SimulatedDevice, dtype: torch.dtype) -> ChunkManager:
    specs = [ChunkSpec(i, [ParamSlot(f"p{i}", (f"p{i}",), i, 0, (8, 8), True)], N)
             for i in range(2)]  # fmt: skip
    layout = ChunkLayout(N, dtype, specs)
    params = {f"p{i}": torch.full((8, 8), float(i + 1)) for i in range(2)}
    return ChunkManager(layout, params, budget=2 * layout.chunk_bytes,
                        arena_capacity=2 * layout.chunk_bytes, device=device,
                        overlap_grad_copies=True)  # fmt: skip


def late() -> SimulatedDevice:
    return SimulatedDevice(seed=2, min_delay=0.02, max_delay=0.02)


def forward(m: ChunkManager, order: list[int]) -> list[torch.Tensor]:
    """Each access's parameter leaf (a chunk fetched twice gives two leaves of one slot)."""
    leaves = []
    for c in order:
        leaves.append(m.fetch(c)[f"p{c}"])
        m.release(c)
    return leaves


class RaiseInBackward(torch.autograd.Function):
    """The identity, whose backward raises while `armed` (see `raising`)."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if RaiseInBackward.armed:
            raise RuntimeError("backward raised")
        return grad


@contextlib.contextmanager
def raising():
    """Backward raises at RaiseInBackward, and the caller catches it (as a training loop that
    goes on after a failed backward does)."""
    RaiseInBackward.armed = True
    try:
        with pytest.raises(RuntimeError, match="backward raised"):
            yield
    finally:
        RaiseInBackward.armed = False


def grad_of(m: ChunkManager, name: str) -> torch.Tensor:
    return m.slot_grad(m.layout.slots()[name]).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_second_gradient_in_one_backward_adds_to_what_the_first_copy_brought(dtype):
    with late() as device:
        m = two_chunks(device, dtype)
        order = [0, 1, 0]
        with m.running(AccessPlan(order, ["forward"] * 3, [0] * 3, [1] * 3)):
            first, _, second = forward(m, order)
            (first * 2 + second * 3).float().sum().backward()
        assert torch.equal(grad_of(m, "p0"), torch.full((8, 8), 5.0))
        m.close()


def raised_backward(m: ChunkManager) -> None:
    """A backward whose first gradient copy (chunk 0's) is in flight when it raises: its
    end-of-graph wait never runs."""
    with m.running(AccessPlan([1, 0], ["forward"] * 2, [0] * 2, [1] * 2)):
        w1, w0 = forward(m, [1, 0])
        loss = RaiseInBackward.apply(w1).sum() + (w0 * 2).sum()  # w0's gradient comes first
        with raising():
            loss.backward()


def test_zero_grad_after_a_backward_that_raised_leaves_zeros():
    with late() as device:
        m = two_chunks(device, torch.float32)
        raised_backward(m)
        m.zero_grad(set_to_none=False)
        device.synchronize()  # a copy zero_grad did not wait for has landed by now
        assert torch.count_nonzero(m.stable["p0"].grad) == 0
        m.close()


def test_the_step_after_a_backward_that_raised_waits_for_its_copies():
    """The next backward's copies are waited for at its end as ever (the raised one's end
    never ran to wait, and to ask for the next wait)."""
    with late() as device:
        m = two_chunks(device, torch.float32)
        raised_backward(m)
        with m.running(AccessPlan([1], ["forward"], [0], [1])):
            (w1,) = forward(m, [1])
            (w1 * 4).sum().backward()
        assert torch.equal(grad_of(m, "p1"), torch.full((8, 8), 4.0))
        m.close()


def test_close_after_a_backward_that_raised_keeps_the_gradients_that_arrived():
    with late() as device:
        m = two_chunks(device, torch.float32)
        raised_backward(m)
        m.close()
        assert torch.equal(m.stable["p0"].grad, torch.full((8, 8), 2.0))


# -- a whole engine after a backward that raised midway: what backward's end would have waited
# for is still in flight, and the next thing the user calls must wait. The tiny GPT's backward
# raises at its last block's input (its Function kept whole through capture); the same
# sequence on the plain CPU is the reference.


class RaisesAtItsInput(nn.Module):
    """A block whose input's gradient is RaiseInBackward's: armed, backward stops once the
    head's, the final norm's and this block's gradients are handed over (their copies in
    flight), before the tied embedding's second gradient and the earlier blocks' come."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(RaiseInBackward.apply(x))


def gpt_raising_in_backward() -> nn.Module:
    model = tiny_gpt()
    model.h[-1] = RaisesAtItsInput(model.h[-1])
    return model


def after_a_raised_backward(options: dict, device: SimulatedDevice | None, then, *,
                            steps_around: int = 0, first_seq: int = SEQ) -> dict:  # fmt: skip
    """`steps_around` steps on batches of `first_seq` tokens, one whose backward raises,
    `then(engine)`, the parameters and buffers, and `steps_around` steps on full-length
    batches: the record, and what the run exercised."""
    record: list = []
    facts: dict = {}
    with on(device):
        engine = fxstar.compile(gpt_raising_in_backward(), Plan(**options),
                                **example("gpt", *tokens(seq=first_seq)))  # fmt: skip
        engine.chunks.checking = True
        train(engine, range(steps_around), record, seq=first_seq)
        facts["kept"] = list(getattr(engine.optimizer, "device_chunks", ()))
        ids, targets = tokens(seed=steps_around, seq=first_seq)
        torch.manual_seed(steps_around)
        loss = engine(ids, targets)
        with raising():
            loss.backward()
        del loss  # its graph: activations the next step's budget has no room for
        shards = engine.chunks.grads.shards
        facts["units staged"] = shards is not None and len(shards.staged) > 0
        then(engine)
        record.append([t.detach().clone() for t in engine.state_dict().values()])
        train(engine, range(steps_around + 1, 2 * steps_around + 1), record)
        facts["overlapped"] = engine.chunks.grad_copy_overlap() is not None
        facts["given back"] = list(getattr(engine.optimizer, "given_back", ()))
        if device is not None:
            device.synchronize()
        engine.close()
    return {"record": record, "facts": facts}


def check_after_a_raised_backward(options: dict, then, **steps) -> dict:
    """Bit for bit as on the CPU; what the simulated run exercised. Copies land 20 ms late:
    the last of those a raised backward left lands some 300 ms after it, later than a loaded
    machine takes to reach what reads it."""
    with late() as device:
        simulated = after_a_raised_backward(options, device, then, **steps)
    on_the_cpu = after_a_raised_backward(options, None, then, **steps)
    assert_bitwise(simulated["record"], on_the_cpu["record"])
    return simulated["facts"]


def test_engine_step_after_a_backward_that_raised_steps_the_gradients_that_arrived():
    facts = check_after_a_raised_backward(options("overlapped gradient copies"),
                                          lambda engine: engine.step())  # fmt: skip
    assert facts["overlapped"]


def step_the_optimizer(engine) -> None:
    """A loop that drives the optimizer itself: HybridAdam reduces to the owners in its step."""
    engine.optimizer.step()
    engine.zero_grad()


def test_the_optimizers_own_step_after_a_backward_that_raised_steps_what_arrived():
    """A loop that steps engine.optimizer itself (no engine.step, no data parallelism): the
    update waits for the gradient copies the raised backward left in flight."""
    facts = check_after_a_raised_backward(options("overlapped gradient copies"),
                                          step_the_optimizer)  # fmt: skip
    assert facts["overlapped"]


def test_gradients_read_after_a_backward_that_raised_are_those_that_arrived():
    seen = []

    def read(engine) -> None:
        seen.append({n: g.clone() for n, g in engine.gradients().items() if g is not None})
        engine.zero_grad()

    facts = check_after_a_raised_backward(options("overlapped gradient copies"), read)
    simulated, on_the_cpu = seen
    assert facts["overlapped"] and simulated.keys() == on_the_cpu.keys() and simulated
    assert all(torch.equal(simulated[n], on_the_cpu[n]) for n in simulated)


def data_parallel_after_a_raised_backward() -> None:
    """In test_data_parallel_world_2's workers: every rank's backward raised alike."""
    sharded = check_after_a_raised_backward(options("data parallel sharded"), step_the_optimizer)
    assert sharded["units staged"]  # left by the backward that raised: reduced by the step
    replicated = check_after_a_raised_backward(options("data parallel replicated"),
                                               step_the_optimizer)  # fmt: skip
    assert replicated["overlapped"]


def given_back(device: SimulatedDevice | None, **options) -> dict:
    """Chunks kept at a step on 8 tokens; a backward that raised; the next forward, on 16
    tokens, has room for fewer: one goes back to the host tier before it begins, the copies
    the raised backward left still in flight."""
    plan = {"device_memory": budget(1.5), "optimizer": OPT, **options}
    run = after_a_raised_backward(plan, device, lambda engine: None, steps_around=1,
                                  first_seq=8)  # fmt: skip
    facts = run["facts"]
    assert facts["given back"] and set(facts["given back"]) < set(facts["kept"]), facts
    return run


def test_kept_chunk_given_back_right_after_a_backward_that_raised():
    with SimulatedDevice(seed=1, **DELAYS) as device:
        simulated = given_back(device)
    assert_bitwise(simulated["record"], given_back(None)["record"])


def hold_the_copy_thread(monkeypatch) -> None:
    """On the plain CPU, gradient copies beside backward run on a worker thread: here each
    lands only when GradAccumulator.wait asks for it (or after 10 s), the latest a correct
    program allows, so what reads a buffer without that wait reads what it held before."""
    release = threading.Event()
    copy, wait = grad_copies.copy_payload, GradAccumulator.wait

    def held_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        release.wait(10)
        copy(dst, src)

    def releasing_wait(self: GradAccumulator) -> None:
        release.set()
        try:
            wait(self)
        finally:
            release.clear()

    monkeypatch.setattr(grad_copies, "copy_payload", held_copy)
    monkeypatch.setattr(GradAccumulator, "wait", releasing_wait)


def test_kept_chunk_given_back_right_after_a_backward_that_raised_on_the_cpu_copy_thread(
    monkeypatch,
):
    """The plain CPU with gradient copies beside backward: a kept chunk's gradients go
    through the worker thread too (on the simulated device, as on a card, they are added on
    the current stream), and give_back waits for them."""
    hold_the_copy_thread(monkeypatch)
    overlapped = given_back(None, overlap_grad_copies="on")
    assert overlapped["facts"]["overlapped"]
    assert_bitwise(overlapped["record"], given_back(None)["record"])


# Dynamic partition: on the simulated device, as on a card, chunk blocks are tensors of the
# device's allocator (arena.PooledBlocks), and every access asserts that the chunks resident,
# the blocks kept beside them and the activations alive fit the budget.


def test_chunk_blocks_come_from_the_devices_allocator_and_go_back_to_it():
    with late() as device:
        m = two_chunks(device, torch.float32)
        assert isinstance(m.arena, PooledBlocks)
        with m.running(AccessPlan([0, 1], ["forward"] * 2, [0, 0], [1, 1])):
            leaves = forward(m, [0, 1])
        assert [leaf[0, 0].item() for leaf in leaves] == [1.0, 2.0]
        assert m.arena.held_bytes() == 2 * m.layout.chunk_bytes
        m.residency.drop_unused()
        assert m.arena.held_bytes() == 0 and not m.arena.blocks
        m.close()


def test_the_budget_audit_fails_when_activations_leave_the_chunks_no_room():
    """A plan that says nothing lives besides chunks while activations do: the chunks take the
    whole budget, and the audit names the access."""
    with late() as device:
        m = two_chunks(device, torch.float32)
        alive = m.tracer.saved(torch.zeros(8))  # 32 bytes besides chunks, counted
        plan = AccessPlan([0, 1], ["forward"] * 2, [0, 0], [1, 1])
        with pytest.raises(AssertionError, match="access 1: .* exceed the budget"), m.running(plan):
            forward(m, [0, 1])
        del alive
        m.close()
