"""What the nodes of a rewritten graph call. A graph holds the runtime it calls: the chunk
passes add a `ChunkRuntime` submodule, read once by a `get_attr` node, and the Engine that
compiled the graph binds its ChunkManager to it. So a dumped graph reads like the program it
is, and two engines never reach each other's chunks (a checkpointed region recomputing in
backward finds its own engine's manager, whichever engine ran forward last):

    chunk_runtime = self.chunk_runtime
    chunk3 = ops.fetch(chunk_runtime, 3)
    p_h_0_attn_c_attn_weight = ops.param(chunk3, 'h.0.attn.c_attn.weight')
    ...
    ops.release(chunk_runtime, 3)
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
from torch import fx, nn
from torch.fx.node import has_side_effect

if TYPE_CHECKING:
    from fxstar.runtime.chunks import ChunkManager

RUNTIME = "chunk_runtime"  # the submodule's name in a graph module (and in its regions)


class ChunkRuntime(nn.Module):
    """The ChunkManager a graph's chunk nodes call; the Engine binds it after compiling."""

    def __init__(self) -> None:
        super().__init__()
        self.manager: ChunkManager | None = None

    def __deepcopy__(self, memo: dict) -> ChunkRuntime:
        # a copied graph (a kept stage) runs on the same engine: the manager is not copied
        other = ChunkRuntime()
        other.manager = self.manager
        return other

    def get(self) -> ChunkManager:
        if self.manager is None:
            raise RuntimeError(
                "a chunk operation ran in a graph no chunk manager is bound to; run the graph "
                "through the Engine that compiled it"
            )
        return self.manager

    def extra_repr(self) -> str:
        return "unbound" if self.manager is None else f"device={self.manager.device}"


def runtime_of(gm: fx.GraphModule, runtime: ChunkRuntime | None = None) -> ChunkRuntime:
    """The module's ChunkRuntime: `runtime` if given (a region shares its program's), else
    the one it has, else a new one; added as its submodule."""
    runtime = runtime or getattr(gm, RUNTIME, None) or ChunkRuntime()
    if getattr(gm, RUNTIME, None) is not runtime:
        gm.add_submodule(RUNTIME, runtime)
    return runtime


def runtime_node(gm: fx.GraphModule, runtime: ChunkRuntime | None = None) -> fx.Node:
    """The graph's `get_attr` of its ChunkRuntime (see runtime_of), added on first use."""
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target == RUNTIME:
            return node
    runtime_of(gm, runtime)
    first = next((n for n in gm.graph.nodes if n.op != "placeholder"), None)
    context = gm.graph.inserting_before(first) if first is not None else contextlib.nullcontext()
    with context:
        return gm.graph.get_attr(RUNTIME)


def runtimes(gm: fx.GraphModule) -> list[ChunkRuntime]:
    """Every ChunkRuntime a graph module and its regions call, once each."""
    found = {id(m): m for m in gm.modules() if isinstance(m, ChunkRuntime)}
    return list(found.values())


def fetch(runtime: ChunkRuntime, chunk: int) -> dict[str, torch.Tensor]:
    """The chunk's parameters on the compute tier, by every name (aliases included)."""
    return runtime.get().fetch(chunk)


def release(runtime: ChunkRuntime, chunk: int) -> None:
    """The graph is done with every alias of the chunk's parameters until backward."""
    runtime.get().release(chunk)


def param(fetched: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    return fetched[name]


# release returns nothing and fetch may look unused when no parameter of it is read:
# dead-code elimination must keep both.
has_side_effect(fetch)
has_side_effect(release)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """Token ids go to the host, where an embedding kept out of the chunks lives."""
    return t.to("cpu")


def to_compute(
    t: torch.Tensor, runtime: ChunkRuntime, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """A host embedding lookup's result, back on the compute tier (in the compute dtype when
    the host weight is an fp32 master and the compute runs in bf16/fp16)."""
    device = t.device if runtime.manager is None else runtime.manager.device
    return t.to(device=device, dtype=dtype)
