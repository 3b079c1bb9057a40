"""Residency with group loads (sharded data-parallel payloads): a load brings the chunk's whole
group into one block, an eviction drops the whole group, and Belady weighs a group by its
member used soonest. The collectives are stood in for: one process, every chunk its own."""

import pytest
import torch

from fxstar.runtime.chunks import ChunkManager, ChunkState
from fxstar.runtime.layout import AccessPlan, ChunkLayout, ChunkSpec, ParamSlot
from fxstar.runtime.residency import Residency

N = 64  # elements per chunk: one parameter of 8 x 8 each
GROUP = 2  # chunks a load brings


class Gathers:
    """Stands in for ChunkGroups: records which groups were gathered (every member here is
    this process's own, copied into its place before the gather) and which a prefetch's
    gather was waited for."""

    def __init__(self):
        self.gathered: list[int] = []
        self.waited: list[int] = []

    def gather(self, first: int, block: torch.Tensor, *, wait: bool = True) -> object:
        assert block.numel() == GROUP * N
        self.gathered.append(first)
        return None if wait else first  # a prefetch: its "work" waited for at the access

    def arrived(self, chunk_id: int, work: object) -> None:
        self.waited.append(work)


def grouped(chunks: int, groups_resident: int, prefetch: bool = False, staging: int = 0
            ) -> tuple[Residency, Gathers]:  # fmt: skip
    specs = [ChunkSpec(i, [ParamSlot(f"p{i}", (f"p{i}",), i, 0, (8, 8), True)], N)
             for i in range(chunks)]  # fmt: skip
    layout = ChunkLayout(N, torch.float32, specs, ranks=GROUP)
    params = {f"p{i}": torch.full((8, 8), float(i)) for i in range(chunks)}
    budget = groups_resident * GROUP * layout.chunk_bytes + staging
    m = ChunkManager(layout, params, budget=budget, arena_capacity=budget)
    owners = Gathers()
    residency = Residency(
        layout, m.chunks, m.stable, compute=m.compute,
        stats=m.stats, tracer=m.tracer, budget=budget, static_share=None, mem_cache=0,
        prefetch=prefetch, owners=owners, load_unit=GROUP, staging=staging,
    )  # fmt: skip
    residency.checking = True
    return residency, owners


def start(residency: Residency, order: list[int]) -> None:
    n = len(order)
    residency.begin_step(AccessPlan(order, ["forward"] * n, [0] * n, [GROUP] * n))


def resident(residency: Residency) -> list[int]:
    return [c.id for c in residency.chunks if c.resident]


def done(residency: Residency, chunk_id: int) -> None:
    residency.chunks[chunk_id].move(ChunkState.HOLD_AFTER_FWD)


def test_a_load_brings_the_whole_group_into_one_block():
    residency, owners = grouped(4, groups_resident=1)
    start(residency, [1, 0])
    chunk = residency.access(1, "forward")
    assert owners.gathered == [0] and resident(residency) == [0, 1]
    first, second = residency.chunks[0], residency.chunks[1]
    assert second.offset == first.offset + residency.layout.chunk_bytes  # one block
    assert chunk.state is ChunkState.COMPUTE and first.state is ChunkState.HOLD
    assert torch.equal(residency.view(first, 0, (8, 8)), torch.full((8, 8), 0.0))
    assert torch.equal(residency.view(second, 0, (8, 8)), torch.full((8, 8), 1.0))
    done(residency, 1)
    residency.access(0, "forward")  # came with its group: no second gather
    assert owners.gathered == [0] and residency.stats.loads == 2


def test_belady_evicts_the_group_whose_soonest_member_is_farthest():
    residency, owners = grouped(6, groups_resident=2)
    # after 4: chunk 0 is never used again, but its group is, at 1; group (2, 3) only at 3
    start(residency, [0, 2, 4, 1, 3])
    for c in (0, 2, 4):
        residency.access(c, "forward")
        done(residency, c)
    assert resident(residency) == [0, 1, 4, 5] and owners.gathered == [0, 2, 4]
    assert residency.stats.evictions == GROUP  # both chunks of the group, counted


def test_a_member_in_use_keeps_its_group():
    residency, owners = grouped(6, groups_resident=2)
    start(residency, [0, 2, 4, 3, 1])
    residency.access(0, "forward")
    residency.chunks[0].pin()  # still in use at 4: its group stays although used last
    residency.access(2, "forward")
    done(residency, 2)
    residency.access(4, "forward")
    assert resident(residency) == [0, 1, 4, 5]


def test_a_changed_group_with_a_member_in_use_is_an_error_not_a_stale_read():
    residency, _ = grouped(4, groups_resident=2)
    start(residency, [0, 1])
    residency.access(0, "forward")
    residency.chunks[0].pin()
    residency.chunks[1].host_changed()  # an optimizer wrote chunk 1's home
    with pytest.raises(RuntimeError, match="chunk 1 changed while chunks \\[0\\]"):
        residency.access(1, "forward")


def test_prefetch_gathers_the_next_group_the_plan_needs():
    residency, owners = grouped(4, groups_resident=2, prefetch=True)
    start(residency, [0, 1, 2, 3])
    residency.access(0, "forward")  # 1 came with it: the next group needed is (2, 3)
    assert owners.gathered == [0, 2] and owners.waited == []
    assert residency.chunks[2].state is ChunkState.HOLD
    done(residency, 0)
    residency.access(1, "forward")
    done(residency, 1)
    residency.access(2, "forward")  # its gather is waited for once, by the access
    assert owners.waited == [2] and residency.stats.prefetch_hits == 1


def test_prefetch_looks_past_resident_chunks_and_not_past_the_room():
    from test_chunks import manager

    m = manager(3, resident=2)
    m.residency.prefetch = True
    m.residency.begin_step(AccessPlan([0, 0, 1, 2], ["forward"] * 4, [0] * 4, [1] * 4))
    m.residency.access(0, "forward")  # the next access is 0 again: 1 is the one to load
    assert [c.resident for c in m.chunks] == [True, True, False]
    done(m.residency, 0)
    m.residency.access(0, "forward")  # no room for 2 without evicting: nothing more
    assert [c.resident for c in m.chunks] == [True, True, False] and m.stats.loads == 2


def test_gradient_staging_comes_off_every_moments_share():
    """Sharded gradients are staged on the compute tier beside chunks and activations all
    step: the chunks' share at every moment is the budget less the staging and that
    moment's activations, so a budget of three groups with one group's bytes of staging
    holds two groups resident, never three."""
    unit = GROUP * N * 4
    residency, _ = grouped(8, 2, staging=unit)
    assert residency.budget == 3 * unit and residency.share(0) == 2 * unit
    start(residency, [0, 2, 4, 6])
    for chunk in (0, 2, 4):
        residency.access(chunk, "forward")
        done(residency, chunk)
        assert residency.resident_bytes() <= 2 * unit, resident(residency)
    assert len(resident(residency)) == 2 * GROUP and residency.stats.evictions == GROUP
