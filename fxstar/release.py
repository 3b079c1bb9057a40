"""release_after_init for one process (PatrickStar's option): what happens to the model's
own parameter tensors once the chunk homes hold their values.

By default (False) the engine rebinds the model's parameters to its chunk homes and leaves
the original tensors as they were: intact, never written by training, and freed by Python
once nothing else holds them (a reference the caller kept keeps its bytes). With True their
storage is given back as soon as the homes hold the values, references or not, so the host
never holds the model twice. A model built on the meta device has no original storage: it is
materialised straight into its chunk homes either way.

Under data parallelism the option means more (every rank initialises every chunk with the
serial RNG sequence and keeps its own), which needs sharded payloads: refused there.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from fxstar.errors import OptionNotImplementedError

__all__ = ["check_release", "release_storage"]


def check_release(plan, data_parallel_ranks: int) -> None:
    """Refuse the rank-aware meaning, which is not built yet, by name."""
    if plan.release_after_init and data_parallel_ranks > 1:
        raise OptionNotImplementedError(
            f"Plan option 'release_after_init' under data parallelism ({data_parallel_ranks} "
            "ranks) is not implemented yet: there it means every rank initialises every chunk "
            "with the serial RNG sequence and keeps only its own, which needs sharded chunk "
            "payloads. Set it to False (each rank then holds the model it was given until the "
            "chunks take it), or train in one process"
        )


def release_storage(tensors: Iterable[torch.Tensor]) -> int:
    """Give back the storage of each tensor (once per storage; meta tensors have none): a
    reference kept elsewhere then has no bytes left to read. Returns the bytes freed."""
    freed, seen = 0, set()
    for tensor in tensors:
        if tensor.is_meta:
            continue
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        freed += storage.nbytes()
        storage.resize_(0)
    return freed
