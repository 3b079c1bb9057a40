"""One engine, several threads: a step (forward .. step()/zero_grad()) belongs to the thread
that began it, another thread's forward meanwhile is refused by name; save and the state
reads wait for it to end, so no checkpoint is torn; captures take turns process-wide. Each
test orders its threads with events, never with sleeps."""

import importlib
import threading

import pytest
import torch
from conftest import activation_budget, tiny_gpt, tokens

import fxstar
from fxstar.errors import EngineStateError
from fxstar.saving import load

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
capture_module = importlib.import_module("fxstar.capture")  # fxstar.capture is the function

WAIT = 60  # seconds: only a broken test waits this long


def gpt():
    return tiny_gpt(dropout=0.0)


def chunk_plan(**options) -> fxstar.Plan:
    return fxstar.Plan(device_memory=activation_budget(gpt, 0.5, example_inputs=tokens()),
                       optimizer={"lr": 1e-2}, **options)  # fmt: skip


PLANS = {"plain": lambda: fxstar.Plan(optimizer={"lr": 1e-2}), "chunks": chunk_plan}


def run_in_thread(fn, name: str) -> tuple[threading.Thread, list]:
    """Start `fn` in a thread called `name`; the list gets its result or its exception."""
    out: list = []

    def body() -> None:
        try:
            out.append(fn())
        except BaseException as error:  # noqa: BLE001 - handed to the test
            out.append(error)

    thread = threading.Thread(target=body, name=name)
    thread.start()
    return thread, out


class LockSpy:
    """The engine's lock, saying when a thread named `name` asks for it (it may then wait)."""

    def __init__(self, lock, name: str):
        self.lock, self.name, self.asked = lock, name, threading.Event()

    def __enter__(self):
        if threading.current_thread().name == self.name:
            self.asked.set()
        return self.lock.__enter__()

    def __exit__(self, *exc):
        return self.lock.__exit__(*exc)


def parameters(state: dict) -> dict:
    return {k: v.detach().clone() for k, v in state.items()}


@pytest.mark.parametrize("kind", list(PLANS))
def test_a_forward_from_another_thread_during_a_step_is_refused_by_name(kind):
    ids, targets = tokens()
    engine = fxstar.compile(gpt(), PLANS[kind](), (ids, targets))
    reference = fxstar.compile(gpt(), PLANS[kind](), (ids, targets))
    loss = engine(ids, targets)  # this thread's step is open
    thread, out = run_in_thread(lambda: engine(*tokens(seed=5)), "intruder")
    thread.join(WAIT)
    assert isinstance(out[0], EngineStateError), out
    assert "'intruder'" in str(out[0]) and "'MainThread'" in str(out[0])
    # the refused forward left the step as it was: its gradients are the reference's
    loss.backward()
    expected = reference(ids, targets)
    expected.backward()
    assert torch.equal(loss, expected)
    for (name, got), (_, want) in zip(engine.gradients().items(),
                                      reference.gradients().items(), strict=True):  # fmt: skip
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
    engine.step()  # the step ended: another thread trains now
    thread, out = run_in_thread(lambda: engine(ids, targets).backward(), "next")
    thread.join(WAIT)
    assert out == [None]


def test_a_step_left_open_by_a_thread_that_ended_is_abandoned():
    ids, targets = tokens()
    engine = fxstar.compile(gpt(), chunk_plan(), (ids, targets))
    thread, out = run_in_thread(lambda: engine(ids, targets) and None, "gone")
    thread.join(WAIT)
    assert out == [None]
    engine(ids, targets).backward()  # as after an abandoned forward in one thread
    engine.step()


