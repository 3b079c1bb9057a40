"""Compile is transactional: a compile that raises, at whatever step after capture, leaves the
model as it was given (a meta model stays meta; parameters and buffers are the same tensors
with the same values on the same devices; no hook, attribute or requires_grad change), and
the model compiles and trains afterwards like one never compiled. A lazy compile (at the
first call) that raises leaves the engine able to compile again."""

import copy
import functools

import pytest
import torch
from conftest import activation_budget, tiny_gpt, tokens

import fxstar
from fxstar import chunk_setup, compiler, placement
from fxstar import engine as engine_module
from fxstar.errors import FxstarError, UsageError
from fxstar.passes.chunk_schedule import ChunkSchedule

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Injected(RuntimeError):
    """The fault a test injects."""


def raising(*args, **kwargs):
    raise Injected("injected")


def on_meta():
    with torch.device("meta"):
        return tiny_gpt()


@functools.cache
def paging_budget() -> int:
    return activation_budget(tiny_gpt, 0.5, example_inputs=tokens())


def state_of(model: torch.nn.Module) -> dict:
    """What compile could change, by value and identity: each module's attributes and the
    entries of its tables (parameters, buffers, hooks...), each tensor's identity, data,
    device, dtype, requires_grad, gradient, attributes and values."""
    modules = {}
    for name, module in model.named_modules(remove_duplicate=False):
        tables = {key: [(k, id(v)) for k, v in value.items()]
                  for key, value in module.__dict__.items() if isinstance(value, dict)}  # fmt: skip
        plain = {key: id(value) for key, value in module.__dict__.items()}
        modules[name] = (plain, tables)
    tensors = {}
    named = [*model.named_parameters(remove_duplicate=False),
             *model.named_buffers(remove_duplicate=False)]  # fmt: skip
    for name, t in named:
        tensors[name] = (
            id(t), t.is_meta, t.device, t.dtype, tuple(t.shape), t.requires_grad, t.grad,
            None if t.is_meta else t.untyped_storage().data_ptr(), dict(t.__dict__),
            None if t.is_meta else t.detach().clone(),
        )  # fmt: skip
    return {"modules": modules, "tensors": tensors}


def assert_unchanged(before: dict, after: dict) -> None:
    assert after["modules"] == before["modules"]
    assert after["tensors"].keys() == before["tensors"].keys()
    for name, was in before["tensors"].items():
        now = after["tensors"][name]
        assert now[:-1] == was[:-1], name
        if was[-1] is not None:
            assert torch.equal(now[-1], was[-1]), f"{name} changed value"


def weights_file(tmp_path, edit=None) -> str:
    """tiny_gpt()'s weights as safetensors (its tied head stored once), edited by `edit`."""
    from safetensors.torch import save_file

    state = {k: v.clone() for k, v in tiny_gpt().state_dict().items() if k != "head.weight"}
    if edit is not None:
        edit(state)
    path = tmp_path / "model.safetensors"
    save_file(state, str(path))
    return str(path)


def misshapen(state):
    state["h.0.mlp.c_fc.weight"] = torch.zeros(3, 3)


def missing(state):
    del state["h.1.attn.c_attn.weight"]


def fill_then_raise(monkeypatch):
    """The weights are written (all of them), then the compile fails."""
    fill = placement.fill

    def fill_and_fail(*args, **kwargs):
        fill(*args, **kwargs)
        raise Injected("after the weights were written")

    monkeypatch.setattr(placement, "fill", fill_and_fail)


# (model, plan options, weights edit or None, injection): each a failure after capture
FAILURES = {
    # real refusals
    "device_memory too small": ("host", {"device_memory": 1000}, None, None),
    "host budget": ("host", {"device_memory": "auto", "host_memory": 1000}, None, None),
    "tensor parallel without a group": ("host", {"tensor_parallel": {"size": 2}}, None, None),
    "meta: weights misshapen": ("meta", {"device_memory": "auto"}, misshapen, None),
    "meta bf16: weights missing": ("meta", {"device_memory": "auto", "precision": "bf16"},
                                   missing, None),
    "meta: device_memory too small": ("meta", {"device_memory": 1000}, None, None),
    "meta: no weights file": ("meta", {"device_memory": "auto"}, "no file", None),
    # injected at each later step
    "rank agreement": ("host", {"device_memory": "auto"}, None,
                       lambda mp: mp.setattr(compiler, "agree_ranks", raising)),
    "a pass": ("host", {"device_memory": "auto"}, None,
               lambda mp: mp.setattr(ChunkSchedule, "__call__", raising)),
    "after the chunks took the parameters": (
        "host", {"device_memory": "paging", "release_after_init": True}, None,
        lambda mp: mp.setattr(chunk_setup, "fill_weights", raising)),
    "bf16, after the chunks took the parameters": (
        "host", {"device_memory": "paging", "precision": "bf16", "release_after_init": True},
        None, lambda mp: mp.setattr(chunk_setup, "fill_weights", raising)),
    "meta: after the weights were written": ("meta", {"device_memory": "auto"}, None,
                                             fill_then_raise),
    "the last step": ("host", {"device_memory": "auto", "release_after_init": True}, None,
                      lambda mp: mp.setattr(chunk_setup, "give_back_freed", raising)),
    "plain engine, a pass": ("host", {"checkpoint": "blocks"}, None,
                             lambda mp: mp.setattr(engine_module.PassManager, "run", raising)),
}  # fmt: skip


