"""ChunkManager on its own: states, Belady's choice, the budget, stale copies."""

import pytest
import torch

from fxstar.runtime import tier_copy
from fxstar.runtime.chunk import Chunk, ChunkBudgetError, ChunkState, Home
from fxstar.runtime.chunks import ChunkManager
from fxstar.runtime.device import HostDevice
from fxstar.runtime.layout import AccessPlan, ChunkLayout, ChunkSpec, ParamSlot
from fxstar.runtime.tiers import HostTier

N = 64  # elements per chunk: one parameter of 8 x 8 each


def manager(chunks: int, resident: int) -> ChunkManager:
    specs = [ChunkSpec(i, [ParamSlot(f"p{i}", (f"p{i}",), i, 0, (8, 8), True)], N)
             for i in range(chunks)]  # fmt: skip
    layout = ChunkLayout(N, torch.float32, specs)
    params = {f"p{i}": torch.full((8, 8), float(i)) for i in range(chunks)}
    budget = resident * layout.chunk_bytes
    m = ChunkManager(layout, params, budget=budget, arena_capacity=budget)
    m.checking = True
    return m


def plan(order: list[int]) -> AccessPlan:
    n = len(order)
    return AccessPlan(order, ["forward"] * n, [0] * n, [1] * n)


def test_illegal_state_changes_raise():
    chunk = Chunk(0, [], Home(HostTier(HostDevice()), torch.zeros(1), None))
    with pytest.raises(RuntimeError, match="illegal state change free -> compute"):
        chunk.move(ChunkState.COMPUTE)
    chunk.move(ChunkState.RELEASED)
    chunk.move(ChunkState.COMPUTE)
    with pytest.raises(RuntimeError, match="compute -> released"):
        chunk.move(ChunkState.RELEASED)  # evicting a chunk in use


def test_belady_evicts_the_chunk_used_farthest_ahead():
    m = manager(3, resident=2)
    with m.running(plan([0, 1, 2, 1, 0])):
        for c in (0, 1):
            assert torch.equal(m.fetch(c)[f"p{c}"], torch.full((8, 8), float(c)))
            m.release(c)
        m.fetch(2)  # next uses: 1 at 3, 0 at 4 -> evict 0
        m.release(2)
        assert [c.resident for c in m.chunks] == [False, True, True]
        m.fetch(1)
        m.release(1)
        assert m.stats.loads == 3 and m.stats.evictions == 1


def test_all_chunks_in_use_is_a_budget_error():
    m = manager(3, resident=2)
    with m.running(plan([0, 1, 2])), pytest.raises(ChunkBudgetError, match="chunks \\[0, 1\\]"):
        m.fetch(0)
        m.fetch(1)
        m.fetch(2)


def test_a_changed_host_copy_is_loaded_again():
    m = manager(2, resident=2)
    with m.running(plan([0, 1])):
        m.fetch(0)
        m.release(0)
    with torch.no_grad():
        m.stable["p0"].add_(1.0)  # what an optimizer step does
    with m.running(plan([0, 1])):
        assert torch.equal(m.fetch(0)["p0"], torch.full((8, 8), 1.0))
    assert m.stats.loads == 2


def test_gradients_land_in_the_host_buffer_of_the_stable_parameter():
    m = manager(1, resident=1)
    with m.running(plan([0])):
        w = m.fetch(0)["p0"]
        (w * 3).sum().backward()
    stable = m.stable["p0"]
    assert torch.equal(stable.grad, torch.full((8, 8), 3.0))
    assert stable.grad.data_ptr() == m.chunks[0].grad.data_ptr()
    assert w.grad is None


