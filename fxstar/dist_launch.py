"""Run a function on N local processes with a process group: tests and benchmarks.

`torchrun` is the way to launch training; this is for code that wants the results of every
rank back in the calling process (a test comparing ranks with a single-process model, a
benchmark printing one table). The group rendezvous through a FileStore in a temporary
directory, so no TCP port is needed; each worker runs with one intra-op thread by default,
since N processes share the machine's cores.
"""

from __future__ import annotations

import gc
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["init_from_env", "spawn"]


def _entry(rank: int, fn: Callable, world_size: int, tmp: str, backend: str, threads: int,
           args: tuple) -> None:  # fmt: skip
    if threads:
        torch.set_num_threads(threads)
    store = dist.FileStore(os.path.join(tmp, "store"), world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(tmp, f"result{rank}.pt"))
    finally:
        # engines the function left behind release their process groups now, while the
        # default group lives, not in the interpreter's teardown after it is gone
        gc.collect()
        dist.destroy_process_group()


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    threads: int = 1,
) -> list[Any]:
    """Call `fn(rank, world_size, *args)` on `world_size` spawned processes, each in an
    initialised process group; return their results in rank order. `fn` must be importable
    (a module-level function) and its result picklable. A worker's exception is raised here
    with its traceback."""
    with tempfile.TemporaryDirectory(prefix="fxstar_dist_") as tmp:
        mp.start_processes(
            _entry,
            args=(fn, world_size, tmp, backend, threads, args),
            nprocs=world_size,
            start_method="spawn",
        )
        return [
            torch.load(os.path.join(tmp, f"result{r}.pt"), weights_only=False)
            for r in range(world_size)
        ]


def init_from_env() -> None:
    """Join the process group `torchrun` describes (RANK, WORLD_SIZE, MASTER_ADDR in the
    environment): NCCL where there is a GPU, gloo elsewhere. Nothing to do when a group exists
    already or the process was not launched by torchrun. With NCCL the local rank's card is
    made current first: NCCL binds each rank to the current card, and ranks left on card 0
    would collide there before compile chose their cards."""
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return
    if not torch.cuda.is_available():
        dist.init_process_group("gloo")
        return
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if local < torch.cuda.device_count():
        torch.cuda.set_device(local)
    dist.init_process_group("nccl")
