"""bf16/fp16 gradients in the room of their chunk's host payload (PatrickStar's layout): the
same training as with gradient buffers of their own, bit for bit, at 2 fewer bytes per
parameter; a gradient the step overwrote is an error to read, never a value."""

import pytest
import torch
from conftest import activation_budget, call, example, hf_llama, tiny_gpt, tokens

from fxstar.engine import compile
from fxstar.plan import Plan
from fxstar.runtime.grad_copies import GradientConsumedError
from fxstar.runtime.residency import Residency

OPT = {"type": "adamw", "lr": 1e-3, "weight_decay": 0.1}
FACTORIES = {"gpt": tiny_gpt, "llama": hf_llama}


def budget(kind: str, share: float) -> int:
    return activation_budget(FACTORIES[kind], share, **example(kind, *tokens()))


def run(kind: str, grads_in_host: bool, *, micro_batches: int, squeeze: bool,
        spy: list | None = None, **plan):  # fmt: skip
    """Three optimizer steps of `micro_batches` each; the losses and the parameters. Squeezed,
    the chunks share 4 chunks' bytes (static_share): evictions throughout."""
    plan = Plan(optimizer={**OPT, "accumulation_steps": micro_batches},
                grads_in_host=grads_in_host, **plan)  # fmt: skip
    engine = compile(FACTORIES[kind](), plan, **example(kind, *tokens()))
    if squeeze:
        for program in engine.programs.values():
            program.decisions.chunk_plan.static_share = 4 * engine.chunks.layout.chunk_bytes
    if spy is not None:  # which loads found gradients in their chunk's host room
        load = Residency.load

        def spying(residency, chunk, offset, state=Residency.load.__defaults__[0]):
            spy.append(bool(chunk.grad_slots))
            load(residency, chunk, offset, state)

        engine.chunks.residency.load = spying.__get__(engine.chunks.residency)
    losses = []
    for step in range(3 * micro_batches):
        ids, targets = tokens(seed=step)
        torch.manual_seed(step)
        loss = call(kind, engine, ids, targets)
        loss.backward()
        engine.step()  # steps every `micro_batches` calls, then zeroes the gradients
        losses.append(loss.detach())
    return engine, losses, [p.detach().clone() for p in engine.parameters()]


@pytest.mark.parametrize(
    "kind,precision,micro_batches,extra",
    [
        ("gpt", "bf16", 1, {}),
        # accumulation: the next micro-batch loads chunks whose room holds gradients
        ("gpt", "bf16", 2, {}),
        ("gpt", "bf16", 2, {"checkpoint": "blocks"}),  # and recomputation in backward
        ("gpt", "fp16", 2, {}),  # loss scaling: an overflow skips a step, zero_grad
        ("llama", "bf16", 1, {}),  # HybridAdam keeps chunks (and their gradients) on
    ],
)
def test_the_same_training_bit_for_bit(kind, precision, micro_batches, extra):
    spy: list[bool] = []
    hybrid = kind == "llama"  # a roomy budget: the margin holds some chunks for good
    options = dict(precision=precision, device_memory=budget(kind, 2.0 if hybrid else 0.4),
                   micro_batches=micro_batches, squeeze=not hybrid, **extra)  # fmt: skip
    shared, losses, params = run(kind, True, spy=spy, **options)
    _, other_losses, other_params = run(kind, False, **options)
    assert all(torch.equal(a, b) for a, b in zip(losses, other_losses, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(params, other_params, strict=True))
    chunks = [c for c in shared.chunks.chunks if c.grad is not None and not c.kept]
    assert chunks and all(c.grad.data_ptr() == c.payload.data_ptr() for c in chunks)
    if not hybrid:
        assert shared.chunks.stats.evictions > 0
    if micro_batches > 1:
        assert any(spy), "no chunk was loaded while its host room held gradients"
    if hybrid:
        assert shared.optimizer.device_chunks  # some chunks were kept, their gradients too
    if precision == "fp16":
        assert shared.optimizer.skipped_steps > 0  # the first scale overflows


def test_the_host_holds_no_gradient_buffer_of_its_own():
    sizes = {}
    for grads_in_host in (True, False):
        plan = Plan(precision="bf16", device_memory=budget("gpt", 0.4), grads_in_host=grads_in_host)
        engine = compile(tiny_gpt(), plan, **example("gpt", *tokens()))
        storages = {c.payload.untyped_storage().data_ptr(): c.payload.untyped_storage().nbytes()
                    for c in engine.chunks.chunks}  # fmt: skip
        storages.update({c.grad.untyped_storage().data_ptr(): c.grad.untyped_storage().nbytes()
                         for c in engine.chunks.chunks if c.grad is not None})  # fmt: skip
        sizes[grads_in_host] = sum(storages.values())
    params = sum(p.numel() for p in tiny_gpt().parameters())
    assert sizes[False] - sizes[True] >= 2 * params  # the bf16 gradients' bytes


def test_a_gradient_the_step_overwrote_is_an_error_to_read():
    """engine.step() zeroes the gradients after stepping; a loop that drives the optimizer
    itself can still ask for gradients the step wrote parameters over."""
    plan = Plan(precision="bf16", device_memory=budget("gpt", 0.4), optimizer=OPT)
    engine = compile(tiny_gpt(), plan, **example("gpt", *tokens()))
    engine(*tokens()).backward()
    before = engine.gradients()
    assert before["h.0.mlp.c_fc.weight"].abs().sum() > 0
    engine.optimizer.step()
    with pytest.raises(GradientConsumedError, match="gradient of .*engine.step"):
        engine.gradients()
    with pytest.raises(Exception, match="accumulate into the gradient"):
        engine(*tokens()).backward()  # eager would add to gradients that are gone
    engine.zero_grad()
    assert all(g is None for g in engine.gradients().values())
    engine(*tokens()).backward()  # and training goes on
    assert engine.step()
