"""What a checkpoint directory holds and how its files are written and checksummed.

    model.safetensors     consolidated parameters and buffers under the model's own names
                          (what `engine.state_dict()` gives); a tied weight once, its other
                          names in the metadata ("fxstar.aliases"), since safetensors refuses
                          tensors that share memory
    training.safetensors  every tensor of the training state (optimizer moments, RNG states)
    training.json         the training state's structure, with {"__tensor__": key} where a
                          tensor of training.safetensors goes (fxstar/saving/json_tree.py);
                          step, scheduler and RNG state; a transformers model's config
                          ("transformers_config"), from which `fxstar export` rebuilds it
    manifest.json         every other file's size and CRC-32 (a safetensors file's tensors'
                          too), and a CRC-32 of its own canonical JSON; written last

Ranks that save together add files of their own: `training.rank<r>.safetensors` (rank r's
training state) and, data parallel with sharded payloads, `model.rank<r>.safetensors`.
"""

from __future__ import annotations

import contextlib
import json
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fxstar.runtime.deferred import DeferredTensor, in_groups
from fxstar.weights import write_safetensors_streamed

if TYPE_CHECKING:
    from fxstar.saving.view import TrainingView

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
TRANSFORMERS_CONFIG = "transformers_config"  # training.json: a transformers model's config
# training.json: how tensor parallelism cut each parameter it split, {fed name: [dim, parts]},
# so the ranks' optimizer states glue back into whole parameters' (layouts/logical_state.py)
TENSOR_SPLITS = "tensor_splits"
FIX = "restore it from a copy, or save the checkpoint again"


def rank_tensors_file(rank: int) -> str:
    """The training-state tensors of `rank` (rank 0's are TENSORS, as in a one-rank save)."""
    return TENSORS if rank == 0 else f"training.rank{rank}.safetensors"


def rank_parameters_file(rank: int) -> str:
    """Rank `rank`'s share of a data-parallel checkpoint's parameters."""
    return f"model.rank{rank}.safetensors"


def record(file: Path) -> dict[str, Any]:
    """What the manifest keeps of a file: its size and CRC-32."""
    return {"bytes": file.stat().st_size, "crc32": file_crc(file)}


def file_crc(file: Path) -> str:
    crc = 0
    with open(file, "rb") as f:
        while block := f.read(1 << 24):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def tensor_crc(tensor: torch.Tensor) -> str:
    """CRC-32 of a contiguous CPU tensor's bytes, as the file holds them."""
    return f"{zlib.crc32(tensor.reshape(-1).view(torch.uint8).numpy()):08x}"


def json_crc(data: Any) -> str:
    """CRC-32 of `data`'s canonical JSON (sorted keys, no spaces, ASCII): the manifest's
    checksum of itself, independent of how the file is indented."""
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return f"{zlib.crc32(text.encode()):08x}"


def write_tensors(directory: Path, name: str,
                  content: Mapping[str, torch.Tensor | DeferredTensor],
                  metadata: Mapping[str, str]) -> dict[str, Any]:  # fmt: skip
    """Write one safetensors file of a checkpoint (tensor by tensor; deferred tensors read a
    group at a time as they are reached); its record for training.json (size and
    checksums)."""
    layout, pairs = in_groups(content)
    with contextlib.closing(pairs):
        crcs = write_safetensors_streamed(directory / name, layout, pairs, metadata)
    return {**record(directory / name), "tensors": {k: f"{crc:08x}" for k, crc in crcs.items()}}


def training_json(view: TrainingView, ranks: int, aliases: dict[str, str], skeleton: Any,
                  parameter_files: list[str]) -> dict[str, Any]:  # fmt: skip
    """training.json's content but the files' records."""
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "torch": torch.__version__,
        "model": view.model_class,
        "ranks": ranks,
        "data_parallel": view.world.data_parallel,
        "parameters": {"file": parameter_files[0], "files": parameter_files, "aliases": aliases},
        "tensors": TENSORS,
        "state": skeleton,
        "plan": _jsonable(view.plan),
    }
    if view.transformers_config is not None:  # what `fxstar export` rebuilds the model from
        meta[TRANSFORMERS_CONFIG] = view.transformers_config
    if view.world.tensor_parallel > 1:
        meta[TENSOR_SPLITS] = {name: list(split) for name, split in view.tensor_splits.items()}
    return meta


def _jsonable(obj: Any) -> Any:
    try:
        json.dumps(obj)
        return obj
    except (TypeError, ValueError):
        return repr(obj)


def seal(directory: Path, meta: Mapping[str, Any], records: Mapping[str, Any]) -> None:
    """Write training.json, then manifest.json: the record (size, CRC-32) of every file,
    training.json's too, and a CRC-32 of its own canonical encoding. Written last, so a
    checkpoint with a manifest is whole."""
    (directory / STATE).write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    files = {**records, STATE: record(directory / STATE)}
    body = {"format": FORMAT, "version": VERSION, "files": files}
    text = json.dumps({**body, "crc32": json_crc(body)}, indent=1) + "\n"
    (directory / MANIFEST).write_text(text, encoding="utf-8")


def dedupe(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
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
