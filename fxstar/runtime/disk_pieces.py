"""A disk-homed chunk's optimizer step a piece at a time.

The disk tier's stream holds `depth` positions' parts in host memory. With a position a whole
chunk, that is `depth` x the largest chunk x (master + moments bytes per element): for a model
of a few large chunks, as much host memory as the state it moved off. A position here is a
piece: at most `elements` elements of one chunk (DeepSpeed's sub_group_size), so the slots hold
`depth` pieces' state whatever the chunk size. Adam is elementwise: a run of parameters split
at a piece's edges updates to the same bits as the whole run.

A piece starts at a multiple of GRANULE elements, so in every region of the chunk's parts (the
fp32 master; each moment's values, which the files lay out a region each, every region on a
page: AdamMoments' `align`) its bytes start on a page: its ranges are direct I/O requests, and
its buffer is laid out as the moments of a chunk of the piece's length (AdamMoments.views of its
fragments). 8-bit moments keep every parameter's absmax values one after another, which a
piece's edge would split off their page: their chunks stream whole.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from fxstar.runtime.chunk import MASTER_PART as MASTER
from fxstar.runtime.disk_io import DIRECT_ALIGNMENT, aligned_size
from fxstar.runtime.disk_tier import DiskTier, Extent
from fxstar.runtime.moments import AdamMoments

__all__ = [
    "GRANULE",
    "MOMENTS",
    "Fragment",
    "Piece",
    "PieceStream",
    "file_moments",
    "largest_piece_bytes",
    "plan_pieces",
]

GRANULE = DIRECT_ALIGNMENT  # elements: a page of every region, whatever its bytes per element
MASTER_BYTES = 4  # an fp32 master element
# a run's elements in one piece, their fp32 master (None: on the host), their moments
RunPiece = tuple[slice, torch.Tensor | None, tuple[torch.Tensor, ...]]
MOMENTS = "moments"  # a chunk's part on the disk tier: both moments, as AdamMoments lays them


@dataclass(frozen=True)
class Fragment:
    """A parameter's elements inside a piece (an AdamMoments slot): `offset` from the piece's
    first element."""

    offset: int
    numel: int

    @property
    def shape(self) -> tuple[int]:
        return (self.numel,)


@dataclass(frozen=True)
class Piece:
    """Elements [lo, hi) of chunk `chunk`, and the parameters' fragments in them."""

    chunk: int
    lo: int
    hi: int
    fragments: tuple[Fragment, ...]


