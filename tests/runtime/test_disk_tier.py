"""The disk tier's files, stream, lock and cleanup (fxstar/runtime/disk_tier.py), on a temporary
directory: what a step writes is what the next reads, bit for bit, through a bounded number of
host slots, and nothing of a user's is removed."""

import contextlib
import gc
import os

import pytest
import torch

from fxstar.errors import DiskIOError
from fxstar.runtime.disk_io import aligned_size
from fxstar.runtime.disk_tier import LOCK_NAME, DiskTier, DiskTierError, Extent

SIZES = {0: 1000, 1: 4096 + 8, 2: 12, 3: 777}  # bytes of each item's part: none aligned


def filled(tier: DiskTier, seed: int = 0) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    data = {}
    for item, n in SIZES.items():
        tier.add(item, "master", n)
        data[item] = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        tier.write(item, "master", data[item])
    return data


def test_a_part_reads_back_bitwise(tmp_path):
    with DiskTier(tmp_path / "state") as tier:
        data = filled(tier)
        for item, n in SIZES.items():
            assert torch.equal(tier.read(item, "master", torch.empty(n, dtype=torch.uint8)),
                               data[item])  # fmt: skip
        floats = torch.randn(250)
        tier.add("f", "moments", floats.nbytes)
        tier.write("f", "moments", floats)
        assert torch.equal(tier.read("f", "moments", torch.empty(250)), floats)


def test_a_stream_writes_back_what_the_caller_changed_through_bounded_slots(tmp_path):
    with DiskTier(tmp_path / "state", depth=3) as tier:
        data = filled(tier)
        for round_ in range(3):
            seen = []
            with contextlib.closing(tier.stream(list(SIZES), ["master"])) as stream:
                for item, parts in stream:
                    assert torch.equal(parts["master"], data[item]), (round_, item)
                    parts["master"].add_(1)  # uint8: wraps
                    data[item] = data[item] + 1
                    seen.append(item)
            assert seen == list(SIZES)
        largest = aligned_size(max(SIZES.values()))
        assert tier.stats.peak_staging_bytes == 3 * largest  # 3 slots of the largest part
        read, written, _ = tier.stats.per_stream[-1]
        assert read == written == sum(map(aligned_size, SIZES.values()))


def test_an_extent_streams_its_ranges_and_writes_back_only_those(tmp_path):
    page = 4096
    with DiskTier(tmp_path / "state", depth=2) as tier:
        tier.add("c", "moments", 5 * page - 10)
        data = torch.randint(0, 256, (5 * page - 10,), dtype=torch.uint8)
        tier.write("c", "moments", data)
        # two pieces: pages 0 and 3, then page 1 and the last page (the part's end)
        extents = [Extent("c", {"moments": ((0, page), (3 * page, page))}, {"moments": 2 * page}),
                   Extent("c", {"moments": ((page, page), (4 * page, page))},
                          {"moments": 2 * page - 10})]  # fmt: skip
        with contextlib.closing(tier.stream(extents, ["moments"])) as stream:
            for extent, parts in stream:
                (offset_a, _), (offset_b, _) = extent.ranges["moments"]
                got = parts["moments"]
                assert torch.equal(got[:page], data[offset_a : offset_a + page])
                assert torch.equal(got[page:], data[offset_b : offset_b + got.numel() - page])
                got.add_(1)
        changed = data.clone()
        for lo in (0, 3 * page, 4 * page, page):
            changed[lo : lo + page] += 1
        assert torch.equal(tier.read("c", "moments", torch.empty_like(data)), changed)
        assert tier.stats.peak_staging_bytes == 2 * 2 * page  # two slots of two pages
        with pytest.raises(ValueError, match="'moments' of 'c'.* at 100 is not whole 4096"):
            next(tier.stream([Extent("c", {"moments": ((100, page),)}, {"moments": page})],
                             ["moments"]))  # fmt: skip
        with pytest.raises(ValueError, match="within its 20,480 bytes"):
            next(tier.stream([Extent("c", {"moments": ((5 * page, page),)}, {"moments": page})],
                             ["moments"]))  # fmt: skip