# in the default run; every failure runs with the slow tests
DEFAULT = {
    "host budget", "meta: weights misshapen", "a pass",
    "bf16, after the chunks took the parameters", "meta: after the weights were written",
}  # fmt: skip


def plan_of(options: dict) -> fxstar.Plan:
    options = dict(options)
    if options.get("device_memory") == "paging":
        options["device_memory"] = paging_budget()
    return fxstar.Plan(**options)


@pytest.mark.parametrize("failure", [
    pytest.param(name, marks=() if name in DEFAULT else pytest.mark.slow) for name in FAILURES
])  # fmt: skip
def test_a_compile_that_raises_leaves_the_model_as_it_found_it(failure, tmp_path, monkeypatch):
    kind, options, edit, inject = FAILURES[failure]
    ids, targets = tokens()
    model = tiny_gpt() if kind == "host" else on_meta()
    weights = None
    if kind == "meta":
        weights = tmp_path / "absent" if edit == "no file" else weights_file(tmp_path, edit)
    plan = plan_of(options)
    before = state_of(model)
    if inject is not None:
        inject(monkeypatch)
    with pytest.raises((FxstarError, Injected)) as raised:
        fxstar.compile(model, plan, (ids, targets), weights=weights)
    if inject is not None:  # the injected fault, or a PassError naming it
        assert isinstance(raised.value, Injected) or isinstance(raised.value.__cause__, Injected)
    assert_unchanged(before, state_of(model))
    monkeypatch.undo()

    # and it compiles and trains as if never compiled
    reference = tiny_gpt()
    expected = reference(ids, targets)
    if kind == "meta":
        with pytest.raises(UsageError, match="meta device"):  # no weights: not from zeros
            fxstar.compile(model, fxstar.Plan(device_memory="auto"), (ids, targets))
        weights = weights_file(tmp_path)
    engine = fxstar.compile(model, fxstar.Plan(device_memory="auto"), (ids, targets),
                            weights=weights)  # fmt: skip
    engine.train(False), reference.train(False)
    torch.testing.assert_close(engine(ids, targets), reference(ids, targets))
    assert expected.isfinite()


LAZY = {
    "fp32": {},
    "bf16": {"precision": "bf16"},
    "tiled": {"tiled_linear": {"in_splits": 2, "out_splits": 2}},  # parts derived in the store
}


@pytest.mark.parametrize("options", [
    pytest.param(name, marks=() if name == "tiled" else pytest.mark.slow) for name in LAZY
])  # fmt: skip
def test_a_lazy_compile_that_raises_leaves_the_engine_able_to_compile(options, monkeypatch):
    """Compiled at the first call: the failed compile is undone in the engine too (its
    chunks, parameter store and low-precision copy), and the next call compiles and trains
    like an engine that never failed."""
    ids, targets = tokens()
    model, twin = tiny_gpt(dropout=0.0), tiny_gpt(dropout=0.0)
    plan = fxstar.Plan(device_memory=paging_budget(), release_after_init=True,
                       optimizer={"lr": 1e-2}, **LAZY[options])  # fmt: skip
    engine = fxstar.compile(model, plan)
    before = state_of(model)
    monkeypatch.setattr(chunk_setup, "fill_weights", raising)
    with pytest.raises(Injected):
        engine(ids, targets)
    assert engine.chunks is None
    assert_unchanged(before, state_of(model))
    monkeypatch.undo()

    reference = fxstar.compile(twin, copy.deepcopy(plan))
    for _ in range(2):
        losses = []
        for e in (engine, reference):
            loss = e(ids, targets)
            loss.backward()
            e.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
    for (name, p), (_, q) in zip(model.state_dict().items(), twin.state_dict().items(),
                                 strict=True):  # fmt: skip
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