def plan_pieces(chunk_id: int, used: int, slots: Sequence, moments: AdamMoments,
                elements: int) -> list[Piece]:  # fmt: skip
    """The chunk's pieces: [0, used) cut every `elements` (rounded down to GRANULE, at least
    one); one piece with 8-bit moments (see the module)."""
    step = max(GRANULE, elements // GRANULE * GRANULE)
    edges = [0, used] if moments.quantised else [*range(0, used, step), used]
    pieces = []
    for lo, hi in zip(edges, edges[1:]):
        fragments = tuple(
            Fragment(max(s.offset, lo) - lo, min(s.offset + s.numel, hi) - max(s.offset, lo))
            for s in slots if s.offset < hi and s.offset + s.numel > lo
        )  # fmt: skip
        pieces.append(Piece(chunk_id, lo, hi, fragments))
    return pieces


def _ranges(piece: Piece, used: int, numels: Sequence[int], moments: AdamMoments,
            masters: bool) -> dict[str, tuple[tuple[int, int], ...]]:  # fmt: skip
    """The piece's byte ranges of each part's file: the moments' regions (AdamMoments.regions
    of the whole chunk), and the master's."""
    n = piece.hi - piece.lo
    if piece.lo == 0 and piece.hi == used:  # whole regions (every format)
        moment_ranges = [(o, aligned_size(size)) for o, size in moments.regions(used, numels)]
    else:  # fp32 or bf16 values: an element's bytes are the region's size over its length
        moment_ranges = [(o + piece.lo * size // used, aligned_size(n * size // used))
                         for o, size in moments.regions(used, numels)]  # fmt: skip
    ranges = {MOMENTS: tuple(moment_ranges)}
    if masters:
        ranges[MASTER] = ((piece.lo * MASTER_BYTES, aligned_size(n * MASTER_BYTES)),)
    return ranges


def file_moments(state_dtype: str) -> AdamMoments:
    """How the disk tier's files lay out a chunk's moments: every region on a page."""
    return AdamMoments(state_dtype, align=DIRECT_ALIGNMENT)


def largest_piece_bytes(state_dtype: str, used: int, numels: Sequence[int], elements: int,
                        masters: bool) -> int:  # fmt: skip
    """Host bytes of a slot holding this chunk's largest piece: what the stream holds per
    position (DiskTier.stream sizes its slots by the largest)."""
    moments = file_moments(state_dtype)
    first = plan_pieces(0, used, [], moments, elements)[0]
    ranges = _ranges(first, used, numels, moments, masters)
    return sum(n for part in ranges.values() for _, n in part)


def host_slot_bytes(state_dtype: str, chunks: Sequence[tuple[int, Sequence[int]]],
                    elements: int, depth: int, masters: bool) -> int:  # fmt: skip
    """The most host memory the disk tier's slots take for these chunks ((used, parameter
    numels) each): a step's `depth` slots of the largest piece, or a checkpoint's one slot of
    a chunk's whole moments (DiskMoments), whichever is more."""
    step = depth * max((largest_piece_bytes(state_dtype, used, numels, elements, masters)
                        for used, numels in chunks), default=0)  # fmt: skip
    moments = file_moments(state_dtype)
    checkpoint = max((aligned_size(moments.nbytes(used, numels)) for used, numels in chunks),
                     default=0)  # fmt: skip
    return max(step, checkpoint)


class PieceStream:
    """A step's updates of the disk-homed chunks' runs, their pieces streamed in the order the
    runs visit them (the next read and the last written back while this one is updated)."""

    def __init__(self, disk: DiskTier, moments: AdamMoments, pieces: Sequence[Piece],
                 used: dict[int, int], numels: dict[int, list[int]], masters: bool):  # fmt: skip
        self.moments, self.masters = moments, masters
        parts = [MOMENTS, MASTER] if masters else [MOMENTS]
        extents = [
            Extent(piece.chunk, _ranges(piece, used[piece.chunk], numels[piece.chunk], moments,
                                  masters),
                   {MOMENTS: moments.nbytes(piece.hi - piece.lo,
                                            [f.numel for f in piece.fragments]),
                    MASTER: (piece.hi - piece.lo) * MASTER_BYTES})
            for piece in pieces
        ]  # fmt: skip
        self._stream = disk.stream(extents, parts)
        self._ahead = iter(pieces)  # the stream's items, in its order
        self._piece: Piece | None = None
        self._at: dict[int, dict[str, torch.Tensor]] = {}  # a fragment's first element: its moments
        self._master: torch.Tensor | None = None

    def spans(self, chunk_id: int, span: slice) -> Iterator[RunPiece]:
        """The run over elements `span` of the chunk a piece at a time: (the elements, their fp32
        master in the piece's slot or None when the master stays on the host, the moments of
        the run's elements, in the kernel's order)."""
        start = span.start
        while start < span.stop:
            piece = self._piece
            if piece is None or piece.chunk != chunk_id or start >= piece.hi:
                piece = self._next()
                if piece.chunk != chunk_id or not piece.lo <= start < piece.hi:
                    raise RuntimeError(f"disk tier: chunk {chunk_id}'s elements from {start} "
                                       f"are not in piece {piece} the stream reached")  # fmt: skip
            stop = min(span.stop, piece.hi)
            here = slice(start - piece.lo, stop - piece.lo)
            master = None if self._master is None else self._master[here]
            yield slice(start, stop), master, self.moments.run(self._at[start], stop - start)
            start = stop

    def _next(self) -> Piece:
        self._at, self._master = {}, None
        _, buffers = next(self._stream)
        piece = self._piece = next(self._ahead)
        views = self.moments.views(buffers[MOMENTS], piece.hi - piece.lo, piece.fragments)
        self._at = {piece.lo + f.offset: v for f, v in zip(piece.fragments, views, strict=True)}
        if self.masters:
            self._master = buffers[MASTER].view(torch.float32)
        return piece

    def close(self) -> None:
        """The last piece written back, every request waited for."""
        self._at, self._master = {}, None
        with contextlib.suppress(StopIteration):
            self._stream.close()
