"""The saved-tensor hooks keep nothing alive past the graph that saved it: forwards without a
backward (an eval loop without torch.no_grad()) free what they saved as soon as the output
is dropped, by reference counting alone, in every mode that packs saved tensors."""

import functools
import gc
import os

import pytest
import torch
from conftest import activation_budget, tiny_gpt, tokens

from fxstar.engine import compile
from fxstar.plan import Plan

FORWARDS = 200


@functools.cache
def paging_budget() -> int:
    """A device_memory under which chunks page: the activations and half the parameters."""
    return activation_budget(tiny_gpt, 0.5, example_inputs=tokens())


PLANS = {
    "chunks": lambda: Plan(device_memory=paging_budget()),
    "bf16": lambda: Plan(precision="bf16"),
    "fp16": lambda: Plan(precision="fp16"),
    "checkpoint+offload": lambda: Plan(checkpoint="blocks", offload_activations=True),
    "chunks+checkpoint": lambda: Plan(device_memory=paging_budget(), checkpoint="blocks"),
    "bf16+chunks+offload": lambda: Plan(device_memory=paging_budget(), precision="bf16",
                                        checkpoint="blocks", offload_activations=True),
}  # fmt: skip
# every mode in each training mode runs with the slow tests; these in the default run
DEFAULT = {("chunks", True), ("bf16", False), ("bf16+chunks+offload", True)}
CASES = [
    pytest.param(name, training, id=f"{name}-{'train' if training else 'eval'}",
                 marks=() if (name, training) in DEFAULT else pytest.mark.slow)
    for name in PLANS for training in (True, False)
]  # fmt: skip


def live_tensors() -> int:
    return sum(isinstance(o, torch.Tensor) for o in gc.get_objects())


def rss() -> int:
    with open("/proc/self/statm", encoding="ascii") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(autouse=True)
def one_thread():
    """The forwards are small and many: one intra-op thread (two spin against each other on
    a busy machine, tens of times slower); what is measured does not depend on it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(("name", "training"), CASES)
def test_forwards_without_backward_leave_nothing_behind(name, training):
    ids, targets = tokens()
    engine = compile(tiny_gpt(), PLANS[name](), example_inputs=(ids, targets))
    engine.train(training)
    for _ in range(3):  # warm: captures, arena, host pools
        engine(ids, targets)
    gc.collect()
    tensors, memory = live_tensors(), rss()
    gc.disable()  # what a cycle keeps alive stays: only reference counting frees here
    try:
        for _ in range(FORWARDS):
            loss = engine(ids, targets)
            assert loss.requires_grad
        del loss
        grown_tensors, grown_memory = live_tensors() - tensors, rss() - memory
    finally:
        gc.enable()
    # a host pool's steady state is a few buffers; a leak is some per forward
    assert grown_tensors <= 16, f"{grown_tensors} tensors outlived {FORWARDS} forwards"
    assert grown_memory < 4 << 20, f"RSS grew {grown_memory / 2**20:.1f} MiB"
