"""ArenaBuffer: typed views over one buffer at offsets from the C++ arena."""

import pytest
import torch

from fxstar.runtime.arena import ArenaBuffer, ArenaOutOfMemory


def test_views_share_the_buffer_and_do_not_overlap():
    arena = ArenaBuffer(1 << 16)
    a = arena.view(arena.alloc(4000), (10, 100), torch.float32)
    b = arena.view(arena.alloc(2000), (1000,), torch.bfloat16)
    a.fill_(1.0)
    b.fill_(2.0)
    assert a.sum() == 1000 and b.float().sum() == 2000
    assert a.untyped_storage().data_ptr() == arena.buffer.untyped_storage().data_ptr()


def test_budget_holds():
    arena = ArenaBuffer(1 << 12)
    arena.alloc(3000)
    with pytest.raises(ArenaOutOfMemory):
        arena.alloc(2000)


def test_view_larger_than_block_is_refused():
    arena = ArenaBuffer(1 << 12)
    offset = arena.alloc(256)
    with pytest.raises(ValueError, match="holds 256"):
        arena.view(offset, (100,), torch.float32)
