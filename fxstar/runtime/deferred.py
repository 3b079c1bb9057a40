"""Tensors of a state dict that are read only when something needs their values: a checkpoint
of state that lies below host memory (the disk tier's moments) is written a group at a time,
never whole in memory.

A `DeferredTensor` stands where a tensor of a state dict would: its shape and dtype are known
now, its value is one of its group's (a disk-homed chunk's moments, read in one request), which
its `source` reads when asked. `in_groups` turns a mapping of tensors and deferred tensors into
what a streaming writer takes (fxstar.weights.write_safetensors_streamed): the layout, and the
values in that layout's order, each group read once and let go before the next is read.
`read_values` gives deferred tensors tensors of their own, for a caller that wants them all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["DeferredSource", "DeferredTensor", "in_groups", "read_values"]


class DeferredSource(Protocol):
    """Where deferred tensors' values are read, a group at a time."""

    def read(self, groups: Sequence[Hashable]
             ) -> Iterator[tuple[Hashable, Mapping[Hashable, torch.Tensor]]]:  # fmt: skip
        """Each of `groups`, in order, with its tensors by name: valid until the next group is
        asked for, which is read only once the caller let go of them."""
        ...


@dataclass(frozen=True, eq=False)
class DeferredTensor:
    """A tensor not in memory: its shape and dtype, and where its value is read (tensor `name`
    of `group`, which `source` reads)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    source: DeferredSource
    group: Hashable
    name: Hashable

    def meta(self) -> torch.Tensor:
        """A meta tensor of its shape and dtype: what a writer's layout needs of it."""
        return torch.empty(self.shape, dtype=self.dtype, device="meta")


Grouped = dict[int, tuple[DeferredSource, dict[Hashable, list[tuple[str, DeferredTensor]]]]]


def in_groups(
    tensors: Mapping[str, torch.Tensor | DeferredTensor],
) -> tuple[dict[str, torch.Tensor], Iterator[tuple[str, torch.Tensor]]]:
    """A streaming writer's layout (name -> tensor, a meta tensor for a deferred one) and the
    (name, tensor) pairs in its order: the tensors in memory first, as given, then the deferred
    ones a group at a time, each group read once. Close the pairs' iterator if it is not drawn
    to its end (the group in hand is let go)."""
    present = {k: v for k, v in tensors.items() if not isinstance(v, DeferredTensor)}
    grouped: Grouped = {}
    for key, value in tensors.items():
        if isinstance(value, DeferredTensor):
            _, groups = grouped.setdefault(id(value.source), (value.source, {}))
            groups.setdefault(value.group, []).append((key, value))
    layout = dict(present)
    for _, groups in grouped.values():
        layout.update((key, d.meta()) for members in groups.values() for key, d in members)
    return layout, _pairs(present, grouped)


def _pairs(present: dict[str, torch.Tensor], grouped: Grouped
           ) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    yield from present.items()
    for source, groups in grouped.values():
        with contextlib.closing(source.read(list(groups))) as reads:
            for expected, members in groups.items():
                group, values = next(reads, (None, None))
                if values is None or group != expected:
                    raise RuntimeError(f"a deferred source gave group {group!r} where "
                                       f"{expected!r} was asked for")  # fmt: skip
                for key, deferred in members:
                    yield key, values[deferred.name]
                del values  # before the next group is read


def read_values(deferred: Sequence[DeferredTensor]) -> list[torch.Tensor]:
    """The values of `deferred`, in order, each a tensor of its own (a group read once)."""
    keys = [str(i) for i in range(len(deferred))]
    _, pairs = in_groups(dict(zip(keys, deferred, strict=True)))
    with contextlib.closing(pairs):
        values = {key: value.clone() for key, value in pairs}
    return [values[key] for key in keys]
