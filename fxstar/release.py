"""release_after_init (PatrickStar's option): what happens to the model's
own parameter tensors once the chunk homes hold their values.

By default (False) the engine rebinds the model's parameters to its chunk homes and leaves
the original tensors as they were: intact, never written by training, and freed by Python
once nothing else holds them (a reference the caller kept keeps its bytes). With True their
storage is given back as soon as the homes hold the values, references or not, so the host
never holds the model twice. A model built on the meta device has no original storage: it is
materialised straight into its chunk homes either way.

Under data parallelism it means what PatrickStar means there: every rank initialises every
chunk with the RNG sequence of a serial run and keeps its own. With sharded payloads a meta
model's init (`weights="init"` or a callable) then runs on every parameter, the other ranks'
on storage lent for the init and dropped after (placement.fill), so with the same seed the
owners' chunks hold the serial model's values bit for bit; without the option each rank
initialises its own chunks only (cheaper: no other rank's parameters are ever made). A host
model is already whole on every rank: the owners take rank 0's values, and True frees the
originals as in one process.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["release_storage"]


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
