"""A chunk's verbs and the tables that check them: pins, the payload's rooms, its home's tier."""

import pytest
import torch

from fxstar.runtime.arena import ArenaBuffer
from fxstar.runtime.chunk import Chunk, ChunkState, Home, Room
from fxstar.runtime.device import HostDevice
from fxstar.runtime.layout import ParamSlot
from fxstar.runtime.tiers import ComputeTier, HostTier

SLOTS = [ParamSlot("a", ("a",), 0, 0, (2,), True), ParamSlot("b", ("b",), 0, 2, (2,), True)]


def low_precision_chunk(grad_in_payload: bool = True) -> Chunk:
    """A bf16 chunk of two slots whose fp32 master holds 1, 2, 3, 4."""
    payload = torch.zeros(4, dtype=torch.bfloat16)
    master = torch.arange(1.0, 5.0)
    grad = payload if grad_in_payload else torch.zeros(4, dtype=torch.bfloat16)
    home = Home(HostTier(HostDevice()), payload, grad, master, grad_in_payload=grad_in_payload)
    chunk = Chunk(0, SLOTS, home, used=4)
    chunk.homed()
    return chunk


def test_a_gradient_takes_its_slots_room_and_the_master_gives_it_back():
    chunk = low_precision_chunk()
    chunk.take_room(SLOTS[1])
    chunk.take_room(SLOTS[1])  # more gradient accumulates in the same room
    assert chunk.grad_slots == {"b"} and chunk.holds_grad_within(3, 4)
    assert not chunk.holds_grad_within(0, 2)
    chunk.payload[2:].fill_(7.0)  # the gradient in the room
    chunk.restore_params()
    assert chunk.grad_slots == frozenset()
    assert chunk.payload[2:].tolist() == [3.0, 4.0]


def test_a_collective_over_the_whole_room_leaves_gradients_only_in_the_owned_slots():
    chunk = low_precision_chunk()
    chunk.take_room(SLOTS[0])
    chunk.payload.fill_(9.0)  # the reduction wrote every slot's room
    chunk.keep_grads_only([SLOTS[1]])
    assert chunk.grad_slots == {"b"}
    assert chunk.payload.tolist() == [1.0, 2.0, 9.0, 9.0]
    chunk.params_written([SLOTS[1]])  # the optimizer wrote b's parameters over its gradient
    assert chunk.grad_slots == frozenset()


def test_a_chunk_whose_gradients_have_a_buffer_of_their_own_has_no_rooms_to_take():
    chunk = low_precision_chunk(grad_in_payload=False)
    chunk.take_room(SLOTS[0])
    assert chunk.grad_slots == frozenset()
    with pytest.raises(RuntimeError, match="a buffer of their own"):
        chunk._set_room(SLOTS[0], Room.GRAD)


def test_the_room_table_refuses_giving_back_a_room_no_gradient_took():
    chunk = low_precision_chunk()
    with pytest.raises(RuntimeError, match="room cannot go from params to params"):
        chunk._set_room(SLOTS[0], Room.PARAMS)


def test_pins_are_counted_and_the_last_unpin_moves_the_chunk_on():
    chunk = low_precision_chunk()
    with pytest.raises(RuntimeError, match="pinned while released"):
        chunk.pin()
    chunk.placed(0)
    chunk.loaded((0,), ChunkState.COMPUTE)
    chunk.pin()
    chunk.pin()
    chunk.unpin(ChunkState.HOLD_AFTER_BWD)
    assert chunk.state is ChunkState.COMPUTE and chunk.pins == 1
    chunk.unpin(ChunkState.HOLD_AFTER_BWD)
    assert chunk.state is ChunkState.HOLD_AFTER_BWD
    with pytest.raises(RuntimeError, match="unpinned more often than pinned"):
        chunk.unpin(ChunkState.HOLD_AFTER_BWD)
    with pytest.raises(RuntimeError, match="loaded again while resident"):
        chunk.placed(0)
    chunk.evicted()
    assert chunk.offset is None and not chunk.resident


def test_a_home_moves_between_the_tiers_its_table_allows():
    chunk = low_precision_chunk()
    compute = ComputeTier(ArenaBuffer(1 << 12, torch.device("cpu")), torch.bfloat16, HostDevice())
    block = compute.view(0, 0, (4,))
    kept = Home(compute, block, torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4))
    chunk.take_room(SLOTS[0])
    chunk.keep_on_compute(kept)
    assert chunk.kept and chunk.grad_slots == frozenset()  # a gradient block of its own there
    assert chunk.fp32_home.data_ptr() == kept.master.data_ptr()
    with pytest.raises(RuntimeError, match="cannot move from compute to compute"):
        chunk.keep_on_compute(kept)
    host = Home(HostTier(HostDevice()), torch.zeros(4, dtype=torch.bfloat16), None,
                torch.zeros(4), grad_in_payload=True)  # fmt: skip
    chunk.back_to_host(host, grad_rooms=["a"])
    assert not chunk.kept and chunk.grad_slots == {"a"}
