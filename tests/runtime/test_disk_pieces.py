"""A disk-homed chunk's step in pieces (fxstar/runtime/disk_pieces.py): pieces start on a page of
every part's region, cover the chunk's parameters exactly, and the slot bytes the host budget
counts are the bytes the stream holds."""

import contextlib

import pytest
import torch

from fxstar.runtime.disk_pieces import (
    GRANULE,
    MOMENTS,
    PieceStream,
    file_moments,
    largest_piece_bytes,
    plan_pieces,
)
from fxstar.runtime.disk_tier import DiskTier
from fxstar.runtime.layout import ParamSlot
from fxstar.runtime.moments import AdamMoments


def slots(*numels: int, gap: int = 0) -> list[ParamSlot]:
    out, offset = [], 0
    for i, n in enumerate(numels):
        out.append(ParamSlot(name=f"p{i}", aliases=(f"p{i}",), chunk=0, offset=offset,
                             shape=(n,), requires_grad=True))  # fmt: skip
        offset += n + gap
    return out


def test_pieces_cut_every_granule_multiple_and_cover_each_parameter_once():
    layout = slots(5000, 3, 12000, 100, gap=7)
    used = layout[-1].offset + layout[-1].numel
    pieces = plan_pieces(0, used, layout, file_moments("fp32"), elements=2 * GRANULE + 5)
    assert [p.lo for p in pieces] == [0, 2 * GRANULE, 4 * GRANULE]  # rounded down to GRANULE
    assert pieces[-1].hi == used
    covered = [(p.lo + f.offset, f.numel) for p in pieces for f in p.fragments]
    per_param = {s.offset: 0 for s in layout}
    for start, n in covered:  # every fragment inside one parameter
        owner = max(o for o in per_param if o <= start)
        per_param[owner] += n
    assert per_param == {s.offset: s.numel for s in layout}
    # 8-bit moments: one piece, the chunk's slots
    (whole,) = plan_pieces(0, used, layout, file_moments("8bit"), elements=GRANULE)
    assert (whole.lo, whole.hi, len(whole.fragments)) == (0, used, len(layout))


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "8bit"])
def test_file_layout_puts_every_region_on_a_page(state_dtype):
    moments = file_moments(state_dtype)
    regions = moments.regions(10_001, [10_000, 1])
    assert all(offset % 4096 == 0 for offset, _ in regions)
    plain = AdamMoments(state_dtype)  # the host's layout: regions one after another
    assert plain.nbytes(10_001, [10_000, 1]) <= moments.nbytes(10_001, [10_000, 1])


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "8bit"])
def test_streamed_pieces_see_the_chunks_moments_and_the_slots_match_the_budget(
    state_dtype, tmp_path
):
    """Moments written in the whole chunk's file layout read back through the pieces, each
    run's moments at its elements; the host slots are largest_piece_bytes each."""
    layout = slots(6000, 4096, 300, 12000)
    used = layout[-1].offset + layout[-1].numel
    moments = file_moments(state_dtype)
    numels = [s.numel for s in layout]
    buffer = torch.zeros(moments.nbytes(used, numels), dtype=torch.uint8)
    views = moments.views(buffer, used, layout)
    for i, view in enumerate(views):  # each parameter's moments a value of its own
        for t in view.values():
            t.fill_(i + 1 if t.dtype != torch.uint8 else 10 * (i + 1))
    pieces = plan_pieces(0, used, layout, moments, elements=GRANULE)
    with DiskTier(tmp_path / "state", depth=3) as tier:
        tier.add(0, MOMENTS, buffer.nbytes)
        tier.write(0, MOMENTS, buffer)
        tier.add(0, "master", used * 4)
        tier.write(0, "master", torch.arange(used, dtype=torch.float32))
        stream = PieceStream(tier, moments, pieces, {0: used}, {0: numels}, masters=True)
        with contextlib.closing(stream):
            for i, s in enumerate(layout):
                span = slice(s.offset, s.offset + s.numel)
                seen = 0
                for part, master, run in stream.spans(0, span):
                    assert torch.equal(master, torch.arange(part.start, part.stop,
                                                            dtype=torch.float32))  # fmt: skip
                    assert all(t.numel() > 0 for t in run)
                    values = run[0] if state_dtype != "8bit" else run[0].float() / 10
                    assert torch.all(values.float() == i + 1)
                    seen += part.stop - part.start
                assert seen == s.numel
        slot = largest_piece_bytes(state_dtype, used, numels, GRANULE, masters=True)
        assert tier.stats.peak_staging_bytes == min(3, len(pieces)) * slot  # depth at most
        if state_dtype != "8bit":  # a piece's slot: a granule's master and moments
            assert slot == GRANULE * (4 + moments.bytes_per_element())
