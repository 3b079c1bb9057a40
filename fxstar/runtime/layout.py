"""The decisions the chunk passes hand to the runtime, as plain data.

`ChunkLayout` says which parameter lives in which chunk at which offset (chunk_layout pass);
`AccessPlan` says in which order a step will need the chunks, forward then backward, and how
many bytes besides the chunks each moment is expected to need (chunk_schedule pass). The
ChunkManager follows them; a user can read, print or change them between compile and run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ParamSlot:
    name: str  # the store's name of the parameter (the first of its aliases)
    aliases: tuple[str, ...]
    chunk: int
    offset: int  # in elements, within the chunk
    shape: tuple[int, ...]
    requires_grad: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class ChunkSpec:
    id: int
    params: list[ParamSlot] = field(default_factory=list)
    used: int = 0  # elements taken by parameters

    @property
    def trainable(self) -> bool:
        return any(p.requires_grad for p in self.params)


@dataclass
class ChunkLayout:
    chunk_size: int  # elements per chunk
    dtype: torch.dtype
    chunks: list[ChunkSpec]

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_size * self.dtype.itemsize

    @property
    def param_bytes(self) -> int:
        return sum(c.used for c in self.chunks) * self.dtype.itemsize

    @property
    def wasted_bytes(self) -> int:
        return len(self.chunks) * self.chunk_bytes - self.param_bytes

    def slots(self) -> dict[str, ParamSlot]:
        """Every alias -> its slot."""
        return {alias: p for c in self.chunks for p in c.params for alias in p.aliases}

    def describe(self) -> str:
        lines = [
            f"{len(self.chunks)} chunks of {self.chunk_size:,} {str(self.dtype).split('.')[-1]} "
            f"elements ({self.chunk_bytes:,} bytes); {self.wasted_bytes:,} bytes unused"
        ]
        for c in self.chunks:
            names = ", ".join(p.name for p in c.params)
            lines.append(f"  chunk {c.id}: {c.used:,}/{self.chunk_size:,} elements: {names}")
        return "\n".join(lines)


@dataclass
class AccessPlan:
    """The chunk accesses of one step in the order they will happen."""

    chunks: list[int]  # chunk id per access
    phases: list[str]  # "forward" or "backward" per access
    nonmodel_bytes: list[int]  # expected bytes besides chunks at each access
    pinned_at_once: list[int]  # chunks that must be resident together at each access

    def __len__(self) -> int:
        return len(self.chunks)

    @property
    def forward_len(self) -> int:
        return self.phases.count("forward")
