"""ArenaBuffer's guards: views stay inside their block, capacities the machine can hold."""

import pytest
import torch

from fxstar.runtime import arena as arena_module
from fxstar.runtime.arena import ArenaBuffer


@pytest.mark.parametrize(
    "shape",
    [(-1,), (-2, -2), (4, -1), (-1, 0)],
    ids=["infer", "negative", "infer-2d", "infer-empty"],
)
def test_views_with_negative_or_inferred_dims_are_refused(shape):
    # (-1,) used to slice buffer[offset:offset - 4]: the whole arena but its last bytes
    arena = ArenaBuffer(1 << 12)
    offset = arena.alloc(256)
    with pytest.raises(ValueError, match="every dimension must be an int >= 0"):
        arena.view(offset, shape, torch.float32)


def test_views_stay_inside_their_block():
    arena = ArenaBuffer(1 << 12)
    first, second = arena.alloc(256), arena.alloc(256)
    with pytest.raises(ValueError, match="holds 256"):
        arena.view(first, (2**40, 2**40), torch.float32)  # no overflow in Python ints
    with pytest.raises(ValueError, match="holds 256"):
        arena.view(first, (65,), torch.float32)
    assert arena.view(first, (8, 8), torch.float32).numel() == 64
    assert arena.view(second, (0,), torch.float32).numel() == 0
    with pytest.raises(ValueError, match="not a live allocation"):
        arena.view(first + 256 * 4, (1,), torch.float32)
    with pytest.raises(ValueError, match="offset: must be >= 0"):
        arena.view(-256, (1,), torch.float32)


@pytest.mark.parametrize("capacity", [-1, 1.5, True, "4096"])
def test_arena_capacity_must_be_bytes(capacity):
    with pytest.raises(ValueError, match="capacity: must be an int of bytes"):
        ArenaBuffer(capacity)


def test_an_arena_the_machine_cannot_hold_is_a_clear_memory_error():
    # was a raw "DefaultCPUAllocator: can't allocate memory" RuntimeError
    with pytest.raises(MemoryError, match=r"cannot allocate an arena of .* on cpu: it has"):
        ArenaBuffer(10**15)


def test_a_failed_allocation_is_a_clear_memory_error(monkeypatch):
    monkeypatch.setattr(arena_module, "device_memory_bytes", lambda device: None)
    with pytest.raises(MemoryError, match=r"cannot allocate an arena .*plan.device_memory"):
        ArenaBuffer(2**62)
