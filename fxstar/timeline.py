"""A picture of memory through one step: what a user reads to pick a budget.

Per moment (each chunk access of the last traced step): the chunk bytes resident on the
compute tier, the share they were allowed, the bytes saved for backward (activations), and
the budget. Needs matplotlib (`pip install fxstar[viz]`).
"""

from __future__ import annotations

import os

from fxstar.runtime.tracer import MemoryTracer


def plot_timeline(tracer: MemoryTracer, budget: int, path: str | os.PathLike, title: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError(
            "engine.memory_timeline needs matplotlib: pip install fxstar[viz]"
        ) from error
    moments = tracer.training_step()
    if not moments:
        raise ValueError("no step traced yet: run a forward and backward through the engine first")
    mib = 1 / 2**20
    x = list(range(len(moments)))
    chunks = [m.chunk_bytes * mib for m in moments]
    activations = [m.nonmodel_bytes * mib for m in moments]
    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=110)
    ax.stackplot(x, chunks, activations, labels=["parameter chunks (compute tier)",
                 "activations saved for backward"], alpha=0.75)  # fmt: skip
    ax.step(x, [m.share * mib for m in moments], where="post", color="black", linewidth=1,
            label="chunk share")  # fmt: skip
    ax.axhline(budget * mib, color="red", linestyle="--", linewidth=1, label="device_memory")
    turn = next((i for i, m in enumerate(moments) if m.phase == "backward"), None)
    if turn is not None:
        ax.axvline(turn - 0.5, color="gray", linestyle=":", linewidth=1)
        ax.text(turn, budget * mib, " backward", va="bottom", color="gray")
    ax.set_xlabel("chunk access (forward, then backward)")
    ax.set_ylabel("MiB")
    ax.set_title(title)
    fig.legend(loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path)
    plt.close(fig)
    return str(path)
