"""A graph calls the runtime it holds: engines never reach each other's chunks.

Each engine's graphs (and their checkpointed regions, which recompute in backward) carry a
ChunkRuntime bound to that engine's manager. Interleaving engines in any order, or running
them in two threads, gives each the gradients of its own eager model.
"""

import itertools
import threading

import torch
from conftest import tiny_gpt, tokens

from fxstar.engine import compile
from fxstar.plan import Plan
from fxstar.runtime import ops

ENGINES = 3


def tight_plan(**options) -> Plan:
    """70% of the parameter bytes as a fixed share: chunks are evicted and fetched back,
    and each block is a checkpointed region that fetches its chunks again in backward."""
    param_bytes = compile(tiny_gpt(), Plan(), example_inputs=tokens()).program.param_bytes
    return Plan(device_memory=param_bytes, static_partition=True, warmup_gpu_chunk_mem_ratio=0.7,
                checkpoint="blocks", **options)  # fmt: skip


def eager_grads(seed: int, batch: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = tiny_gpt(seed=seed)
    torch.manual_seed(100 + seed)
    loss = model(*tokens(seed=batch))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def assert_grads(engine, expected: dict[str, torch.Tensor], what: str) -> None:
    for name, p in engine.named_parameters():
        assert torch.equal(p.grad, expected[name]), (what, name)


def test_every_graph_holds_its_engines_runtime():
    plan = tight_plan(offload_activations=True)
    a = compile(tiny_gpt(), plan, example_inputs=tokens())
    b = compile(tiny_gpt(), plan, example_inputs=tokens())
    found_a, found_b = ops.runtimes(a.program.graph_module), ops.runtimes(b.program.graph_module)
    assert len(found_a) == 1 and found_a[0].manager is a.chunks
    assert len(found_b) == 1 and found_b[0].manager is b.chunks
    regions = [m for n, m in a.program.graph_module.named_children() if n.startswith("checkpoint")]
    assert regions and all(getattr(r, ops.RUNTIME) is found_a[0] for r in regions)
    assert not hasattr(ops, "ACTIVE") and not hasattr(ops, "LAST")  # no module-level state


def test_three_engines_interleaved_in_every_order_match_their_own_eager_runs():
    plan = tight_plan(offload_activations=True)
    engines = [compile(tiny_gpt(seed=k), plan, example_inputs=tokens()) for k in range(ENGINES)]
    expected = [eager_grads(k, batch=k) for k in range(ENGINES)]
    orders = list(itertools.permutations(range(ENGINES)))
    for forward_order, backward_order in itertools.product(orders, orders):
        losses = {}
        for k in forward_order:
            torch.manual_seed(100 + k)
            losses[k] = engines[k](*tokens(seed=k))
        for k in backward_order:
            losses[k].backward()
        what = f"forward {forward_order}, backward {backward_order}"
        for k, engine in enumerate(engines):
            assert torch.equal(losses[k].detach(), expected[k][0]), what
            assert_grads(engine, expected[k][1], what)
            engine.zero_grad()


def test_two_engines_train_in_two_threads():
    """Forward, backward (with recomputation) and step of two engines at once. Without
    dropout: torch's global generator is shared by threads, and a recomputation replays its
    RNG state through it, which would race with the other thread's draws in eager too."""
    plan = tight_plan(optimizer={"type": "adamw", "lr": 1e-2})
    steps = 3

    def train(engine, seed: int, out: dict) -> None:
        for step in range(steps):
            engine(*tokens(seed=10 * seed + step)).backward()
            engine.step()
        out[seed] = {n: p.detach().clone() for n, p in engine.named_parameters()}

    def make(seed):
        return compile(tiny_gpt(seed=seed, dropout=0.0), plan, example_inputs=tokens())

    sequential: dict = {}
    for seed in (0, 1):
        train(make(seed), seed, sequential)
    threaded: dict = {}
    threads = [threading.Thread(target=train, args=(make(s), s, threaded)) for s in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for seed in (0, 1):
        for name, value in sequential[seed].items():
            assert torch.equal(threaded[seed][name], value), (seed, name)
