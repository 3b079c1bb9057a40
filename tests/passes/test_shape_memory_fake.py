"""shape_memory measures on fake tensors: node by node the numbers of a real run, without the
real run's memory, and a real run (with a warning) where fake tensors cannot go."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import activation_budget, hf_gpt2, hf_llama, inputs, tiny_gpt, tokens
from families import FAMILIES
from test_shape_memory import CountingNorm

from fxstar.capture import capture
from fxstar.engine import compile
from fxstar.passes import PassManager, shape_memory
from fxstar.passes.shape_memory import META_KEY, NodeMemory, _measure
from fxstar.plan import Plan
from fxstar.program import Program
from fxstar.runtime.offload import OffloadStats

FIELDS = [f.name for f in dataclasses.fields(NodeMemory) if f.type in ("int", int)]


def assert_same(real: dict, fake: dict) -> None:
    """Node by node, every byte count and every saved parameter name equal."""
    assert [n.name for n in fake] == [n.name for n in real]
    worst = max((abs(getattr(real[n], f) - getattr(fake[n], f)) for n in real for f in FIELDS),
                default=0)  # fmt: skip
    assert worst == 0, {n.name: (real[n], fake[n]) for n in real if real[n] != fake[n]}
    assert fake == real


def both(program: Program) -> dict:
    real = _measure(program, fake=False)
    fake = _measure(program, fake=True)
    assert_same(real, fake)
    return fake


def _family(name: str):
    """Through compile: it captures the model as users have it (the loss only, no cache)."""
    make, batch = FAMILIES[name]
    return lambda: compile(make(), Plan(), example_kwargs=batch(0)).program


CAPTURES = {
    "gpt-dropout": lambda: capture(tiny_gpt(), tokens()),
    "gpt-symbolic_trace": lambda: capture(tiny_gpt(), tokens(), method="symbolic_trace"),
    "gpt2": lambda: capture(hf_gpt2(), *inputs(hf_gpt2)),
    "llama": lambda: capture(hf_llama(), *inputs(hf_llama)),
    "llama-as-users-have-it": _family("llama"),  # use_cache, dropout, default heads
    "bert-dropout": _family("bert"),
    "batchnorm": lambda: capture(CountingNorm(), (torch.randn(4, 8), torch.randn(4, 1))),
    "batchnorm-symbolic_trace": lambda: capture(
        CountingNorm(), (torch.randn(4, 8), torch.randn(4, 1)), method="symbolic_trace"
    ),
}


@pytest.mark.parametrize("name", CAPTURES)
def test_fake_measurement_equals_the_real_one(name):
    program = CAPTURES[name]()
    state = {k: v.clone() for k, v in program.model.state_dict().items()}
    mems = both(program)
    assert sum(m.saved_bytes for m in mems.values()) > 0
    for key, value in program.model.state_dict().items():
        assert torch.equal(value, state[key]), key  # neither run wrote a buffer


@pytest.fixture
def compared(monkeypatch) -> list[Program]:
    """Every measurement a compile makes is made twice, fake and real, and compared."""
    seen: list[Program] = []

    def measure(program: Program) -> dict:
        seen.append(program)
        return both(program)

    monkeypatch.setattr(shape_memory, "measure", measure)
    return seen


def _calls(program: Program, name: str) -> int:
    nodes = program.graph_module.graph.nodes
    return sum(getattr(n.target, "__name__", "") == name for n in nodes)


@pytest.mark.parametrize("make", [tiny_gpt, hf_llama], ids=["gpt", "llama"])
def test_regions_offload_chunks_and_a_later_capture_measure_alike(make, compared):
    """The graphs shape_memory meets inside a compile: checkpoint regions (run_region),
    offloaded ones (offload_region), parameters that are views of one chunk (a later
    capture), and bf16 captures measured on fp32 masters (the cast)."""
    args, kwargs = inputs(make)
    budget = activation_budget(make, 1.0, example_inputs=args, example_kwargs=kwargs)
    plans = [
        Plan(checkpoint="blocks", offload_activations=True, device_memory=budget),
        Plan(checkpoint="blocks", device_memory=budget),
        Plan(precision="bf16", device_memory=budget),
    ]
    for plan in plans:
        engine = compile(make(), plan, args, kwargs)
        ids, targets = tokens(seq=8)  # a second capture: the store feeds chunk views
        if kwargs:
            engine(input_ids=ids, labels=targets).loss.backward()
        else:
            engine(ids, targets).backward()
        assert len(engine.programs) == 2
    assert any(_calls(p, "offload_region") for p in compared)
    assert any(_calls(p, "run_region") for p in compared)
    assert len(compared) >= 2 * len(plans)


def test_offloaded_regions_save_nothing_of_ours_and_move_nothing():
    """An offloaded region's inputs go to the offload's hooks, not the measurement's; the
    measurement makes no host copies and leaves the offload's counters alone."""
    engine = compile(tiny_gpt(), Plan(checkpoint="blocks", offload_activations=True), tokens())
    offload = engine.program.decisions.offload_activations
    offload.reset_stats()
    mems = both(engine.program)
    regions = [n for n in mems if getattr(n.target, "__name__", "") == "offload_region"]
    assert regions and all(mems[n].saved_bytes == 0 for n in regions)
    assert offload.stats == OffloadStats()


