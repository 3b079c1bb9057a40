"""The disk tier's Adam moments as a checkpoint moves them: one chunk's in host memory at a time.

A save writes them as `DeferredTensor`s (runtime/deferred.py) whose source this is: a chunk's
moments are read when the writer reaches them and let go before the next chunk is read. A load
rewrites them: each chunk's read, the saved values copied in, written back, let go, the next.
Either way the host holds one chunk's moments (one slot of `DiskTier.stream`), whatever the
model's size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from fxstar.runtime.deferred import DeferredTensor
from fxstar.runtime.moments import AdamMoments

if TYPE_CHECKING:
    from fxstar.runtime.chunk import Chunk
    from fxstar.runtime.disk_tier import DiskTier

__all__ = ["DiskMoments"]

SlotMoments = list[dict[str, torch.Tensor]]  # each slot's moments, as AdamMoments.views lays them


class DiskMoments:
    """The moments of `chunks`, each chunk's in part `part` of the disk tier, laid out as
    `moments` lays out a chunk's (see the module)."""

    def __init__(self, disk: DiskTier, part: str, moments: AdamMoments,
                 chunks: Sequence[Chunk]):  # fmt: skip
        self.disk, self.part, self.moments = disk, part, moments
        self.chunks = {chunk.id: chunk for chunk in chunks}

    def deferred(self, chunk: Chunk) -> list[dict[str, DeferredTensor]]:
        """Each slot's moments as deferred tensors of this source, one dict a slot."""
        numels = [s.numel for s in chunk.slots]
        layout = torch.empty(self.moments.nbytes(chunk.used, numels), dtype=torch.uint8,
                             device="meta")  # fmt: skip
        views = self.moments.views(layout, chunk.used, chunk.slots)  # meta: shapes and dtypes
        return [{key: DeferredTensor(tuple(t.shape), t.dtype, self, chunk.id, (index, key))
                 for key, t in slot.items()} for index, slot in enumerate(views)]  # fmt: skip

    def read(self, groups: Sequence[Hashable]
             ) -> Iterator[tuple[Hashable, dict[Hashable, torch.Tensor]]]:  # fmt: skip
        """Each chunk of `groups` with its moments by (slot index, key): the DeferredSource of
        `deferred`'s tensors."""
        with contextlib.closing(self._one_by_one(groups, write_back=False)) as each:
            for chunk, views in each:
                yield chunk.id, {(index, key): t for index, slot in enumerate(views)
                                 for key, t in slot.items()}  # fmt: skip
                del views

    def rewrite(self, chunk_ids: Sequence[int],
                change: Callable[[Chunk, SlotMoments], None]) -> None:  # fmt: skip
        """`change(chunk, moments)` on each chunk's moments, written back before the next
        chunk is read."""
        with contextlib.closing(self._one_by_one(chunk_ids, write_back=True)) as each:
            for chunk, views in each:
                change(chunk, views)
                del views

    def _one_by_one(self, chunk_ids: Sequence[Hashable], *, write_back: bool
                    ) -> Iterator[tuple[Chunk, SlotMoments]]:  # fmt: skip
        """Each chunk with its slots' moments in a host buffer of one slot, read from its
        part; written back (`write_back`) and let go once the caller asks for the next."""
        for chunk_id in chunk_ids:
            chunk = self.chunks[chunk_id]
            stream = self.disk.stream([chunk_id], [self.part], write_back=write_back)
            with contextlib.closing(stream):  # closed inside the item: written back
                _, parts = next(stream)
                views = self.moments.views(parts.pop(self.part), chunk.used, chunk.slots)
                yield chunk, views
                del views
