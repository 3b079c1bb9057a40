"""The Device contract (fxstar/runtime/device.py), run on every device this machine has: the
host, the simulated asynchronous device, and the accelerator where there is one. A program
that waits as the contract says gets the right values on each."""

from __future__ import annotations

import pytest
import torch

from fxstar.runtime.device import (
    AcceleratorDevice,
    Device,
    Event,
    HostDevice,
    QueuedCopy,
    Stream,
    device_for,
)
from fxstar.testing.async_device import SimulatedDevice

KINDS = ["host", "simulated"] + (["accelerator"] if torch.accelerator.is_available() else [])


@pytest.fixture(params=KINDS)
def device(request):
    if request.param == "host":
        made: Device = HostDevice()
    elif request.param == "simulated":
        made = SimulatedDevice(seed=3, max_delay=2e-3)
    else:
        made = AcceleratorDevice(torch.accelerator.current_accelerator())
    yield made
    made.synchronize()
    made.close()


def on(device: Device, values: torch.Tensor) -> torch.Tensor:
    return values.to(device.torch_device)


def host_copy_of(device: Device, values: torch.Tensor) -> torch.Tensor:
    """`values` in the host buffer copies to and from `device` use."""
    buffer = device.host_empty(values.numel() * values.element_size())
    return buffer.view(values.dtype).view(values.shape).copy_(values)


def test_streams_and_events_have_the_protocols(device):
    side = device.new_stream()
    assert isinstance(side, Stream) and isinstance(device.current_stream(), Stream)
    event = side.record_event()
    assert isinstance(event, Event) and isinstance(device.new_event(), Event)
    event.synchronize()
    assert event.query()


def test_a_copy_to_the_device_reads_right_after_the_current_stream_waits(device):
    values = torch.arange(4096, dtype=torch.float32)
    src = host_copy_of(device, values)
    dst = device.empty((4096,), torch.float32)
    queued = device.copy_after(dst, src, device.new_stream())
    device.current_stream().wait_event(queued.done)
    assert torch.equal((dst * 2).cpu(), values * 2)


def test_a_copy_to_the_host_reads_right_after_its_event_is_synchronised(device):
    values = torch.randn(1000)
    src = on(device, values)
    dst = device.host_empty(values.nbytes, zero=False).view(torch.float32)
    queued = device.copy_after(dst, src, device.new_stream())
    queued.done.synchronize()
    assert torch.equal(dst, values)


def test_work_on_one_stream_runs_in_the_order_queued(device):
    side = device.new_stream()
    first = on(device, torch.arange(64, dtype=torch.int64))
    buffers = [device.empty((64,), torch.int64) for _ in range(5)]
    device.copy_after(buffers[0], first, side)
    for a, b in zip(buffers, buffers[1:]):
        device.copy(b, a, side)  # each reads what the one before wrote
    device.current_stream().wait_stream(side)
    assert torch.equal(buffers[-1].cpu(), torch.arange(64))


def test_an_event_orders_work_across_streams(device):
    one, two = device.new_stream(), device.new_stream()
    src = on(device, torch.randn(2048))
    middle = device.empty((2048,), torch.float32)
    dst = device.empty((2048,), torch.float32)
    arrived = device.copy_after(middle, src, one).done
    two.wait_event(arrived)
    device.copy(dst, middle, two)
    device.current_stream().wait_stream(two)
    assert torch.equal(dst.cpu(), src.cpu())


def test_a_strided_empty_keeps_its_strides(device):
    t = device.empty((3, 4), torch.float32, stride=(1, 3), stream=device.new_stream())
    assert t.stride() == (1, 3) and t.device.type == device.torch_device.type


def test_a_timed_copy_has_a_duration(device):
    src = on(device, torch.randn(1 << 16))
    dst = device.empty((1 << 16,), torch.float32)
    queued = device.copy_after(dst, src, device.new_stream(), timing=True)
    queued.done.synchronize()
    assert queued.seconds() >= 0
    with pytest.raises(ValueError, match="without timing=True"):
        QueuedCopy(queued.done).seconds()


def test_memory_info_is_free_then_total(device):
    free, total = device.memory_info()
    assert 0 < free <= total
    allocated = device.memory_allocated()
    assert allocated is None or allocated >= 0


def test_the_host_runs_everything_at_once():
    host = HostDevice()
    assert not host.asynchronous and host.torch_device == torch.device("cpu")
    ran = []
    host.launch(host.new_stream(), lambda: ran.append(1))
    assert ran == [1]
    assert torch.count_nonzero(host.host_empty(1 << 12)) == 0


def test_device_for_picks_the_host_or_the_accelerator():
    assert isinstance(device_for("cpu"), HostDevice)
    if not torch.accelerator.is_available():
        with pytest.raises(RuntimeError, match="cuda:0 is not this machine's accelerator"):
            device_for("cuda:0")
