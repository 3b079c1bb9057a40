"""An engine's state dict one tensor at a time, as `engine.state_dict()` gives each value: what
an export writes, without a second copy of the model in memory.

Every rank of the engine draws the same names in the same order, since a value may be
collective: under tensor parallelism a parameter's shards are all-gathered for it alone (the
parameter store's glue), and with sharded data-parallel payloads the chunks holding it are
broadcast by their owners when first needed and let go after the last name that needs them. So
a rank holds at most the chunks of the value at hand and that value, never the whole model.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from fxstar.runtime.rank_group import guard

if TYPE_CHECKING:
    from fxstar.params import ParameterStore
    from fxstar.runtime.chunk import Chunk
    from fxstar.runtime.data_parallel import ChunkGroups


def state_items(
    store: ParameterStore,
    names: Sequence[str],
    dtypes: Mapping[str, torch.dtype],
    groups: ChunkGroups | None = None,
    chunks: Sequence[Chunk] = (),
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, value) for each of `names`, in order, each value in the model's dtype for it
    (`dtypes`) and let go by this generator before the next is made. `groups` and `chunks`:
    sharded payloads, whose chunks other ranks own (collective; every rank draws alike)."""
    fetched = _FetchedChunks(store, names, groups, chunks) if groups is not None else None
    for index, name in enumerate(names):
        values = fetched.values_for(index) if fetched is not None else None
        value = store.state_value(name, values).to(dtypes[name])
        del values
        yield name, value
        del value
        if fetched is not None:
            fetched.done(index)


class _FetchedChunks:
    """The sharded chunks the names need, broadcast by their owners when first needed and let
    go after the last name that needs them."""

    def __init__(self, store: ParameterStore, names: Sequence[str], groups: ChunkGroups,
                 chunks: Sequence[Chunk]):  # fmt: skip
        self.groups = groups
        holder = {fed: chunk for chunk in chunks if chunk.used
                  for slot in chunk.slots for fed in (slot.name, *slot.aliases)}  # fmt: skip
        self.needs = [
            list(dict.fromkeys(holder[fed] for fed in store.fed_names(name) if fed in holder))
            for name in names
        ]
        self.last = {chunk.id: i for i, needed in enumerate(self.needs) for chunk in needed}
        self.held: dict[int, dict[str, torch.Tensor]] = {}

    def values_for(self, index: int) -> dict[str, torch.Tensor]:
        """The fed values of the chunks name `index` needs (by fed name), fetched if not held."""
        values: dict[str, torch.Tensor] = {}
        for chunk in self.needs[index]:
            if chunk.id not in self.held:
                with guard(f"gathering chunk {chunk.id} for an export (data parallel)",
                           self.groups.group):  # fmt: skip
                    self.held[chunk.id] = self.groups.chunk_parameters(chunk)
            values.update(self.held[chunk.id])
        return values

    def done(self, index: int) -> None:
        """Let go of the chunks no later name needs."""
        for chunk in self.needs[index]:
            if self.last[chunk.id] == index:
                self.held.pop(chunk.id, None)
