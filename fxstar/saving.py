"""Checkpoints: an engine's parameters and training state on disk, so a run resumes exactly.

A checkpoint is a directory:

    model.safetensors     consolidated parameters and buffers under the model's own names
                          (what `engine.state_dict()` gives); a tied weight once, its other
                          names in the metadata ("fxstar.aliases"), since safetensors refuses
                          tensors that share memory
    training.safetensors  every tensor of the training state (optimizer moments, RNG states)
    training.json         the training state's structure, with {"__tensor__": key} where a
                          tensor of training.safetensors goes; step, scheduler and RNG state
    manifest.json         every other file's size and CRC-32 (a safetensors file's tensors'
                          too), and a CRC-32 of its own canonical JSON; written last

What is checked on reading (`load`, `engine.load`, and `fxstar.compile(..., weights=dir)` on a
checkpoint directory or one of its files): the manifest against its own checksum, then every
file against the manifest before it is read, so a flipped bit, a truncated or an edited file is
a CheckpointError naming it (and the tensors that differ), never a weight of 5e36 or a learning
rate one bit off. Then every value: training.json's fields and the training state are checked
as a Plan's options are (fxstar/checkpoint_values.py: lr, betas, eps, weight decay, the step
counts, the loss scaler's fields, the RNG states, the file names, which must be files of the
directory), and against the engine (the moments' shapes, the parameter counts, the saved-along
objects) before anything is restored; a refusal names the field and leaves the engine as it
was. JSON that is not JSON, nested past what the decoder recurses into, or of the wrong types
is a CheckpointError naming the file. Not checked: the values of the tensors (a moment of the
right shape holding NaN loads as it was saved), and what objects given to
`engine.register_state` receive (their own `load_state_dict` judges it). A checksum tells
damage from a whole file; it is no signature: whoever can write the directory can write a
consistent checkpoint. Format 2 (checksums of the safetensors files in training.json, none of
training.json) and format 1 (none) still load, with a warning.

The training state is `engine.training_state()`: the step count, the RNG states (torch CPU,
every CUDA device, Python's and NumPy's), `engine.optimizer.state_dict()`, the names of the
parameters its integer ids stand for (so a checkpoint loads even if the parameter order
changed), and the state of everything the engine saves along: its loss scaler (fp16's
`engine.scaler`) under "loss_scaler", a scheduler given to `engine.attach_scheduler`, objects
given to `engine.register_state`.

A save never deletes what fxstar did not write. The target may be absent, an empty directory,
or an fxstar checkpoint (a manifest or training.json of this format) holding only the files it
names; anything else (a directory of other files, a checkpoint with a file of the user's in
it, a file) is refused with a CheckpointError naming it, before anything is written, as is the
working directory or one holding it (`save(".")`). A symbolic link is followed: the checkpoint
it points to is replaced and the link kept (`latest -> run-100` writes run-100).

`save` writes into `<dir>.tmp-<host>-<pid>-XXXX/<dir>` next to the target, moves the old `<dir>`
into `<dir>.old-<host>-<pid>-XXXX/<dir>`, renames the new one into place and deletes the old: a
crash at any point leaves the previous checkpoint whole, and `load` finds it under `.old-` if
it was caught between the two renames. Each scratch directory holds a marker fxstar writes
when it makes it (the format, which path it is for, host and pid): only a directory with that
marker is ever taken for a leftover, so a user's `run.old-v1` beside `run` is neither deleted
nor loaded (nor are markerless leftovers of older fxstar versions). The renames hold an flock
on the parent directory, so two processes saving one path each leave a whole checkpoint (the
last wins); a save first deletes the `.tmp-` directories of killed saves (same host, pid
gone). Siblings are matched by exact name prefix, never by a glob: a name with `*`, `?` or `[`
only ever touches its own.

Under tensor parallelism (`plan.tensor_parallel`, a process group) every rank calls `save`:
the parameters are gathered from the shards and every rank's training state (its RNG, its
shards of the optimizer moments, keyed by the fed names every rank shares) is gathered to rank
0, which alone writes: rank 0's state where a one-rank save puts it, rank r's tensors in
`training.rank<r>.safetensors` (checksummed under "files" like the others) and its structure
under "rank_states"/"<r>" of training.json. Every rank returns once the checkpoint is whole
(or raises rank 0's error). Every rank calls `Checkpoint.apply` (`engine.load`) too: the full
parameters are cut into its shards by the store, and it restores its own rank's training
state, so the run resumes bit for bit. That needs the same world size and tensor-parallel
size; another (or a checkpoint of an older fxstar, with rank 0's state only) is refused with
a CheckpointError: `fxstar.load(dir, model)` before compile still takes its weights.

Under data parallelism (runtime/data_parallel.py) every rank writes its own files into one
scratch directory rank 0 made: its training state (the moments of its own chunks, its RNG;
rank 0's is training.safetensors, rank r's training.rank<r>.safetensors) and, with sharded
payloads, its own chunks' parameters (model.rank<r>.safetensors, rank 0's with the buffers;
training.json's "parameters" lists the files); replicated, rank 0 writes model.safetensors.
Rank 0 checks the target as a one-process save does, before any rank writes; it gathers only
the records (skeletons, checksums), writes training.json and the manifest and swaps the
directory in; no rank's tensors pass through another. training.json says "data_parallel": N.
Loading consolidates: the optimizer states of all ranks are joined into one
(`fxstar.load` returns that), and each rank of any number of data-parallel ranks, or one
process, takes what its own chunks need, so a checkpoint of 2 ranks resumes at 1, 2 or 4. At
the same world size each rank gets its own RNG state back, at another rank 0's.

On a 2-D mesh (tensor x data parallel, fxstar/mesh.py) every rank's state is gathered over
the engine's mesh group (every rank) and written per global rank; each rank's optimizer state
is the moments of its own chunks of its own shards, which no consolidation by name can join,
so such a checkpoint resumes at the same world and tensor-parallel size only, each rank from
its own file (anything else is refused with a CheckpointError).
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import re
import shutil
import socket
import tempfile
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from torch import nn

from fxstar.checkpoint_values import (
    check_fits,
    check_meta,
    check_records,
    check_state,
    is_file_name,
    named,
)
from fxstar.errors import CheckpointError
from fxstar.mesh import DP_GROUP, MESH_GROUP
from fxstar.passes.tensor_parallel import GROUP_KEY
from fxstar.runtime.tp_group import TPGroup, guard, process_group
from fxstar.weights import WeightSource, parse_aliases, write_safetensors

if TYPE_CHECKING:
    from fxstar.engine import Engine

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "load",
    "load_parameters",
    "restore_training_state",
    "save",
    "training_state",
]

FORMAT = "fxstar-checkpoint"
# 3: manifest.json checksums every file, training.json included, and itself; 2: training.json
# checksums the safetensors files; 1: nothing. 1 and 2 load with a warning.
VERSION = 3
PARAMETERS = "model.safetensors"
TENSORS = "training.safetensors"
STATE = "training.json"
MANIFEST = "manifest.json"
MARKER = "fxstar-scratch.json"  # in a save's scratch directory: what makes it fxstar's
ALIASES_KEY = "fxstar.aliases"
RESERVED = ("step", "rng", "optimizer", "optimizer_params")
FIX = "restore it from a copy, or save the checkpoint again"


# -- the training state -------------------------------------------------------------------------


def training_state(engine: Engine) -> dict[str, Any]:
    """Everything besides the parameters that a resumed run needs (tensors still in place)."""
    optimizer = engine.optimizer
    state: dict[str, Any] = {
        "step": {
            "micro_steps": engine.step_count,
            "optimizer_steps": engine.step_count // engine.plan.optimizer.accumulation_steps,
        },
        "rng": {**rng_state(), **_rank_stream_state(engine)},
        "optimizer": optimizer.state_dict(),
        "optimizer_params": _optimizer_names(engine, optimizer),
    }
    for name, obj in engine.stateful().items():
        state[name] = obj.state_dict()
    return state


def restore_training_state(
    engine: Engine, state: Mapping[str, Any], *, strict: bool = True, rng: bool = True
) -> None:
    """Put a `training_state()` back: optimizer, saved-along objects, step, then RNG last;
    everything that can refuse it is checked before anything changes."""
    _restore(engine, state, _fitted(engine, state, strict=strict, rng=rng), rng=rng)


def _fitted(engine: Engine, state: Mapping[str, Any], *, strict: bool, rng: bool,
            file: Path | None = None) -> dict[str, Any]:  # fmt: skip
    """The optimizer state to load, once `state` is known to fit the engine (its objects,
    parameter names and counts, the moments' shapes, the RNG streams): a refusal leaves the
    engine as it was."""
    if rng:
        _check_rank_stream(engine, state["rng"])
    objects = engine.stateful()
    if strict:
        problems = [f"the checkpoint has {n!r} state but the engine has nothing to load it into"
                    for n in state if n not in RESERVED and n not in objects]  # fmt: skip
        problems += [f"the engine's {n!r} has no state in the checkpoint"
                     for n in objects if n not in state]  # fmt: skip
        if problems:
            raise CheckpointError(
                "training state does not match the engine:\n  " + "\n  ".join(problems)
                + "\n(attach or register the missing objects, or pass strict=False)"
            )  # fmt: skip
    optimizer_state = state["optimizer"]
    if state.get("optimizer_params") is not None:
        optimizer_state = _remap_optimizer(engine, optimizer_state, state["optimizer_params"])
    groups = getattr(engine.optimizer, "param_groups", None)
    if groups is not None:
        saved = [len(g["params"]) for g in optimizer_state.get("param_groups", [])]
        if saved != [len(g["params"]) for g in groups]:
            raise CheckpointError(
                f"optimizer state does not match: the checkpoint's param groups hold {saved} "
                f"parameters, the optimizer's {[len(g['params']) for g in groups]}"
            )
        params = [p for g in groups for p in g["params"]]
        check_fits(optimizer_state, params, objects, state, file or Path(STATE))
    return optimizer_state


def _restore(engine: Engine, state: Mapping[str, Any], optimizer_state: dict[str, Any], *,
             rng: bool) -> None:  # fmt: skip
    engine.optimizer.load_state_dict(optimizer_state)
    for name, obj in engine.stateful().items():
        if name in state:
            obj.load_state_dict(state[name])
    engine.step_count = int(state["step"]["micro_steps"])
    if rng:
        set_rng_state(state["rng"])
        _set_rank_stream_state(engine, state["rng"])


def _optimizer_names(engine: Engine, optimizer: Any) -> list[list[str]] | None:
    """Per param group, the engine's name of each parameter the optimizer holds."""
    groups = getattr(optimizer, "param_groups", None)
    if groups is None:
        return None
    name_of = {id(p): n for n, p in engine.named_parameters()}
    try:
        return [[name_of[id(p)] for p in group["params"]] for group in groups]
    except KeyError:
        return None  # an optimizer over tensors the engine does not name: keep torch's ids


def _remap_optimizer(engine: Engine, saved: dict[str, Any], names: list[list[str]]) -> dict:
    """torch keys optimizer state by position; map the saved positions to today's by name."""
    current = _optimizer_names(engine, engine.optimizer)
    groups = saved.get("param_groups")
    if current is None or groups is None:
        return saved
    problems = []
    if len(current) != len(names) or len(groups) != len(names):
        problems.append(f"{len(names)} param groups saved, the optimizer has {len(current)}")
    for i, (was, now) in enumerate(zip(names, current)):
        missing, unexpected = sorted(set(now) - set(was)), sorted(set(was) - set(now))
        if missing:
            problems.append(f"group {i}: missing in the checkpoint: {', '.join(missing)}")
        if unexpected:
            problems.append(f"group {i}: not in the optimizer: {', '.join(unexpected)}")
    if problems:
        raise CheckpointError("optimizer state does not match:\n  " + "\n  ".join(problems))
    index = {n: i for i, n in enumerate(n for group in current for n in group)}
    new_id = {}
    for group, group_names in zip(groups, names):
        for old, name in zip(group["params"], group_names):
            new_id[old] = index[name]
    return {
        **saved,
        "state": {new_id[k]: v for k, v in saved.get("state", {}).items()},
        # torch pairs a group's ids with the optimizer's tensors by position: today's order
        "param_groups": [
            {**group, "params": [index[n] for n in now]} for group, now in zip(groups, current)
        ],
    }


def _rank_stream(engine: Engine) -> Any:
    """The tensor-parallel RNG tracker of the engine's process group, or None."""
    group = engine.shared.get(GROUP_KEY)
    return None if group is None else group.stream


def _rank_stream_state(engine: Engine) -> dict[str, Any]:
    stream = _rank_stream(engine)
    return {} if stream is None else {"tensor_parallel": stream.state_dict()}


def _set_rank_stream_state(engine: Engine, rng: Mapping[str, Any]) -> None:
    stream = _rank_stream(engine)
    if stream is not None:
        _check_rank_stream(engine, rng)
        stream.load_state_dict(rng["tensor_parallel"])


def _check_rank_stream(engine: Engine, rng: Mapping[str, Any]) -> None:
    if _rank_stream(engine) is not None and "tensor_parallel" not in rng:
        raise CheckpointError(
            "the checkpoint has no tensor-parallel RNG stream (saved by an older fxstar or "
            "without tensor parallelism): dropout on split tensors cannot resume bit for bit; "
            "load it with rng=False to start the rank streams afresh"
        )


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


# -- saving -------------------------------------------------------------------------------------


def save(engine: Engine, path: str | os.PathLike) -> Path:
    """Write `engine`'s checkpoint to directory `path`, replacing any there atomically. Under
    tensor parallelism every rank must call it (the parameters are gathered); rank 0 writes."""
    if engine.data_parallel_size > 1 and _tp_size(engine) == 1:  # each rank its own files
        return _save_data_parallel(engine, path)
    params, aliases = _dedupe(engine.state_dict())  # collective under tensor parallelism
    ranks = _ranks(engine)
    if ranks == 1:
        return _save(engine, path, params, aliases, ranks, [_to_json(training_state(engine))])
    group = _group(engine)
    # collective: every rank's training state to rank 0
    states = _gather(group, lambda: _to_json(training_state(engine)))

    def write() -> Path:
        return _save(engine, path, params, aliases, ranks,
                     _checked(states, "give its training state"))  # fmt: skip

    return _on_rank_zero(write, group)


def _gather(group: TPGroup | None, give: Callable[[], Any]) -> list[Any]:
    """Every rank's `give()` on rank 0, in rank order (empty elsewhere). A rank whose `give`
    raised sends the error's text instead (see `_checked`), so no rank waits for a part that
    never comes."""
    try:
        mine: Any = give()
    except Exception as caught:
        mine = _Failed(f"{type(caught).__name__}: {caught}")
    pg = process_group(group)
    rank = dist.get_rank(pg)  # in the group: a tensor-parallel row of a mesh starts anywhere
    gathered: list[Any] | None = [None] * dist.get_world_size(pg) if rank == 0 else None
    # on the engine's group: bounded by plan.dist_timeout, a failure named (not a hang)
    with guard("gather_object (checkpoint save)", group):
        dist.gather_object(mine, gathered, group=pg, group_dst=0)
    return gathered if rank == 0 else []


class _Failed(str):
    """What a rank sent `_gather` instead of its part: why it could not give it."""


def _checked(gathered: list[Any], doing: str) -> list[Any]:
    """`gathered`, or a CheckpointError naming the first rank that could not do `doing`. Run
    inside `_on_rank_zero`, so every rank learns of it."""
    for rank, part in enumerate(gathered):
        if isinstance(part, _Failed):
            raise CheckpointError(f"rank {rank} could not {doing}: {part}")
    return gathered


def _rank_file(rank: int) -> str:
    """The training-state tensors of `rank` (rank 0's are TENSORS, as in a one-rank save)."""
    return TENSORS if rank == 0 else f"training.rank{rank}.safetensors"


def _save(engine: Engine, path: str | os.PathLike, params: dict[str, torch.Tensor],
          aliases: dict[str, str], ranks: int, states: list[tuple[Any, dict]]) -> Path:  # fmt: skip
    if len(states) != ranks:
        raise CheckpointError(f"{len(states)} training states for {ranks} ranks")
    skeleton, tensors = states[0]
    meta = _meta_of(engine, ranks, aliases, skeleton, [PARAMETERS])
    files = [(PARAMETERS, params, {"format": "pt", ALIASES_KEY: json.dumps(aliases)}),
             (TENSORS, tensors, {"format": "pt"})]  # fmt: skip
    if ranks > 1:  # the other ranks' training states: their own RNG and optimizer shards
        meta["rank_states"] = {}
        for rank, (rank_skeleton, rank_tensors) in enumerate(states[1:], start=1):
            meta["rank_states"][str(rank)] = {"tensors": _rank_file(rank), "state": rank_skeleton}
            files.append((_rank_file(rank), rank_tensors, {"format": "pt"}))

    def write(tmp: Path) -> None:
        records = {name: _write_file(tmp, name, content, metadata)  # tensor by tensor
                   for name, content, metadata in files}  # fmt: skip
        _seal(tmp, meta, records)

    return write_atomically(path, write)


def _meta_of(engine: Engine, ranks: int, aliases: dict[str, str], skeleton: Any,
             parameter_files: list[str]) -> dict[str, Any]:  # fmt: skip
    """training.json's content but the files' records."""
    plan = engine.plan.to_dict()
    plan.pop("loss_fn", None)
    return {
        "format": FORMAT,
        "version": VERSION,
        "torch": torch.__version__,
        "model": type(engine.model).__name__,
        "ranks": ranks,
        "data_parallel": engine.data_parallel_size,
        "parameters": {"file": parameter_files[0], "files": parameter_files, "aliases": aliases},
        "tensors": TENSORS,
        "state": skeleton,
        "plan": _jsonable(plan),
    }


def _seal(directory: Path, meta: Mapping[str, Any], records: Mapping[str, Any]) -> None:
    """Write training.json, then manifest.json: the record (size, CRC-32) of every file,
    training.json's too, and a CRC-32 of its own canonical encoding. Written last, so a
    checkpoint with a manifest is whole."""
    (directory / STATE).write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    files = {**records, STATE: _record(directory / STATE)}
    body = {"format": FORMAT, "version": VERSION, "files": files}
    text = json.dumps({**body, "crc32": _json_crc(body)}, indent=1) + "\n"
    (directory / MANIFEST).write_text(text, encoding="utf-8")


def _record(file: Path) -> dict[str, Any]:
    """What the manifest keeps of a file: its size and CRC-32."""
    return {"bytes": file.stat().st_size, "crc32": _file_crc(file)}


def _json_crc(data: Any) -> str:
    """CRC-32 of `data`'s canonical JSON (sorted keys, no spaces, ASCII): the manifest's
    checksum of itself, independent of how the file is indented."""
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return f"{zlib.crc32(text.encode()):08x}"


def _write_file(directory: Path, name: str, content: Mapping[str, torch.Tensor],
                metadata: Mapping[str, str]) -> dict[str, Any]:  # fmt: skip
    """Write one safetensors file of a checkpoint (tensor by tensor); its record for
    training.json (size and checksums)."""
    crcs = write_safetensors(directory / name, content, metadata)
    return {**_record(directory / name), "tensors": {k: f"{crc:08x}" for k, crc in crcs.items()}}


def _parameter_file(rank: int) -> str:
    """Rank `rank`'s share of a data-parallel checkpoint's parameters."""
    return f"model.rank{rank}.safetensors"


def _save_data_parallel(engine: Engine, path: str | os.PathLike) -> Path:
    """Every data-parallel rank writes its own files into one scratch directory that rank 0
    made: its training state (the moments of its own chunks, its RNG) and, with sharded
    payloads, the parameters of its own chunks (rank 0 adds the buffers; replicated, rank 0
    writes them all). Rank 0 gathers the small records (skeletons, checksums), writes
    training.json and swaps the directory in: never a rank's state through another."""
    group = _group(engine)
    pg = process_group(group)
    rank = dist.get_rank(pg)
    sharded = engine.chunks is not None and engine.chunks.sharded
    box: list[Any] = [None]
    if rank == 0:  # the same checks as a one-process save, before any rank writes
        try:
            target = _prepare(path)
            scratch = _scratch(target, "tmp")
            (scratch / target.name).mkdir()
            box[0] = str(scratch / target.name)
        except CheckpointError as refused:
            box[0] = refused
        except Exception as caught:
            box[0] = CheckpointError(f"rank 0 could not make the checkpoint's directory: {caught}")
    with guard("broadcast_object_list (checkpoint save)", group):
        dist.broadcast_object_list(box, group=pg, group_src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    tmp = Path(box[0])

    def write_mine() -> tuple[Any, dict[str, Any], dict[str, str]]:
        """This rank's files in `tmp`: (its state's skeleton, the files' records, aliases)."""
        if sharded or rank == 0:
            state = engine.local_state_dict() if sharded else engine.state_dict()
            names = dict(engine.model.named_parameters(remove_duplicate=False))
            mine = {k: v for k, v in state.items()  # sharded: meta are other ranks' chunks
                    if not v.is_meta and (rank == 0 or k in names)}  # fmt: skip
            params, aliases = _dedupe(mine)
        else:
            params, aliases = {}, {}
        skeleton, tensors = _to_json(training_state(engine))
        records = {_rank_file(rank): _write_file(tmp, _rank_file(rank), tensors, {"format": "pt"})}
        file = _parameter_file(rank) if sharded else PARAMETERS
        if params or rank == 0:
            header = {"format": "pt", ALIASES_KEY: json.dumps(aliases)}
            records[file] = _write_file(tmp, file, params, header)
        return skeleton, records, aliases

    parts = _gather(group, write_mine)

    def finish() -> Path:
        gathered = _checked(parts, "write its part of the checkpoint")
        files = [f for _, records, _ in gathered for f in records
                 if f == PARAMETERS or f.startswith("model.")]  # fmt: skip
        aliases = {k: v for _, _, a in gathered for k, v in a.items()}
        meta = _meta_of(engine, len(gathered), aliases, gathered[0][0], files)
        meta["rank_states"] = {
            str(r): {"tensors": _rank_file(r), "state": skeleton}
            for r, (skeleton, _, _) in enumerate(gathered) if r > 0
        }  # fmt: skip
        _seal(tmp, meta, {f: r for _, records, _ in gathered for f, r in records.items()})
        return _swap_in(tmp.parent, target)

    def saved() -> Path:
        try:
            return finish()
        except BaseException:
            shutil.rmtree(tmp.parent, ignore_errors=True)
            raise

    return _on_rank_zero(saved, group)


def _tp_size(engine: Engine) -> int:
    config = engine.plan.tensor_parallel
    if config is None or config.size < 2 or not (dist.is_available() and dist.is_initialized()):
        return 1
    return config.size


def _ranks(engine: Engine) -> int:
    """The ranks of one model a tensor-parallel, data-parallel or 2-D mesh engine runs on,
    whose save is collective; else 1."""
    return _tp_size(engine) * engine.data_parallel_size


def _group(engine: Engine) -> TPGroup | None:
    """The engine's process group over every rank of its model (the mesh's, the tensor- or
    the data-parallel one)."""
    for key in (MESH_GROUP, GROUP_KEY, DP_GROUP):
        if engine.shared.get(key) is not None:
            return engine.shared[key]
    return None


def _rank(engine: Engine) -> int:
    """This rank's place among `_ranks(engine)` (its rank in `_group(engine)`)."""
    group = _group(engine)
    return dist.get_rank(process_group(group)) if _ranks(engine) > 1 else 0


def _saved_tp(meta: Mapping[str, Any]) -> int:
    """The tensor-parallel size a checkpoint was saved at (1: none)."""
    plan = meta.get("plan")
    saved = plan.get("tensor_parallel") if isinstance(plan, dict) else None
    return int(saved.get("size", 1)) if isinstance(saved, dict) else 1


def _resharded(meta: Mapping[str, Any]) -> bool:
    """Whether loading joins the ranks' optimizer states into one (data parallel alone: each
    rank's moments are whole parameters' of its own chunks; under tensor parallelism they
    are shards)."""
    return _data_parallel(meta) > 1 and _saved_tp(meta) == 1


def _data_parallel(meta: Mapping[str, Any]) -> int:
    """The data-parallel ranks a checkpoint was saved by (1: none)."""
    return int(meta.get("data_parallel", 1))


def _consolidated(
    directory: Path, meta: Mapping[str, Any], state: dict[str, Any]
) -> tuple[dict, dict[int, Any]]:
    """A data-parallel checkpoint's training state as one process's: rank 0's, its optimizer
    state joined with every other rank's (each held the moments of its own chunks only, under
    the positions of the same parameter list); and each rank's RNG state, read on the way."""
    merged = dict(state["optimizer"]["state"])
    rngs = {0: state["rng"]}
    kept = state["optimizer"].get("fxstar_device_chunks")  # HybridAdam's device half
    for rank in range(1, int(meta["ranks"])):
        other = _rank_state(directory, meta, rank)
        merged.update(other["optimizer"]["state"])
        rngs[rank] = other["rng"]
        theirs = other["optimizer"].get("fxstar_device_chunks")
        if kept is not None and theirs is not None:
            kept = sorted({*kept, *theirs})
    optimizer = {**state["optimizer"], "state": merged}
    if "fxstar_device_chunks" in optimizer:
        optimizer["fxstar_device_chunks"] = kept
    return {**state, "optimizer": optimizer}, rngs


def _on_rank_zero(save: Callable[[], Path], group: TPGroup | None = None) -> Path:
    """Run `save` on rank 0 alone; every rank returns its path, or raises if it failed, so none
    goes on before the checkpoint is whole (a barrier that carries the outcome)."""
    outcome: list[Any] = [None]
    error = None
    if dist.get_rank(process_group(group)) == 0:
        try:
            outcome[0] = save()
        except Exception as caught:  # told to the other ranks first, then raised here
            error = caught
            outcome[0] = CheckpointError(f"rank 0 failed to save the checkpoint: {caught}")
    # on the engine's group: bounded by plan.dist_timeout, a failure named (not a hang)
    with guard("broadcast_object_list (checkpoint save)", group):
        dist.broadcast_object_list(outcome, group=process_group(group), group_src=0)
    if error is not None:
        raise error
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    return outcome[0]


def write_atomically(path: str | os.PathLike, write: Any) -> Path:
    """Run `write(dir)` on a new directory, then swap it in for `path`, the old one kept until
    the new one is in place (see `_target` for what may be replaced)."""
    target = _prepare(path)
    scratch = _scratch(target, "tmp")
    try:
        (scratch / target.name).mkdir()
        write(scratch / target.name)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return _swap_in(scratch, target)


def _prepare(path: str | os.PathLike) -> Path:
    """The directory a save of `path` writes (see `_target`), its parent made and what killed
    saves of it left removed: before anything is written, so a refusal costs nothing."""
    target = _target(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CheckpointError(f"cannot save a checkpoint to {path}: {error}") from error
    with _locked(target.parent):  # not between another save's two renames of `target`
        _replaceable(target)
    _remove_killed_saves(target)  # first: the space they hold may be what this save needs
    return target


def _target(path: str | os.PathLike) -> Path:
    """Where a save of `path` goes: a symbolic link is followed (the checkpoint it points to is
    replaced and the link kept, as `open` writes through a link); the working directory, or
    one holding it, is refused by name."""
    given = Path(path).absolute()
    try:
        target = given.resolve()
    except (OSError, RuntimeError) as error:  # a loop of links
        raise CheckpointError(f"cannot save a checkpoint to {given}: {error}") from error
    with suppress(OSError):  # a working directory that was deleted holds nothing
        cwd = Path.cwd().resolve()
        if target == cwd or target in cwd.parents:
            raise CheckpointError(
                f"cannot save a checkpoint to {given}: it is the working directory {cwd} or "
                "holds it, and a save replaces the whole directory; save to a directory of its "
                f"own, e.g. {given / 'checkpoint'}"
            )
    return target


def _replaceable(target: Path) -> None:
    """Refuse to replace `target` unless it is absent, an empty directory, or an fxstar
    checkpoint that holds only files fxstar wrote: a save never deletes anything else."""
    if not os.path.lexists(target):
        return
    if not target.is_dir():
        raise CheckpointError(
            f"cannot save a checkpoint to {target}: it is a file, not a checkpoint directory; "
            "save to another path, or move the file away first"
        )
    try:
        with os.scandir(target) as scan:
            entries = {e.name: e.is_file(follow_symlinks=False) for e in scan}
    except OSError as error:
        raise CheckpointError(f"cannot save a checkpoint to {target}: {error}") from error
    if not entries:
        return
    own = _own_files(target)
    foreign = sorted(n for n, plain in entries.items() if own is None or n not in own or not plain)
    if not foreign:
        return
    shown = ", ".join(foreign[:10]) + (f" and {len(foreign) - 10} more" * (len(foreign) > 10))
    what = "is not an fxstar checkpoint and" if own is None else "is an fxstar checkpoint but"
    raise CheckpointError(
        f"cannot save a checkpoint to {target}: it {what} holds files fxstar did not write "
        f"({shown}), which a save would delete; save to a new or empty directory, or move "
        "them away first"
    )


def _own_files(directory: Path) -> set[str] | None:
    """The names of the files fxstar wrote in checkpoint `directory` (what its manifest and
    training.json name, whether or not their checksums hold: a damaged checkpoint may be
    replaced), or None if neither says it is an fxstar checkpoint."""
    own: set[str] = set()
    found = False
    for file in (MANIFEST, STATE):
        try:
            data = json.loads((directory / file).read_bytes())
        except (OSError, ValueError, RecursionError):
            continue
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            continue
        found = True
        own |= {MANIFEST, STATE, *_named_files(data)}
    return own if found else None


def _named_files(data: Mapping[str, Any]) -> Iterator[str]:
    """Every plain file name a manifest or training.json gives (any structure tolerated)."""
    names: list[Any] = list(data["files"]) if isinstance(data.get("files"), dict) else []
    names.append(data.get("tensors"))
    parameters = data.get("parameters")
    if isinstance(parameters, dict):
        names.append(parameters.get("file"))
        if isinstance(parameters.get("files"), list):
            names += parameters["files"]
    rank_states = data.get("rank_states")
    if isinstance(rank_states, dict):
        names += [e.get("tensors") for e in rank_states.values() if isinstance(e, dict)]
    yield from (name for name in names if is_file_name(name))


def _swap_in(scratch: Path, target: Path) -> Path:
    """The checkpoint written in `scratch`, synced, in place of `target`; the old one moved
    into an `.old-` scratch directory until the new one is in, then deleted."""
    new = scratch / target.name
    try:
        for file in new.iterdir():
            _fsync(file)
        _fsync(new)
        with _locked(target.parent):
            _replaceable(target)  # again, under the lock: what is there now
            if os.path.lexists(target):
                os.replace(target, _scratch(target, "old") / target.name)
            os.replace(new, target)
            _fsync(target.parent)
            # the one moved aside now, and any an interrupted save left: a newer one is in place
            for old in _leftovers(target, "old"):
                shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # its marker alone, once the rename is done
    return target


def _scratch(target: Path, kind: str) -> Path:
    """A new `<name>.<kind>-<host>-<pid>-XXXX` beside `target` ("tmp": a save writing into its
    `<name>`; "old": the checkpoint it replaces, moved into its `<name>`), holding the marker
    that alone makes a later save treat it as fxstar's: the name is only for people."""
    prefix = f"{target.name}.{kind}-{_host()}-{os.getpid()}-"
    scratch = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
    marker = {"format": FORMAT, "scratch": kind, "of": target.name,
              "host": socket.gethostname(), "pid": os.getpid()}  # fmt: skip
    try:
        (scratch / MARKER).write_text(json.dumps(marker), encoding="utf-8")
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return scratch


def _leftovers(target: Path, kind: str, *, killed: bool = False) -> Iterator[Path]:
    """`target`'s scratch directories of `kind` by their marker (the name's prefix only
    narrows the search; a user's `run.old-v1` has no marker); with `killed`, only those of
    processes of this host that no longer run."""
    if not target.parent.is_dir():
        return
    prefix = f"{target.name}.{kind}-"
    for path in target.parent.iterdir():
        if not path.name.startswith(prefix) or path.is_symlink() or not path.is_dir():
            continue
        marker = _marker(path)
        if marker is None or marker.get("scratch") != kind or marker.get("of") != target.name:
            continue
        pid = marker.get("pid")
        if killed and not (marker.get("host") == socket.gethostname() and isinstance(pid, int)
                           and not _alive(pid)):  # fmt: skip
            continue
        yield path


def _marker(scratch: Path) -> dict[str, Any] | None:
    """The marker `_scratch` wrote in `scratch`, or None."""
    try:
        with open(scratch / MARKER, "rb") as file:
            marker = json.loads(file.read(4096))
    except (OSError, ValueError, RecursionError):
        return None
    return marker if isinstance(marker, dict) and marker.get("format") == FORMAT else None


def _remove_killed_saves(target: Path) -> None:
    """Delete the `.tmp-` directories that saves of `target` killed on this host left (each a
    checkpoint's worth of disk). Kept: those of live processes, of other hosts (their pids
    mean nothing here), and any directory without fxstar's marker."""
    for path in _leftovers(target, "tmp", killed=True):
        shutil.rmtree(path, ignore_errors=True)


def _host() -> str:
    return re.sub(r"[^\w.-]", "_", socket.gethostname()) or "host"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Hold an flock on `directory`: saves into it rename one at a time, so two processes
    saving the same path cannot move each other's directories away. Where the filesystem has
    no flock (some NFS mounts), it runs unlocked."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        with suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _file_crc(file: Path) -> str:
    crc = 0
    with open(file, "rb") as f:
        while block := f.read(1 << 24):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def _tensor_crc(tensor: torch.Tensor) -> str:
    """CRC-32 of a contiguous CPU tensor's bytes, as the file holds them."""
    return f"{zlib.crc32(tensor.reshape(-1).view(torch.uint8).numpy()):08x}"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # directories cannot be fsynced on every platform
        pass
    finally:
        os.close(fd)


def _dedupe(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """One entry per distinct tensor (same memory, shape and strides); alias -> kept name."""
    kept: dict[tuple, str] = {}
    params, aliases = {}, {}
    for name, tensor in state.items():
        t = tensor.detach()
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)
        if t.numel() and key in kept:
            aliases[name] = kept[key]
            continue
        kept[key] = name
        params[name] = t.cpu().contiguous()
    return params, aliases


def _to_json(obj: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """A JSON-able skeleton of `obj` and its tensors by key (the path where each was found)."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(x: Any, path: tuple[str, ...]) -> Any:
        if isinstance(x, torch.Tensor):
            key = "/".join(path)
            tensors[key] = x.detach().cpu().contiguous()
            return {"__tensor__": key}
        if isinstance(x, Mapping):
            if all(isinstance(k, str) for k in x) and not any(k.startswith("__") for k in x):
                return {k: walk(v, (*path, k)) for k, v in x.items()}
            return {"__dict__": [[walk(k, (*path, "key")), walk(v, (*path, str(k)))]
                                 for k, v in x.items()]}  # fmt: skip
        if isinstance(x, list):
            return [walk(v, (*path, str(i))) for i, v in enumerate(x)]
        if isinstance(x, tuple):
            return {"__tuple__": [walk(v, (*path, str(i))) for i, v in enumerate(x)]}
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, (np.integer, np.floating, np.bool_)):
            return x.item()
        raise CheckpointError(
            f"cannot save a {type(x).__name__} at {'/'.join(path)}: training state holds "
            "tensors, numbers, strings, lists, tuples and dicts"
        )

    return walk(obj, ()), tensors


def _from_json(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(skeleton, list):
        return [_from_json(v, tensors) for v in skeleton]
    if not isinstance(skeleton, dict):
        return skeleton
    if "__tensor__" in skeleton:
        return tensors[skeleton["__tensor__"]]
    if "__tuple__" in skeleton:
        return tuple(_from_json(v, tensors) for v in skeleton["__tuple__"])
    if "__dict__" in skeleton:
        return {_from_json(k, tensors): _from_json(v, tensors) for k, v in skeleton["__dict__"]}
    return {k: _from_json(v, tensors) for k, v in skeleton.items()}


def _jsonable(obj: Any) -> Any:
    try:
        json.dumps(obj)
        return obj
    except (TypeError, ValueError):
        return repr(obj)


# -- loading ------------------------------------------------------------------------------------


@dataclass
class Checkpoint:
    """A loaded checkpoint: `parameters` by the model's names (tied names share one tensor),
    `state` as `engine.training_state()` gave it, `meta` from training.json."""

    path: Path
    parameters: dict[str, torch.Tensor]
    state: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)
    # loaded without the parameters' values: `parameters` holds meta tensors (names and
    # shapes, for `check`) and `parameters_one_by_one` reads them when applied
    streamed: bool = False
    # data parallel: each rank's RNG state by rank (the consolidated `state` holds rank 0's)
    rank_rngs: dict[int, Any] = field(default_factory=dict)

    @property
    def step(self) -> int:
        """Optimizer steps taken when the checkpoint was written."""
        return int(self.state["step"]["optimizer_steps"])

    def check(self, expected: Mapping[str, torch.Tensor]) -> None:
        """Raise CheckpointError listing every missing name, unexpected name and shape
        mismatch against `expected` (a state dict, or anything with shapes by name)."""
        problems = mismatches(self.parameters, expected)
        if problems:
            raise CheckpointError(
                f"checkpoint {self.path} does not match the model:\n  " + "\n  ".join(problems)
            )

    def parameters_one_by_one(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of every stored parameter, read one at a time when the checkpoint was
        loaded without them (`engine.load`): a model larger than half the host resumes."""
        if not self.streamed:
            yield from self.parameters.items()
            return
        for file in _parameter_files(self.meta):
            with WeightSource(self.path / file, verify=False) as source:  # verified by load
                for name in source.names():
                    yield name, source.read(name)

    def load_into(self, model: nn.Module) -> None:
        """Copy the parameters into an eager model (in place, like `load_state_dict`). Read
        without them, they are read one tensor at a time into the model's own, which then
        are this checkpoint's `parameters`."""
        own = model.state_dict(keep_vars=True)
        self.check(own)
        if not self.streamed:
            model.load_state_dict(self.parameters)
            return
        _one_by_one(self.parameters_one_by_one(), lambda name, value: own[name].copy_(value))
        self.parameters = {name: t.detach() for name, t in own.items()}
        self.streamed = False

    def apply(self, engine: Engine, *, strict: bool = True, rng: bool = True) -> None:
        """Restore parameters (copied into the engine's own tensors: the optimizer and the
        chunk homes keep theirs), optimizer, scheduler, loss scaler, step and RNG."""
        state = self.state
        ranks = self.meta.get("ranks", 1)
        if ranks != 1 or _ranks(engine) != 1:
            self._resumable_by(engine)
        # collective under tensor parallelism (the parameters are gathered): every rank is here;
        # sharded payloads: names and shapes suffice (other ranks' chunks are meta here)
        sharded = engine.chunks is not None and engine.chunks.sharded
        self.check(engine.local_state_dict() if sharded else engine.state_dict())
        rank = _rank(engine) if ranks != 1 and _ranks(engine) == ranks else 0
        if rank != 0 and _resharded(self.meta):  # consolidated: only the RNG is its own
            state = {**state, "rng": self.rank_rngs[rank]}
        elif rank != 0:  # tensor parallel: the rank's own shards (rank 0's is self.state)
            state = _rank_state(self.path, self.meta, rank)
        optimizer_state = _fitted(engine, state, strict=strict, rng=rng, file=self.path / STATE)
        copy_parameters(engine, self.parameters_one_by_one())  # a rank's shards cut by the store
        engine.zero_grad(set_to_none=True)
        _restore(engine, state, optimizer_state, rng=rng)

    def _resumable_by(self, engine: Engine) -> None:
        """A tensor-parallel checkpoint resumes an engine of the same world and tensor-parallel
        size, each rank from its own training state; a data-parallel one (or a one-process one)
        resumes one without tensor parallelism at any number of data-parallel ranks, each
        taking the optimizer state of its own chunks from the consolidated state (the RNG
        states are the ranks' own at the same world size, rank 0's otherwise); anything else is
        refused here."""
        ranks, mine = self.meta.get("ranks", 1), _ranks(engine)
        saved_tp = _saved_tp(self.meta)
        config = engine.plan.tensor_parallel
        my_tp = config.size if config is not None else 1
        if saved_tp == my_tp == 1 and (_data_parallel(self.meta) > 1 or ranks == 1):
            return  # data parallel or one process: the optimizer state reshards by name
        if ranks != mine or (ranks != 1 and saved_tp != my_tp):
            raise CheckpointError(
                f"{self.path} was saved by {ranks} tensor-parallel ranks (tensor_parallel size "
                f"{saved_tp} x {_data_parallel(self.meta)} data-parallel replicas); this engine "
                f"runs on {mine} (size {my_tp} x {engine.data_parallel_size}): a run resumes "
                "at the same world size and tensor-parallel size only (resharding tensor-"
                "parallel optimizer state is not supported); to start afresh from its weights, "
                "load its parameters into the model before compile (fxstar.load(dir, model))"
            )
        if "rank_states" not in self.meta:
            raise CheckpointError(
                f"{self.path} was saved by {ranks} tensor-parallel ranks with rank 0's training "
                "state only (an older fxstar), so it cannot resume a run; load its parameters "
                "into the model before compile (fxstar.load(dir, model)) and start the "
                "optimizer afresh"
            )


def mismatches(
    found: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]
) -> list[str]:
    """Every difference of names and shapes, not just the first."""
    problems = [f"missing: {n} {tuple(t.shape)}" for n, t in expected.items() if n not in found]
    problems += [f"unexpected: {n} {tuple(t.shape)}" for n, t in found.items()
                 if n not in expected]  # fmt: skip
    problems += [
        f"shape mismatch: {n} is {tuple(t.shape)} in the checkpoint, "
        f"{tuple(expected[n].shape)} in the model"
        for n, t in found.items()
        if n in expected and tuple(t.shape) != tuple(expected[n].shape)
    ]
    return problems


def copy_parameters(
    engine: Engine, params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
) -> None:
    """Copy into the tensors the engine trains, never replacing them (the optimizer, the chunk
    manager and the model hold them; a copy bumps their version, so a chunk whose compute
    copy is stale is fetched again). A parameter a pass cut into parts (tiles) is cut the
    same way; a buffer is copied into the engine's own. Given pairs one at a time, each
    value is let go before the next is read."""
    store = engine.store
    fed = store.tensors()
    done: set[str] = set()

    def copy(name: str, value: torch.Tensor) -> None:
        if name in fed and not isinstance(fed[name], nn.Parameter):
            fed[name].copy_(value)  # a buffer (bf16/fp16: the traced copy's)
            return
        canonical = store.aliases(name)[0]
        if canonical not in done:
            done.add(canonical)
            store.assign(canonical, value)

    _one_by_one(params.items() if isinstance(params, Mapping) else params, copy)


def _one_by_one(
    pairs: Iterable[tuple[str, torch.Tensor]], copy: Callable[[str, torch.Tensor], Any]
) -> None:
    """`copy(name, value)` for each pair, without grad; each value let go before the next is
    read, so a stream of a checkpoint's tensors never holds two."""
    pairs = iter(pairs)
    with torch.no_grad():
        while (pair := next(pairs, None)) is not None:
            copy(*pair)
            del pair


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint directory; if a save was interrupted between its two renames, the
    previous checkpoint it had moved aside (`<dir>.old-XXXX/<dir>`, found by fxstar's marker
    in it, never by its name alone)."""
    target = Path(path).absolute()
    if (target / STATE).exists() or (target / MANIFEST).exists():
        return target
    with suppress(OSError, RuntimeError):
        real = target.resolve()  # a save wrote beside the directory a link points to
        olds = [old / real.name for old in _leftovers(real, "old")
                if (old / real.name / STATE).exists()]  # fmt: skip
        if not real.exists() and olds:
            old = max(olds, key=lambda p: (p / STATE).stat().st_mtime)
            warnings.warn(f"{target} missing: loading {old}, left by an interrupted save",
                          stacklevel=3)  # fmt: skip
            return old
    raise CheckpointError(f"no fxstar checkpoint at {target} ({STATE} not found)")


def verified_files(path: Path) -> list[Path] | None:
    """If `path` is an fxstar checkpoint directory (or a file of one): the files to read its
    parameters from (or that file), each first checked against its checksum, training.json
    and the manifest too. None if it is no fxstar checkpoint (`weights=` of compile reads
    other safetensors as they are)."""
    directory, name = (path, None) if path.is_dir() else (path.parent, path.name)
    if not _claims_checkpoint(directory):
        return None
    meta = _meta(directory)
    if name is None:
        return [_checked_member(directory, meta, n) for n in _parameter_files(meta)]
    if name in meta.get("files", {}):
        return [_checked_member(directory, meta, name)]
    return None  # format 1 (no checksums: _meta warned), or a file the checkpoint does not record


def _claims_checkpoint(directory: Path) -> bool:
    """Whether `directory` says it is an fxstar checkpoint: a manifest, or a training.json
    that names fxstar's format (read as bytes: a damaged one still says so)."""
    if os.path.lexists(directory / MANIFEST):
        return True
    try:
        with open(directory / STATE, "rb") as file:
            return FORMAT.encode() in file.read(1 << 16)
    except OSError:
        return False


def load_parameters(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The parameters of a checkpoint under every model name (tied names share one tensor):
    `model.load_state_dict(load_parameters(dir))` works on the original eager model."""
    directory = resolve(path)
    return _parameters(directory, _meta(directory))


def load(
    path: str | os.PathLike, model: nn.Module | None = None, *, read_parameters: bool = True
) -> Checkpoint:
    """Read a checkpoint; with `model`, also check it against the model and load its
    parameters into it one tensor at a time (before `fxstar.compile`: a model keeps its
    weights through compile); `parameters` are then the model's own tensors.
    `Checkpoint.apply(engine)` or `engine.load(dir)` restores an engine. With
    `read_parameters=False` the parameters' file is checked (size, checksum) but its tensors
    are read only when applied, one at a time."""
    directory = resolve(path)
    meta = _meta(directory)
    with _reading(directory / STATE):
        skeleton = meta.pop("state")
    state = _state(directory, meta, meta.get("tensors", TENSORS), skeleton)
    rank_rngs: dict[int, Any] = {}
    if _resharded(meta):
        state, rank_rngs = _consolidated(directory, meta, state)
    if read_parameters and model is None:
        checkpoint = Checkpoint(directory, _parameters(directory, meta), state, meta,
                                rank_rngs=rank_rngs)  # fmt: skip
    else:
        checkpoint = Checkpoint(directory, _parameter_shapes(directory, meta), state, meta,
                                streamed=True, rank_rngs=rank_rngs)  # fmt: skip
    if model is not None:
        checkpoint.load_into(model)
    return checkpoint


def _state(directory: Path, meta: Mapping[str, Any], name: Any, skeleton: Any) -> dict[str, Any]:
    """A training state: `skeleton` (from training.json) with the tensors of file `name`."""
    tensors, _ = _read_tensors(directory, meta, name)
    with _reading(directory / STATE):
        state = _from_json(skeleton, tensors)
    check_state(state, directory / STATE)  # before any of it reaches torch
    return state


def _rank_state(directory: Path, meta: Mapping[str, Any], rank: int) -> dict[str, Any]:
    """The training state rank `rank` (> 0) of a tensor-parallel save wrote."""
    with _reading(directory / STATE):
        entry = meta["rank_states"][str(rank)]
        name, skeleton = entry["tensors"], entry["state"]
    return _state(directory, meta, name, skeleton)


@contextmanager
def _reading(file: Path) -> Iterator[None]:
    """Turn what a damaged or edited `file` raises (JSONDecodeError, KeyError, SafetensorError,
    a JSON nested too deeply, a missing file...) into a CheckpointError that names it and says
    what would fix it."""
    try:
        yield
    except CheckpointError:
        raise
    except (SafetensorError, OSError, LookupError, TypeError, ValueError, AttributeError,
            RecursionError) as e:  # fmt: skip
        raise CheckpointError(
            f"{file} cannot be read ({type(e).__name__}: {e}): it is damaged, missing or was "
            f"edited; {FIX}"
        ) from e


def _json_file(file: Path) -> Any:
    """A JSON file's content (its errors are `_reading`'s to name)."""
    return json.loads(file.read_bytes().decode("utf-8"))


def _version(data: Mapping[str, Any], file: Path) -> int:
    """The format version `file` gives: one this fxstar reads, or a CheckpointError."""
    version = data.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise CheckpointError(f"{file}: version must be an int >= 1, got {version!r}; {FIX}")
    if version > VERSION:
        raise CheckpointError(
            f"{file.parent}: checkpoint format {version} is newer than this fxstar's "
            f"({VERSION}); load it with a newer fxstar"
        )
    return version


def _manifest(directory: Path) -> dict[str, Any] | None:
    """manifest.json (format 3 on), checked against its own checksum; None if there is none."""
    file = directory / MANIFEST
    if not os.path.lexists(file):
        return None
    with _reading(file):
        manifest = _json_file(file)
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise CheckpointError(f"{file}: not an fxstar checkpoint's manifest; {FIX}")
        body = {k: v for k, v in manifest.items() if k != "crc32"}
        if manifest.get("crc32") != _json_crc(body):
            raise CheckpointError(
                f"{file} does not match the checksum it holds of itself: it was edited or is "
                f"damaged; {FIX}"
            )
        _version(manifest, file)
        with named(file):
            check_records(manifest.get("files"), "files")
        if STATE not in manifest["files"]:
            raise CheckpointError(f"{file} has no record of {STATE}; {FIX}")
    return manifest


def _meta(directory: Path) -> dict[str, Any]:
    """training.json, checked: against the manifest's checksum first, then as an fxstar
    checkpoint of a format this fxstar reads, whose fields have the right types."""
    manifest = _manifest(directory)
    file = directory / STATE
    with _reading(file):
        if manifest is not None:
            _verify(file, manifest["files"][STATE], MANIFEST)
        meta = _json_file(file)
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CheckpointError(f"{file}: not an fxstar checkpoint")
        version = _version(meta, file)
        if manifest is None and version >= 3:
            raise CheckpointError(
                f"{file} is of format {version}, but {directory / MANIFEST} is missing: the "
                f"checksums of this checkpoint's files are gone; {FIX}"
            )
        if manifest is not None:
            if version != manifest["version"]:
                raise CheckpointError(
                    f"{file} says format {version}, {MANIFEST} {manifest['version']}: they are "
                    f"not of one checkpoint; {FIX}"
                )
            meta["files"] = {k: v for k, v in manifest["files"].items() if k != STATE}
        check_meta(meta, file)
        if "state" not in meta:
            raise CheckpointError(f"{file} has no training state ('state'); {FIX}")
    if version < 3:
        what = "no checksums" if version < 2 else f"no checksum of {STATE}"
        warnings.warn(
            f"{directory} has {what} (checkpoint format {version}): damage to its files cannot "
            "be detected; save it again to add them",
            stacklevel=3,
        )
    return meta


def _member(directory: Path, name: Any) -> Path:
    """The file `name` (from training.json) of the checkpoint, refused unless it lies in the
    directory: an edited training.json must not make load read `../x` or `/etc/...`."""
    path = directory / name if is_file_name(name) else None
    if path is None or path.resolve().parent != directory.resolve():
        raise CheckpointError(
            f"{directory / STATE} names {name!r} as one of its files, which is not a file in "
            f"{directory}: only the checkpoint's own files are read; {FIX}"
        )
    return path


def _read_tensors(
    directory: Path, meta: Mapping[str, Any], name: Any
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and header metadata of a safetensors file of the checkpoint, checked."""
    file = _checked_member(directory, meta, name)
    with _reading(file), safe_open(file, "pt") as f:
        keys = f.keys()  # safe_open is not iterable
        return {k: f.get_tensor(k) for k in keys}, f.metadata() or {}


def _checked_member(directory: Path, meta: Mapping[str, Any], name: Any) -> Path:
    """The checkpoint's file `name`, its size and checksum first checked against those
    recorded (format 2 on; format 1 has no checksums)."""
    with _reading(directory / STATE):
        file = _member(directory, name)
        record = meta["files"][name] if meta["version"] >= 2 else None
    if record is not None:
        with _reading(file):
            _verify(file, record, MANIFEST if meta["version"] >= 3 else STATE)
    return file


def _verify(file: Path, record: Mapping[str, Any], recorded: str) -> None:
    """A flipped bit or a truncated file is an error naming the file (and the tensors whose
    bytes changed, where its header still reads), never a silently wrong weight. `recorded`:
    the file that holds `record`."""
    size, crc, crcs = record["bytes"], record["crc32"], record.get("tensors", {})
    actual = file.stat().st_size
    if actual != size:
        raise CheckpointError(
            f"{file} is {actual} bytes, but was saved with {size}: it was truncated or "
            f"replaced; {FIX}"
        )
    if _file_crc(file) == crc:
        return
    changed = []
    if crcs:
        try:
            with safe_open(file, "pt") as f:
                keys = f.keys()  # safe_open is not iterable
                changed = [k for k in keys if crcs.get(k) != _tensor_crc(f.get_tensor(k))]
        except Exception:  # a damaged header: the file alone is named
            changed = []
    which = f" (tensors whose bytes changed: {', '.join(changed)})" if changed else ""
    raise CheckpointError(
        f"{file} does not match the checksum {recorded} recorded when it was saved{which}: the "
        f"file is damaged; {FIX}"
    )


def _parameter_shapes(directory: Path, meta: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The parameters as meta tensors under every model name (what `check` compares), the
    file's size and checksum verified: nothing of the model's size is read into memory."""
    shapes: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name in _parameter_files(meta):
        file = _checked_member(directory, meta, name)
        with _reading(file), WeightSource(file, verify=False) as source:  # verified above
            shapes.update({n: torch.empty(source.shape(n), dtype=source.dtype(n), device="meta")
                           for n in source.names()})  # fmt: skip
            aliases.update(source.aliases())
    return _with_aliases(directory, shapes, aliases)


def _with_aliases(directory: Path, tensors: dict[str, torch.Tensor],
                  aliases: Mapping[str, str]) -> dict[str, torch.Tensor]:  # fmt: skip
    """`tensors` with each tied weight's other names (the files record {alias: stored name})."""
    for alias, name in aliases.items():
        if name not in tensors:
            raise CheckpointError(
                f"{directory}: its parameter files name {alias!r} another name of {name!r}, "
                f"which none of them holds; {FIX}"
            )
        tensors[alias] = tensors[name]
    return tensors


def _parameter_files(meta: Mapping[str, Any]) -> list[str]:
    """The files holding a checkpoint's parameters: one, or (data parallel with sharded
    payloads) one a rank, each with its own chunks' parameters."""
    return list(meta.get("parameters", {}).get("files", [PARAMETERS]))


def _parameters(directory: Path, meta: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    params: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for file in _parameter_files(meta):
        tensors, header = _read_tensors(directory, meta, file)
        params.update(tensors)
        with _reading(directory / file):
            aliases.update(parse_aliases(directory / file, header.get(ALIASES_KEY, "{}")))
    return _with_aliases(directory, params, aliases)
