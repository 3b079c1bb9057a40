"""Reading a checkpoint's files, each checked before it is believed.

What is checked on reading (`load`, `engine.load`, and `fxstar.compile(..., weights=dir)` on a
checkpoint directory or one of its files): the manifest against its own checksum, then every
file against the manifest before it is read, so a flipped bit, a truncated or an edited file is
a CheckpointError naming it (and the tensors that differ), never a weight of 5e36 or a learning
rate one bit off. Then every value: training.json's fields and the training state are checked
as a Plan's options are (fxstar/checkpoint_values.py: lr, betas, eps, weight decay, the step
counts, the loss scaler's fields, the RNG states, the file names, which must be files of the
directory), and against the engine (the moments' shapes, the parameter counts, the saved-along
objects: fxstar/saving/training_state.py) before anything is restored; a refusal names the
field and leaves the engine as it was. JSON that is not JSON, nested past what the decoder
recurses into, or of the wrong types is a CheckpointError naming the file. Not checked: the
values of the tensors (a moment of the right shape holding NaN loads as it was saved), and
what objects given to `engine.register_state` receive (their own `load_state_dict` judges
it). A checksum tells damage from a whole file; it is no signature: whoever can write the
directory can write a consistent checkpoint. Format 2 (checksums of the safetensors files in
training.json, none of training.json) and format 1 (none) still load, with a warning.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from fxstar.checkpoint_values import check_meta, check_records, check_state, is_file_name, named
from fxstar.errors import CheckpointError
from fxstar.saving.file_format import (
    ALIASES_KEY,
    FIX,
    FORMAT,
    MANIFEST,
    PARAMETERS,
    STATE,
    VERSION,
    file_crc,
    json_crc,
    tensor_crc,
)
from fxstar.saving.json_tree import from_json
from fxstar.weights import WeightSource, parse_aliases


def verified_files(path: Path) -> list[Path] | None:
    """If `path` is an fxstar checkpoint directory (or a file of one): the files to read its
    parameters from (or that file), each first checked against its checksum, training.json
    and the manifest too. None if it is no fxstar checkpoint (`weights=` of compile reads
    other safetensors as they are)."""
    directory, name = (path, None) if path.is_dir() else (path.parent, path.name)
    if not _claims_checkpoint(directory):
        return None
    meta = read_meta(directory)
    if name is None:
        return [checked_member(directory, meta, n) for n in parameter_files(meta)]
    if name in meta.get("files", {}):
        return [checked_member(directory, meta, name)]
    return (
        None  # format 1 (no checksums: read_meta warned), or a file the checkpoint does not record
    )


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


@contextmanager
def reading(file: Path) -> Iterator[None]:
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
    """A JSON file's content (its errors are `reading`'s to name)."""
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
    with reading(file):
        manifest = _json_file(file)
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise CheckpointError(f"{file}: not an fxstar checkpoint's manifest; {FIX}")
        body = {k: v for k, v in manifest.items() if k != "crc32"}
        if manifest.get("crc32") != json_crc(body):
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


def read_meta(directory: Path) -> dict[str, Any]:
    """training.json, checked: against the manifest's checksum first, then as an fxstar
    checkpoint of a format this fxstar reads, whose fields have the right types."""
    manifest = _manifest(directory)
    file = directory / STATE
    with reading(file):
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


def checked_member(directory: Path, meta: Mapping[str, Any], name: Any) -> Path:
    """The checkpoint's file `name`, its size and checksum first checked against those
    recorded (format 2 on; format 1 has no checksums)."""
    with reading(directory / STATE):
        file = _member(directory, name)
        record = meta["files"][name] if meta["version"] >= 2 else None
    if record is not None:
        with reading(file):
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
    if file_crc(file) == crc:
        return
    changed = []
    if crcs:
        try:
            with safe_open(file, "pt") as f:
                keys = f.keys()  # safe_open is not iterable
                changed = [k for k in keys if crcs.get(k) != tensor_crc(f.get_tensor(k))]
        except Exception:  # a damaged header: the file alone is named
            changed = []
    which = f" (tensors whose bytes changed: {', '.join(changed)})" if changed else ""
    raise CheckpointError(
        f"{file} does not match the checksum {recorded} recorded when it was saved{which}: the "
        f"file is damaged; {FIX}"
    )


def read_tensors(
    directory: Path, meta: Mapping[str, Any], name: Any
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and header metadata of a safetensors file of the checkpoint, checked."""
    file = checked_member(directory, meta, name)
    with reading(file), safe_open(file, "pt") as f:
        keys = f.keys()  # safe_open is not iterable
        return {k: f.get_tensor(k) for k in keys}, f.metadata() or {}


def read_state(
    directory: Path, meta: Mapping[str, Any], name: Any, skeleton: Any
) -> dict[str, Any]:
    """A training state: `skeleton` (from training.json) with the tensors of file `name`."""
    tensors, _ = read_tensors(directory, meta, name)
    with reading(directory / STATE):
        state = from_json(skeleton, tensors)
    check_state(state, directory / STATE)  # before any of it reaches torch
    return state


def read_rank_state(directory: Path, meta: Mapping[str, Any], rank: int) -> dict[str, Any]:
    """The training state rank `rank` (> 0) of a tensor-parallel save wrote."""
    with reading(directory / STATE):
        entry = meta["rank_states"][str(rank)]
        name, skeleton = entry["tensors"], entry["state"]
    return read_state(directory, meta, name, skeleton)


def parameter_files(meta: Mapping[str, Any]) -> list[str]:
    """The files holding a checkpoint's parameters: one, or (data parallel with sharded
    payloads) one a rank, each with its own chunks' parameters."""
    return list(meta.get("parameters", {}).get("files", [PARAMETERS]))


def parameter_values(directory: Path, meta: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The parameters of a checkpoint, read whole, under every model name."""
    params: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for file in parameter_files(meta):
        tensors, header = read_tensors(directory, meta, file)
        params.update(tensors)
        with reading(directory / file):
            aliases.update(parse_aliases(directory / file, header.get(ALIASES_KEY, "{}")))
    return _with_aliases(directory, params, aliases)


def parameter_shapes(directory: Path, meta: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The parameters as meta tensors under every model name (what `check` compares), the
    file's size and checksum verified: nothing of the model's size is read into memory."""
    shapes: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name in parameter_files(meta):
        file = checked_member(directory, meta, name)
        with reading(file), WeightSource(file, verify=False) as source:  # verified above
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