@pytest.mark.parametrize("kind", list(PLANS))
def test_a_save_during_another_threads_step_waits_for_it(kind, tmp_path):
    """The trainer is held inside engine.step() (the step counted, the optimizer not yet
    run) until the saver has asked for the engine: the checkpoint is the state after the
    step, never the step count of one with the parameters of the other."""
    ids, targets = tokens()
    engine = fxstar.compile(gpt(), PLANS[kind](), (ids, targets))
    spy = engine.step_lock.lock = LockSpy(engine.step_lock.lock, "saver")
    optimizer = engine.optimizer
    inside, optimizer_step = threading.Event(), optimizer.step

    def held_step(*args, **kwargs):
        inside.set()
        assert spy.asked.wait(WAIT)
        return optimizer_step(*args, **kwargs)

    optimizer.step = held_step

    def train() -> None:
        engine(ids, targets).backward()
        engine.step()

    def save() -> None:
        try:
            engine.save(tmp_path / "ckpt")
        finally:
            spy.asked.set()

    trainer, trained = run_in_thread(train, "trainer")
    assert inside.wait(WAIT)
    saver, saved = run_in_thread(save, "saver")
    for thread in (trainer, saver):
        thread.join(WAIT)
    assert trained == [None] and saved == [None], (trained, saved)
    checkpoint = load(tmp_path / "ckpt")
    assert checkpoint.step == engine.step_count == 1
    after = parameters(engine.state_dict())
    for name, value in checkpoint.parameters.items():
        torch.testing.assert_close(value, after[name], rtol=0, atol=0, msg=name)


def test_a_save_waits_for_the_step_another_thread_has_open(tmp_path):
    """Between the trainer's forward and its step (its backward may be running: it holds no
    lock) a save from another thread waits until the step ends."""
    ids, targets = tokens()
    engine = fxstar.compile(gpt(), chunk_plan(), (ids, targets))
    spy = engine.step_lock.lock = LockSpy(engine.step_lock.lock, "saver")
    opened = threading.Event()

    def train() -> None:
        engine(ids, targets).backward()
        opened.set()
        assert spy.asked.wait(WAIT)
        engine.step()

    def save() -> None:
        try:
            assert opened.wait(WAIT)
            engine.save(tmp_path / "ckpt")
        finally:
            spy.asked.set()

    trainer, trained = run_in_thread(train, "trainer")
    saver, saved = run_in_thread(save, "saver")
    for thread in (trainer, saver):
        thread.join(WAIT)
    assert trained == [None] and saved == [None], (trained, saved)
    checkpoint = load(tmp_path / "ckpt")
    assert checkpoint.step == 1
    after = parameters(engine.state_dict())
    for name, value in checkpoint.parameters.items():
        torch.testing.assert_close(value, after[name], rtol=0, atol=0, msg=name)


def test_captures_in_two_threads_take_turns(monkeypatch):
    """torch.export is not thread-safe: the second capture waits until the first is done."""
    spy = LockSpy(getattr(capture_module, "_CAPTURE_LOCK", threading.RLock()), "second")
    monkeypatch.setattr(capture_module, "_CAPTURE_LOCK", spy, raising=False)
    export, inside, most = torch.export.export, threading.Event(), []
    active = [0]

    def watched_export(*args, **kwargs):
        active[0] += 1
        most.append(active[0])
        if threading.current_thread().name == "second":
            spy.asked.set()  # without the lock the second capture gets here
        else:
            inside.set()
            assert spy.asked.wait(WAIT)
        try:
            return export(*args, **kwargs)
        finally:
            active[0] -= 1

    monkeypatch.setattr(torch.export, "export", watched_export)
    ids, targets = tokens()
    first, one = run_in_thread(lambda: fxstar.compile(gpt(), fxstar.Plan(), (ids, targets)),
                               "first")  # fmt: skip
    assert inside.wait(WAIT)
    second, two = run_in_thread(lambda: fxstar.compile(gpt(), fxstar.Plan(), (ids, targets)),
                                "second")  # fmt: skip
    for thread in (first, second):
        thread.join(WAIT)
    assert max(most) == 1, "two captures ran at once"
    for out in (one, two):
        assert isinstance(out[0], fxstar.Engine), out
        assert torch.equal(out[0](ids, targets), gpt()(ids, targets))
