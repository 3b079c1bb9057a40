"""The simulated asynchronous device: side-stream work runs later and in order, a missing
wait reads poison, events order streams, delays repeat from a seed, workers stop, and a
worker's exception surfaces at the next synchronise."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from fxstar.testing.async_device import (
    AsyncWorkError,
    SimulatedDevice,
    poison,
    reads_as_poison,
)


@pytest.fixture
def device():
    with SimulatedDevice(seed=0, max_delay=1e-3) as made:
        yield made


def sim_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("fxstar-sim-stream")]


def gated(device: SimulatedDevice, stream) -> threading.Event:
    """Hold `stream`'s later work back until the returned gate is set."""
    gate = threading.Event()
    device.launch(stream, gate.wait, label="gate")
    return gate


def test_side_stream_work_runs_later_in_the_order_queued(device):
    side = device.new_stream()
    gate = gated(device, side)
    ran: list[int] = []
    for i in range(20):
        device.launch(side, lambda i=i: ran.append(i))
    assert ran == [] and not side.query()
    gate.set()
    side.synchronize()
    assert ran == list(range(20)) and side.query()


def test_the_current_stream_runs_at_once(device):
    ran = []
    device.launch(device.current_stream(), lambda: ran.append(1))
    assert ran == [1] and device.current_stream().query()


def test_a_missing_wait_reads_poison_and_the_wait_gives_the_right_result():
    """The same program twice: doubling what a side-stream copy brought in, without the wait
    and with it. Without it the copy (delayed 200-300 ms) has not completed: NaN."""
    values = torch.arange(1024, dtype=torch.float32)
    for wait in (False, True):
        with SimulatedDevice(seed=1, min_delay=0.2, max_delay=0.3) as device:
            dst = torch.zeros(1024)
            queued = device.copy_after(dst, values.clone(), device.new_stream())
            if wait:
                device.current_stream().wait_event(queued.done)
            doubled = dst * 2
            if wait:
                assert torch.equal(doubled, values * 2)
            else:
                assert reads_as_poison(doubled)
            device.synchronize()


def test_a_copy_to_the_host_without_synchronize_reads_poison():
    with SimulatedDevice(min_delay=0.2, max_delay=0.3) as device:
        host = torch.zeros(256, dtype=torch.int32)
        queued = device.copy_after(host, torch.ones(256, dtype=torch.int32), device.new_stream())
        assert reads_as_poison(host) and not queued.done.query()
        queued.done.synchronize()
        assert torch.equal(host, torch.ones(256, dtype=torch.int32)) and queued.done.query()


def test_poison_does_not_reach_work_queued_before_the_copy(device):
    """Work earlier on the stream still reads the old values: poison starts with the copy."""
    side = device.new_stream()
    gate = gated(device, side)
    buffer = torch.full((64,), 7.0)
    seen = torch.empty(64)
    device.copy(seen, buffer, side)  # reads the buffer before the next copy overwrites it
    device.copy(buffer, torch.zeros(64), side)
    gate.set()
    device.synchronize()
    assert torch.equal(seen, torch.full((64,), 7.0)) and torch.equal(buffer, torch.zeros(64))


def test_an_event_orders_a_second_stream_only_when_it_waits():
    src = torch.randn(512)
    for wait in (False, True):
        with SimulatedDevice(seed=2, max_delay=1e-3) as device:
            one, two = device.new_stream(), device.new_stream()
            gate = gated(device, one)
            middle, dst = torch.zeros(512), torch.zeros(512)
            device.copy(middle, src, one)
            arrived = one.record_event()
            if wait:
                two.wait_event(arrived)
            device.copy(dst, middle, two)
            done = two.record_event()
            if not wait:
                done.synchronize()  # two ran ahead: stream one is still held back
                assert not arrived.query()
            gate.set()
            device.synchronize()
            assert torch.equal(dst, src) == wait


def test_a_wait_takes_the_latest_record_and_an_unrecorded_event_is_complete(device):
    side = device.new_stream()
    event = device.new_event()
    assert event.query()
    event.synchronize()  # never recorded: nothing to wait for
    device.current_stream().wait_event(event)
    event.record(side)
    assert event.query()  # an idle stream's record completes at once
    gate = gated(device, side)
    event.record(side)  # again, behind the gate: waits now take this one
    assert not event.query()
    gate.set()
    device.current_stream().wait_event(event)
    assert event.query()