def test_a_read_only_stream_writes_nothing(tmp_path):
    with DiskTier(tmp_path / "state") as tier:
        data = filled(tier)
        with contextlib.closing(tier.stream(list(SIZES), ["master"], write_back=False)) as s:
            for _, parts in s:
                parts["master"].zero_()
        assert tier.stats.per_stream[-1][1] == 0
        assert torch.equal(tier.read(1, "master", torch.empty(SIZES[1], dtype=torch.uint8)),
                           data[1])  # fmt: skip


def test_a_stream_stopped_inside_an_item_keeps_its_changes_and_waits(tmp_path):
    """As on the host tier, where an update that raised midway left what it wrote."""
    with DiskTier(tmp_path / "state") as tier:
        data = filled(tier)
        stream = tier.stream(list(SIZES), ["master"])
        with pytest.raises(RuntimeError, match="boom"), contextlib.closing(stream):
            for item, parts in stream:
                parts["master"].fill_(7)
                if item == 1:
                    raise RuntimeError("boom")
        for item, n in SIZES.items():
            back = tier.read(item, "master", torch.empty(n, dtype=torch.uint8))
            want = torch.full((n,), 7, dtype=torch.uint8) if item <= 1 else data[item]
            assert torch.equal(back, want), item


def test_a_second_engine_on_the_directory_is_refused_by_name(tmp_path):
    directory = tmp_path / "state"
    with (
        DiskTier(directory),
        pytest.raises(DiskTierError, match=f"in use by another engine \\(process {os.getpid()}"),
    ):
        DiskTier(directory)
    DiskTier(directory).close()  # free again once the first closed


def test_close_removes_what_the_tier_made_and_nothing_else(tmp_path):
    made = tmp_path / "made"
    with DiskTier(made) as tier:
        filled(tier)
    assert not made.exists()

    mine = tmp_path / "users"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with DiskTier(mine) as tier:
        filled(tier)
        assert len(list(mine.iterdir())) == 2 + len(SIZES)  # notes, lock, parts
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]

    kept = tmp_path / "kept"
    with DiskTier(kept, keep=True) as tier:
        filled(tier)
    assert sorted(p.name for p in kept.iterdir()) == sorted(
        [LOCK_NAME] + [f"fxstar-{i}-master.bin" for i in SIZES]
    )
    DiskTier(kept).close()  # the lock of a closed tier is free


def test_a_part_that_lost_its_bytes_is_a_named_error_at_the_read(tmp_path):
    with DiskTier(tmp_path / "state") as tier:
        filled(tier)
        os.truncate(tier.path_of(2, "master"), 0)  # someone else's doing
        stream = tier.stream(list(SIZES), ["master"])
        with pytest.raises(DiskIOError, match="fxstar-2-master.bin"), contextlib.closing(stream):
            for _ in stream:
                pass


def test_a_vanished_directory_is_a_named_error_when_a_part_is_added(tmp_path):
    directory = tmp_path / "state"
    with DiskTier(directory) as tier:
        for p in directory.iterdir():
            p.unlink()
        directory.rmdir()
        with pytest.raises(DiskIOError, match="state"):
            tier.add(0, "master", 100)


def test_wrong_sizes_and_unknown_parts_are_refused(tmp_path):
    with DiskTier(tmp_path / "state") as tier:
        filled(tier)
        with pytest.raises(ValueError, match="holds 1,000 bytes"):
            tier.write(0, "master", torch.zeros(10, dtype=torch.uint8))
        with pytest.raises(KeyError, match="no part 'moments'"):
            tier.read(0, "moments", torch.zeros(1000, dtype=torch.uint8))
        with pytest.raises(ValueError, match="added already"):
            tier.add(0, "master", 10)
    with pytest.raises(DiskTierError, match="not a directory"):
        (tmp_path / "file").write_text("x")
        DiskTier(tmp_path / "file")


def test_a_part_reads_as_zeros_even_over_a_file_left_by_a_tier_not_closed(tmp_path):
    directory = tmp_path / "state"
    with DiskTier(directory, keep=True) as tier:
        filled(tier)  # random bytes, kept
    with DiskTier(directory) as tier:
        tier.add(1, "master", SIZES[1])
        back = tier.read(1, "master", torch.ones(SIZES[1], dtype=torch.uint8))
        assert not back.any()


def test_a_tier_dropped_without_close_releases_at_collection(tmp_path):
    directory = tmp_path / "state"
    tier = DiskTier(directory)
    filled(tier)
    del tier
    gc.collect()
    assert not directory.exists()
    DiskTier(directory).close()
