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


def test_a_cpu_arena_gives_freed_pages_and_the_heap_back_to_the_system(monkeypatch):
    """On a CPU-only machine the arena is host memory beside the activations: a freed block's
    pages go back to the system (they read as zeros when taken again), and taking a block
    first returns the heap's freed pages (glibc's malloc_trim), so the two together hold
    what the budget allows, as on a card."""
    import fxstar.runtime.arena as arena_module

    trims = []
    monkeypatch.setattr(arena_module, "give_back_freed", lambda: trims.append(1) or True)
    arena = ArenaBuffer(16 * 2**20, "cpu")
    offset = arena.alloc(8 * 2**20)
    assert trims == [1]
    block = arena.view(offset, (8 * 2**20,), torch.uint8)
    block.fill_(7)
    arena.free(offset)
    again = arena.alloc(8 * 2**20)
    assert again == offset and trims == [1, 1]
    kept_bytes = int(arena.view(again, (8 * 2**20,), torch.uint8).count_nonzero())
    assert kept_bytes < 2 * 4096  # at most the partial pages at the block's two ends