def test_elapsed_time_covers_the_work_between_two_events():
    with SimulatedDevice(min_delay=0.02, max_delay=0.02) as device:
        side = device.new_stream()
        start = side.record_event()
        device.copy(torch.empty(4), torch.ones(4), side)
        end = side.record_event()
        with pytest.raises(RuntimeError, match="not completed"):
            start.elapsed_time(end)
        end.synchronize()
        assert end.elapsed_time(start) < 0 < start.elapsed_time(end)
        assert start.elapsed_time(end) >= 15


def run_program(seed: int) -> tuple[list[list[float]], torch.Tensor]:
    """A few copies across two streams; the delays drawn and the result."""
    with SimulatedDevice(seed=seed, max_delay=1e-3) as device:
        one, two = device.new_stream(), device.new_stream()
        values = torch.randn(256, generator=torch.Generator().manual_seed(0))
        a, b, c = torch.empty(256), torch.empty(256), torch.empty(256)
        device.copy_after(a, values, one)
        two.wait_stream(one)
        device.copy(b, a, two)
        device.copy(c, b, two)
        device.current_stream().wait_stream(two)
        return [one.delays, two.delays], c * 3


def test_delays_and_results_repeat_from_a_seed():
    delays, result = run_program(5)
    again, result_again = run_program(5)
    other, result_other = run_program(6)
    assert delays == again and delays != other
    assert torch.equal(result, result_again) and torch.equal(result, result_other)
    assert all(0 <= d <= 1e-3 for stream in delays for d in stream)


def test_worker_threads_stop_on_close_and_when_the_device_is_collected():
    before = len(sim_threads())
    device = SimulatedDevice()
    for _ in range(3):
        device.launch(device.new_stream(), lambda: None)
    assert len(device.threads) == 3 and len(sim_threads()) == before + 3
    device.close()
    assert device.threads == [] and len(sim_threads()) == before
    with pytest.raises(RuntimeError, match="closed"):
        device.new_stream()

    forgotten = SimulatedDevice()
    stream = forgotten.new_stream()
    forgotten.launch(stream, lambda: None)
    assert len(sim_threads()) == before + 1
    del forgotten
    gc.collect()
    assert len(sim_threads()) == before
    with pytest.raises(RuntimeError, match="closed"):
        stream.launch(lambda: None, (), "late")


def fail():
    raise ValueError("bad shapes")


@pytest.mark.parametrize("where", ["device", "stream", "event", "current_wait", "close"])
def test_an_exception_in_a_worker_surfaces_at_the_next_synchronise(where):
    device = SimulatedDevice()
    side = device.new_stream()
    device.launch(side, fail, label="the broken kernel")
    after = torch.zeros(8)
    device.copy(after, torch.ones(8), side)  # skipped: its stream failed before it
    event = side.record_event()
    synchronise = {
        "device": device.synchronize,
        "stream": side.synchronize,
        "event": event.synchronize,
        "current_wait": lambda: device.current_stream().wait_event(event),
        "close": device.close,
    }[where]
    with pytest.raises(AsyncWorkError) as raised:
        synchronise()
    message = str(raised.value)
    assert "the broken kernel on stream 1 failed: ValueError: bad shapes" in message
    assert isinstance(raised.value.__cause__, ValueError)
    assert reads_as_poison(after)
    if where == "close":
        assert device.threads == []
        return
    device.synchronize()  # raised once; the stream runs again
    device.copy(after, torch.ones(8), side)
    device.synchronize()
    assert torch.equal(after, torch.ones(8))
    device.close()
    assert device.threads == []


@pytest.mark.parametrize(
    ("dtype", "value"),
    [(torch.float32, None), (torch.bfloat16, None), (torch.int64, None), (torch.uint8, 0xA5),
     (torch.int8, -0x5B), (torch.bool, True)],
)  # fmt: skip
def test_poison_per_dtype(dtype, value):
    t = torch.zeros(16, dtype=dtype)
    assert not reads_as_poison(t)
    poison(t)
    assert reads_as_poison(t)
    if value is not None:
        assert t[0].item() == value
    if dtype.is_floating_point:
        assert torch.isnan(t).all()


def test_memory_made_on_the_device_starts_as_poison(device):
    assert reads_as_poison(device.empty((2, 3), torch.float32, stride=(1, 2)))
    assert torch.count_nonzero(device.host_empty(64)) == 0
    assert device.memory_info() == (device.total_memory, device.total_memory)
    with pytest.raises(ValueError, match="min_delay <= max_delay"):
        SimulatedDevice(min_delay=0.2, max_delay=0.1)
