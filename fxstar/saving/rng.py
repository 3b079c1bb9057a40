"""The random state a checkpoint saves, so a run with dropout resumes bit for bit: torch's CPU
and CUDA generators, Python's and NumPy's (the process's), and under tensor parallelism the
rank's own stream (runtime/rank_stream.py, which draws dropout on split tensors)."""

from __future__ import annotations

import random
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fxstar.errors import CheckpointError

if TYPE_CHECKING:
    from fxstar.runtime.rank_stream import RankStream


def rng_state() -> dict[str, Any]:
    """torch's CPU and CUDA generators, Python's `random` and NumPy's global generator."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
        "python": random.getstate(),
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
    }


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    cuda = list(state.get("cuda", []))
    if cuda:
        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if available < len(cuda):
            warnings.warn(
                f"checkpoint has RNG states for {len(cuda)} CUDA devices, this machine "
                f"{available}: restoring {available}",
                stacklevel=3,
            )
        for i, s in enumerate(cuda[:available]):
            torch.cuda.set_rng_state(s, i)
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))


def stream_state(stream: RankStream | None) -> dict[str, Any]:
    """The tensor-parallel RNG stream's state under "tensor_parallel" (none: nothing)."""
    return {} if stream is None else {"tensor_parallel": stream.state_dict()}


def set_stream_state(stream: RankStream | None, rng: Mapping[str, Any]) -> None:
    if stream is not None:
        check_stream(stream, rng)
        stream.load_state_dict(rng["tensor_parallel"])


def check_stream(stream: RankStream | None, rng: Mapping[str, Any]) -> None:
    """A rank with a tensor-parallel stream needs one in the checkpoint's RNG state."""
    if stream is not None and "tensor_parallel" not in rng:
        raise CheckpointError(
            "the checkpoint has no tensor-parallel RNG stream (saved by an older fxstar or "
            "without tensor parallelism): dropout on split tensors cannot resume bit for bit; "
            "load it with rng=False to start the rank streams afresh"
        )
