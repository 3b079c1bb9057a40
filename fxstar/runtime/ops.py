"""What the nodes of a rewritten graph call. Each looks up the engine's runtime that is running
the graph (set around every forward), so a dumped graph reads like the program it is:

    fetch_3 = ops.fetch(3)
    p_h_0_attn_c_attn_weight = ops.param(fetch_3, 'h.0.attn.c_attn.weight')
    ...
    ops.release(3)
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import TYPE_CHECKING

import torch
from torch.fx.node import has_side_effect

if TYPE_CHECKING:
    from fxstar.runtime.chunks import ChunkManager

ACTIVE: ContextVar[ChunkManager | None] = ContextVar("fxstar_chunk_manager", default=None)
# The manager of the latest forward: a checkpointed region's recomputation runs its fetches
# during backward, outside the forward's context.
LAST: list[ChunkManager] = []


def _manager() -> ChunkManager:
    manager = ACTIVE.get() or (LAST[0] if LAST else None)
    if manager is None:
        raise RuntimeError(
            "a chunk operation ran outside an fxstar Engine; run the graph through the "
            "Engine that compiled it"
        )
    return manager


def fetch(chunk: int) -> dict[str, torch.Tensor]:
    """The chunk's parameters on the compute tier, by every name (aliases included)."""
    return _manager().fetch(chunk)


def release(chunk: int) -> None:
    """The graph is done with every alias of the chunk's parameters until backward."""
    _manager().release(chunk)


def param(fetched: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    return fetched[name]


# release returns nothing and fetch may look unused when no parameter of it is read:
# dead-code elimination must keep both.
has_side_effect(fetch)
has_side_effect(release)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """Token ids go to the host, where an embedding kept out of the chunks lives."""
    return t.to("cpu")


def to_compute(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host embedding lookup's result, back on the compute tier (in the compute dtype when
    the host weight is an fp32 master and the compute runs in bf16/fp16)."""
    manager = ACTIVE.get()
    device = t.device if manager is None else manager.device
    return t.to(device=device, dtype=dtype)
