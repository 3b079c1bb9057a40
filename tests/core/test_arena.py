"""fxstar._C.Arena against a plain Python model of the same best-fit policy."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxstar import _C


class ModelArena:
    """Best fit (smallest block, then lowest offset), allocate at block start, coalesce on free."""

    def __init__(self, capacity: int, alignment: int) -> None:
        self.alignment = alignment
        self.capacity = capacity // alignment * alignment
        self.free_blocks = {0: self.capacity}  # offset -> size
        self.used: dict[int, int] = {}
        self.peak = 0

    def alloc(self, nbytes: int) -> int | None:
        size = -(-nbytes // self.alignment) * self.alignment
        fits = [(s, o) for o, s in self.free_blocks.items() if s >= size]
        if not fits:
            return None
        block, offset = min(fits)
        del self.free_blocks[offset]
        if block > size:
            self.free_blocks[offset + size] = block - size
        self.used[offset] = size
        self.peak = max(self.peak, self.in_use)
        return offset

    def free(self, offset: int) -> None:
        start, size = offset, self.used.pop(offset)
        for o, s in list(self.free_blocks.items()):
            if o + s == start:
                del self.free_blocks[o]
                start, size = o, size + s
            elif o == start + size:
                del self.free_blocks[o]
                size += s
        self.free_blocks[start] = size

    @property
    def in_use(self) -> int:
        return sum(self.used.values())


ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(min_value=1, max_value=40_000)),
        st.tuples(st.just("free"), st.integers(min_value=0, max_value=1_000)),
    ),
    max_size=120,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, alignment=st.sampled_from([256, 512, 4096]))
def test_matches_model_and_keeps_invariants(ops, alignment):
    capacity = 100_000
    arena, model = _C.Arena(capacity, alignment), ModelArena(capacity, alignment)
    live: list[int] = []
    for op, value in ops:
        if op == "alloc":
            expected = model.alloc(value)
            if expected is None:
                with pytest.raises(_C.ArenaOutOfMemory):
                    arena.alloc(value)
                continue
            offset = arena.alloc(value)
            assert offset == expected
            assert offset % alignment == 0
            assert arena.block_size(offset) >= value
            live.append(offset)
        elif live:
            offset = live.pop(value % len(live))
            arena.free(offset)
            model.free(offset)
        spans = sorted((o, o + arena.block_size(o)) for o in live)
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
        assert all(end <= arena.capacity for _, end in spans)
        stats = arena.stats()
        assert stats["in_use"] == model.in_use
        assert stats["peak_in_use"] == model.peak
        assert stats["free_blocks"] == len(model.free_blocks)
        assert stats["largest_free"] == max(model.free_blocks.values(), default=0)
        assert stats["live_blocks"] == len(live)
    for offset in live:
        arena.free(offset)
    stats = arena.stats()
    assert stats["largest_free"] == stats["free_bytes"] == arena.capacity
    assert stats["free_blocks"] == 1
    assert stats["fragmentation"] == 0.0


def test_stats_fragmentation_and_counts():
    arena = _C.Arena(4096, 256)
    offsets = [arena.alloc(256) for _ in range(16)]
    for o in offsets[::2]:
        arena.free(o)
    s = arena.stats()
    assert s["free_bytes"] == 8 * 256 and s["largest_free"] == 256
    assert s["fragmentation"] == pytest.approx(1 - 1 / 8)
    assert (s["total_allocs"], s["total_frees"], s["live_blocks"]) == (16, 8, 8)
    assert s["peak_in_use"] == 4096
    arena.reset_peak()
    assert arena.stats()["peak_in_use"] == 8 * 256


def test_out_of_memory_is_a_memory_error_with_the_numbers():
    arena = _C.Arena(4096, 256)
    a = arena.alloc(1024)
    arena.alloc(1024)
    arena.free(a)  # 1024 free at the front, 2048 at the back
    with pytest.raises(MemoryError) as info:
        arena.alloc(3000)
    err = info.value
    assert isinstance(err, _C.ArenaOutOfMemory)
    assert (err.requested, err.free_bytes, err.largest_free) == (3000, 3072, 2048)
    message = str(err)
    assert "3000 bytes" in message and "3072 bytes" in message and "2048 bytes" in message
    assert arena.stats()["failed_allocs"] == 1


@pytest.mark.parametrize("nbytes", [0, -1])
def test_non_positive_sizes_are_refused(nbytes):
    with pytest.raises(ValueError, match="nbytes"):
        _C.Arena(4096).alloc(nbytes)


def test_double_free_and_unknown_offsets_are_refused():
    arena = _C.Arena(4096)
    offset = arena.alloc(10)
    arena.free(offset)
    with pytest.raises(ValueError, match="not a live allocation"):
        arena.free(offset)
    with pytest.raises(ValueError, match="not a live allocation"):
        arena.free(12345)
    with pytest.raises(ValueError):
        arena.block_size(offset)


def test_huge_request_does_not_wrap_around():
    arena = _C.Arena(4096)
    with pytest.raises(_C.ArenaOutOfMemory):
        arena.alloc(2**63 - 1)


@pytest.mark.parametrize(
    ("capacity", "alignment", "field"),
    [(4096, 100, "alignment"), (4096, 128, "alignment"), (100, 256, "capacity")],
)
def test_bad_construction(capacity, alignment, field):
    with pytest.raises(ValueError, match=field):
        _C.Arena(capacity, alignment)


def test_capacity_rounds_down_to_alignment():
    assert _C.Arena(1000, 256).capacity == 768
