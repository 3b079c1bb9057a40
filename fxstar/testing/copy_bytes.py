"""CopyBytes: the bytes a block writes with copy ops (cat, stack, clone, copy_, casts, index),
op by op, outside the collectives themselves.

Why: a layout change around a collective (stacking sequence slices before a reduce-scatter,
concatenating them after an all-gather) is a copy of activation size that no saved-bytes or
peak measure shows. Copies inside torch.distributed calls and their waits are the backend's
(gloo's reduce_scatter copies its result into the output) and are not counted. Used by the
tensor-parallel tests and the "copied" column of `benchmarks/tp.py`.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["COPY_OPS", "CopyBytes"]

COPY_OPS = frozenset({"cat", "stack", "clone", "copy_", "_to_copy", "index"})


def _in_collective() -> bool:
    """True inside a torch.distributed call or fxstar's wait for one."""
    frame = sys._getframe()
    while frame is not None:
        code = frame.f_code
        if code.co_filename.endswith("distributed_c10d.py") or code.co_qualname == "_Works.wait":
            return True
        frame = frame.f_back
    return False


class CopyBytes(TorchDispatchMode):
    """`by_op`: bytes written per copy op while the mode is on; `copies`: (op, bytes) each."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[str, int]] = []

    @property
    def by_op(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for name, nbytes in self.copies:
            out[name] = out.get(name, 0) + nbytes
        return out

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in COPY_OPS and isinstance(out, torch.Tensor) and not _in_collective():
            self.copies.append((name, out.nbytes))
        return out