def test_chunk_moves_go_through_the_core_copy_and_report_their_bandwidth(monkeypatch):
    """Chunks large enough for `_C.copy_into`: their loads and gradient copies take it, move
    the right bytes, and the report gives the bytes and the achieved GB/s."""
    side = 128  # 64 KiB of fp32 per chunk: the core copy's smallest
    specs = [ChunkSpec(i, [ParamSlot(f"p{i}", (f"p{i}",), i, 0, (side, side), True)], side**2)
             for i in range(3)]  # fmt: skip
    layout = ChunkLayout(side**2, torch.float32, specs)
    params = {f"p{i}": torch.randn(side, side) for i in range(3)}
    m = ChunkManager(
        layout, params, budget=2 * layout.chunk_bytes, arena_capacity=2 * layout.chunk_bytes
    )
    calls = []
    real = tier_copy._C.copy_into
    monkeypatch.setattr(tier_copy._C, "copy_into", lambda *a, **k: (calls.append(a), real(*a, **k)))
    with m.running(plan([0, 1, 2, 0])):
        views = {}
        for c in (0, 1, 2, 0):
            views.update(m.fetch(c))
            assert torch.equal(views[f"p{c}"], params[f"p{c}"])
            m.release(c)
        (views["p0"] * 2).sum().backward()
    assert torch.equal(m.stable["p0"].grad, torch.full((side, side), 2.0))
    assert len(calls) == 3 + 1  # three loads (Belady keeps chunk 0), one gradient
    assert m.stats.copy_bytes == 4 * layout.chunk_bytes
    assert f"chunk moves and gradient copies: {4 * layout.chunk_bytes:,} bytes at" in m.report()


def test_the_report_gives_the_gradient_copies_share_of_a_training_step():
    m = manager(1, resident=1)
    for _ in range(2):  # a step ends when the next one begins
        with m.running(AccessPlan([0, 0], ["forward", "backward"], [0, 0], [1, 1])):
            w = m.fetch(0)["p0"]
            m.release(0)
            (w * w).sum().backward()  # w is saved: backward fetches the chunk again
        m.zero_grad()
    st = m.stats
    assert st.training_steps == 1 and st.training_seconds > 0
    assert 0 < st.grad_copy_share() < 1
    assert st.training_grad_copy_seconds <= st.grad_copy_seconds
    assert "gradient copies into the chunks' buffers:" in m.report()


def test_a_budget_error_lists_the_chunks_kept_on_the_compute_tier_with_their_bytes():
    m = manager(3, resident=3)
    m.keep(0)  # its payload and its gradient block: two of the three chunks' room
    with m.running(plan([1, 2])), pytest.raises(ChunkBudgetError) as error:
        m.fetch(1)
        m.fetch(2)
    message = str(error.value)
    assert "chunks [1] are in use, 256 bytes each" in message
    assert "chunks [0] are kept on the compute tier for good" in message
    assert "256 bytes of payloads and 256 bytes reserved beside them" in message
    assert "hybrid_adam=False" in message


def test_a_kept_chunk_goes_back_to_the_host_tier_with_its_values_and_gradient():
    m = manager(3, resident=3)
    with m.running(plan([0])):
        m.fetch(0)["p0"].sum().mul(2.0).backward()  # a gradient of 2 into the host buffer
        m.release(0)
    m.keep(0)
    stable = m.stable["p0"]
    assert stable.untyped_storage().data_ptr() == m.arena.buffer.untyped_storage().data_ptr()
    with torch.no_grad():
        stable.add_(5.0)  # an update where it is kept
    stable.grad.add_(1.0)
    m.compute_updated(0)
    m.give_back(0)
    chunk = m.chunks[0]
    assert not chunk.kept and not chunk.resident and m.reserved_bytes() == 0
    assert m.arena.stats()["in_use"] <= len(m.residency.cache) * m.layout.chunk_bytes
    assert stable.data_ptr() == chunk.payload.data_ptr()  # the host home again
    assert torch.equal(stable, torch.full((8, 8), 5.0))
    assert torch.equal(stable.grad, torch.full((8, 8), 3.0))
    assert stable.grad.data_ptr() == chunk.grad.data_ptr()
    loads = m.stats.loads
    with m.running(plan([0, 1, 2])):  # paged like any other: loaded from its host home
        assert torch.equal(m.fetch(0)["p0"], torch.full((8, 8), 5.0))
        m.release(0)
        m.fetch(1)
        m.release(1)
        m.fetch(2)
    assert m.stats.loads == loads + 3