class Halves(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(8, 8)
        self.lin = torch.nn.Linear(8, 16)

    def forward(self, x):
        a, b = self.lin(self.inner(x)).split(8, dim=-1)
        return (a * b).sum()


def test_views_of_one_storage_count_once():
    program = capture(Halves(), (torch.randn(4, 8),))
    mems = both(program)
    mul = next(m for n, m in mems.items() if n.name == "mul")
    assert mul.saved_bytes == 4 * 16 * 4  # both halves of one output: its storage, once
    linear = next(m for n, m in mems.items() if n.name == "linear_1")
    assert linear.saved_params == ("lin.weight",)  # weight.t(), a view of the parameter
    assert linear.saved_param_bytes == 16 * 8 * 4 and linear.saved_bytes == 4 * 8 * 4


class Scaled(torch.nn.Module):
    """Multiplies by a number read from the data: `.item()` needs real values."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return (self.lin(x) * x.abs().sum().item()).sum()


@torch.library.custom_op("fxstar_test_shape_memory::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    """A custom op without a fake kernel: export refuses it, symbolic_trace does not."""
    return x * 2


class Custom(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return twice(self.lin(x)).sum()


@pytest.mark.parametrize(
    ("model", "method", "op"),
    [
        (Scaled, "export", "aten._local_scalar_dense"),
        (Scaled, "symbolic_trace", "aten._local_scalar_dense"),
        (Custom, "symbolic_trace", "fxstar_test_shape_memory.twice"),
    ],
)
def test_what_fake_tensors_cannot_run_is_measured_for_real(model, method, op):
    program = capture(model(), (torch.randn(4, 8),), method=method)
    real = _measure(program, fake=False)
    with pytest.warns(UserWarning, match=rf"fake tensors cannot run {op}.*at node") as caught:
        PassManager(["shape_memory"]).run(program)
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    assert {n: n.meta[META_KEY] for n in real} == real
    with pytest.raises(shape_memory._NotFakeable, match=op):
        _measure(program, fake=True)


_RSS = """
import json, time
import torch
from fxstar.capture import capture
from fxstar.passes.shape_memory import _measure

def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))

def grows(program, fake):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak starts again from the present
    before, start = status("VmRSS"), time.perf_counter()
    _measure(program, fake=fake)
    return status("VmHWM") - before, time.perf_counter() - start

torch.manual_seed(0)
width, layers, batch = 4096, 6, 512
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU())
                              for _ in range(layers)])
program = capture(model, (torch.randn(batch, width),))
fake, fake_s = grows(program, True)  # first: torch's lazy set-up of fake tensors counts here
real, real_s = grows(program, False)
params = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"params": params, "fake": fake, "real": real, "fake_s": fake_s,
                  "real_s": real_s}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_measuring_allocates_neither_parameters_nor_activations():
    """400 MB of fp32 parameters, ~100 MB of saved activations: the fake measurement's peak
    RSS grows by well under a megabyte or so; the real one by the activations (which shows
    the probe sees allocations). In a fresh process, where freed memory is not reused."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_RSS)], capture_output=True,
                          text=True, cwd=root, timeout=300, check=True)  # fmt: skip
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["params"] > 400e6
    assert got["real"] > 64 * 2**20, got  # the probe works: the real run's activations show
    assert got["fake"] < 16 * 2**20, got
