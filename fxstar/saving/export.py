"""Exports: a model fxstar trained, written for everyone else, one tensor at a time.

- `save_pretrained(source, dir)`: a transformers model directory that `from_pretrained` opens:
  config.json (and generation_config.json for a model that generates), the weights in
  safetensors under the model's own names, sharded by size (shards.py), tied weights once as
  transformers keeps them (its own rule, `remove_tied_weights_from_state_dict`).
- `export_state_dict(source, file)`: one safetensors file holding the model's `state_dict()`
  under every name (a tied weight under each of its names), for any model:
  `model.load_state_dict(safetensors.torch.load_file(file))` takes it.

`source` is an engine (every rank of it calls the export: tensor-parallel shards and sharded
data-parallel chunks are gathered a tensor at a time, state_stream.py, and rank 0 writes) or
the directory of a checkpoint `engine.save` wrote at any topology (its parameter files, checked
against their checksums, read a tensor at a time; no engine is built; a transformers model is
rebuilt on the meta device from the config the checkpoint recorded, or from `config`).

Memory: each tensor is made, written and let go before the next, so the export holds at most
one tensor beyond what the source holds anyway (one process: the value of a parameter a pass
cut into parts, or a cast one; the engine's own tensors are written from where they are;
tensor parallelism: the gathered parameter; sharded payloads: the chunks holding it; a
checkpoint: the tensor read). A shard is never held whole.

Where it writes: as a checkpoint save does (directory.py), into a new directory swapped in for
the target, which may be absent, empty, or a previous export (its weight files carry
fxstar's mark); anything else, such as a directory with a user's files, is refused by name and
never deleted. The state dict file likewise replaces only a previous state dict export.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from torch import nn

from fxstar.errors import CheckpointError, ExportError
from fxstar.saving.checkpoint import mismatches
from fxstar.saving.collective import from_rank_zero, on_rank_zero
from fxstar.saving.directory import Kind, prepare, resolve, write_atomically
from fxstar.saving.file_format import TRANSFORMERS_CONFIG
from fxstar.saving.shards import DEFAULT_MAX_SHARD_SIZE, write_shards
from fxstar.saving.verified_reads import read_meta
from fxstar.saving.view import World, view_of
from fxstar.sizes import parse_size
from fxstar.weights import INDEX, WeightSource, write_safetensors_streamed

if TYPE_CHECKING:
    from fxstar.engine import Engine

__all__ = ["export_state_dict", "save_pretrained"]

EXPORT_KEY = "fxstar.export"  # an export's safetensors metadata: what it holds
PRETRAINED, STATE_DICT = "transformers", "state_dict"  # its values
CONFIG, GENERATION_CONFIG = "config.json", "generation_config.json"


def save_pretrained(
    source: Engine | str | os.PathLike,
    path: str | os.PathLike,
    *,
    max_shard_size: int | str | None = None,
    dtype: torch.dtype | None = None,
    config: str | os.PathLike | None = None,
) -> Path:
    """Write a transformers model directory of `source` (an engine, or a checkpoint directory)
    to `path` (see the module). `max_shard_size`: bytes or '5GB' a weight file holds at most
    (transformers' default, 50GB); `dtype`: the floating-point tensors cast to it (the
    model's own dtypes by default); `config`: for a checkpoint, a transformers config
    directory to use in place of the config it recorded. Every rank of an engine calls it."""
    limit = _shard_size(max_shard_size)
    tensors = _open(source, config)
    try:
        model = tensors.model
        if model is None:
            raise ExportError(
                f"{tensors.what} is not a transformers model with a config, so no transformers "
                "directory can describe it; export its state dict instead "
                "(engine.export_state_dict(file), or `fxstar export CKPT FILE --state-dict`)"
                + (", or give the config directory it was built from" * tensors.checkpoint)
            )
        layout = _kept(model, _cast_layout(tensors.layout, dtype))
        metadata = {"format": "pt", EXPORT_KEY: PRETRAINED}

        def write(values: Iterator[tuple[str, torch.Tensor]]) -> Path:
            def files(directory: Path) -> None:
                write_shards(directory, layout, _cast(values, dtype), limit, metadata)
                _write_config(model, directory, _float_dtype(layout))

            return write_atomically(path, files, EXPORT)

        return _written(tensors, list(layout), lambda: prepare(path, EXPORT), write)
    finally:
        tensors.close()


def export_state_dict(
    source: Engine | str | os.PathLike, path: str | os.PathLike, *, dtype: torch.dtype | None = None
) -> Path:
    """Write the model's state dict of `source` (an engine, or a checkpoint directory) to the
    safetensors file `path`, every name (a tied weight under each), for any model; `dtype`:
    the floating-point tensors cast to it. Every rank of an engine calls it."""
    tensors = _open(source, None)
    try:
        layout = _cast_layout(tensors.layout, dtype)
        target = Path(path).absolute()

        def write(values: Iterator[tuple[str, torch.Tensor]]) -> Path:
            _replaceable_file(target)
            scratch = target.with_name(f".{target.name}.tmp-{os.getpid()}")
            try:
                write_safetensors_streamed(scratch, layout, _cast(values, dtype),
                                           {"format": "pt", EXPORT_KEY: STATE_DICT})  # fmt: skip
                os.replace(scratch, target)
            finally:
                scratch.unlink(missing_ok=True)
            return target

        return _written(tensors, list(layout), lambda: _replaceable_file(target), write)
    finally:
        tensors.close()


# -- where the tensors come from ------------------------------------------------------------------


@dataclass
class _Tensors:
    """A model's state dict as an export reads it."""

    what: str  # for messages
    layout: dict[str, torch.Tensor]  # every name's shape and dtype (meta tensors), in order
    values: Callable[[Sequence[str]], Iterator[tuple[str, torch.Tensor]]]  # one at a time
    model: nn.Module | None  # a transformers model (the engine's, or built on meta), else None
    world: World  # the ranks that draw the values together (each rank of an engine)
    checkpoint: bool = False
    close: Callable[[], None] = lambda: None


def _open(source: Engine | str | os.PathLike, config: str | os.PathLike | None) -> _Tensors:
    if isinstance(source, str | os.PathLike):
        return _checkpoint(Path(source), config)
    if config is not None:
        raise ExportError("config: for a checkpoint directory; an engine has its model's own")
    view = view_of(source)
    model = view.model if view.transformers_config is not None else None
    return _Tensors(f"the engine's {view.model_class}", view.model_state(), view.state_items,
                    model, view.world)  # fmt: skip


def _checkpoint(path: Path, config: str | os.PathLike | None) -> _Tensors:
    """A checkpoint's parameters (its files checked against their checksums), and its model
    rebuilt on the meta device when a transformers config is known."""
    directory = resolve(path)
    meta = read_meta(directory)
    source = WeightSource(directory)  # verified: an fxstar checkpoint's files, checked
    try:
        aliases = source.aliases()
        stored = {name: torch.empty(source.shape(name), dtype=source.dtype(name), device="meta")
                  for name in source.names()}  # fmt: skip
        layout = {**stored, **{alias: stored[name] for alias, name in aliases.items()}}
        model = _meta_model(directory, meta, config)
        if model is not None:
            expected = {
                k: torch.empty_like(v, device="meta") for k, v in model.state_dict().items()
            }
            problems = mismatches(layout, expected)
            if problems:
                raise ExportError(
                    f"checkpoint {directory} does not fit {type(model).__name__} of its config:"
                    "\n  " + "\n  ".join(problems)
                )
            layout = {name: layout[name] for name in expected}  # the model's order
    except BaseException:
        source.close()
        raise

    def values(names: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
        for name in names:
            yield name, source.read(aliases.get(name, name))

    return _Tensors(f"checkpoint {directory} (of {meta.get('model')})", layout, values, model,
                    World(), checkpoint=True, close=source.close)  # fmt: skip


def _meta_model(directory: Path, meta: dict[str, Any],
                config: str | os.PathLike | None) -> nn.Module | None:  # fmt: skip
    """The checkpoint's transformers model on the meta device (no memory), from `config` or
    the config it recorded; None without either."""
    recorded = meta.get(TRANSFORMERS_CONFIG)
    if config is None and recorded is None:
        return None
    import transformers

    if config is not None:
        made = transformers.AutoConfig.from_pretrained(config)
        names = [*(made.architectures or []), meta.get("model")]
    else:
        names = [meta.get("model")]
    model_class = next((getattr(transformers, n) for n in names
                        if isinstance(n, str) and hasattr(transformers, n)), None)  # fmt: skip
    if model_class is None:
        raise ExportError(
            f"{directory}: no transformers model class named {names[-1]!r} (the checkpoint's "
            "model) in this transformers; give a config directory whose architectures name one"
        )
    if config is None:
        made = model_class.config_class.from_dict(recorded)
    with torch.device("meta"):
        return model_class(made)


# -- what is written ----------------------------------------------------------------------------


def _written(tensors: _Tensors, names: list[str], check: Callable[[], object],
             write: Callable[[Iterator[tuple[str, torch.Tensor]]], Path]) -> Path:  # fmt: skip
    """`write(values of names)` on rank 0, after `check()` there passed; the other ranks draw
    the same values (collective) and return rank 0's path, or raise its error."""
    world = tensors.world
    if world.ranks == 1:
        check()
        return write(tensors.values(names))
    refused = None
    if world.rank() == 0:
        try:
            check()
        except Exception as error:  # told to every rank, which then raise it
            refused = error if isinstance(error, CheckpointError) else ExportError(
                f"rank 0 cannot write the export: {type(error).__name__}: {error}")  # fmt: skip
    refused = from_rank_zero(refused, world.group)
    if refused is not None:
        raise refused
    values = tensors.values(names)

    def written() -> Path:
        try:
            return write(values)
        finally:
            _drain(values)  # the other ranks wait in these collectives

    if world.rank() != 0:
        _drain(values)
    return on_rank_zero(written, world.group)


def _drain(values: Iterator[tuple[str, torch.Tensor]]) -> None:
    for _ in values:
        pass


def _kept(model: nn.Module, layout: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The names transformers' save_pretrained writes: one name of each tied weight (its own
    rule, by the model's tied parameters), none it ignores on saving."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    ignored = getattr(model, "_keys_to_ignore_on_save", None) or ()
    kept = remove_tied_weights_from_state_dict(dict(layout), model)
    return {name: layout[name] for name in layout if name in kept and name not in ignored}


def _cast_layout(layout: dict[str, torch.Tensor], dtype: torch.dtype | None
                 ) -> dict[str, torch.Tensor]:  # fmt: skip
    if dtype is None:
        return layout
    return {n: t.to(dtype) if t.is_floating_point() else t for n, t in layout.items()}


def _cast(values: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype | None
          ) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    """The floating-point values cast to `dtype`, each let go before the next is drawn."""
    if dtype is None:
        yield from values
        return
    for name, value in values:
        cast = value.to(dtype) if value.is_floating_point() else value
        del value
        yield name, cast
        del cast


def _float_dtype(layout: dict[str, torch.Tensor]) -> torch.dtype:
    """The dtype of the floating-point weights (the config's `dtype`)."""
    return next((t.dtype for t in layout.values() if t.is_floating_point()), torch.float32)


def _write_config(model: nn.Module, directory: Path, dtype: torch.dtype) -> None:
    """config.json as transformers writes it (the model's class as its architecture, the
    weights' dtype), and generation_config.json for a model that generates."""
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    config.dtype = str(dtype).removeprefix("torch.")
    config.save_pretrained(directory)
    if model.can_generate() and getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(directory)


def _shard_size(value: int | str | None) -> int:
    if value is None:
        return DEFAULT_MAX_SHARD_SIZE
    try:
        size = parse_size(value, "max_shard_size")
    except ValueError as error:
        raise ExportError(str(error)) from None
    if not isinstance(size, int) or size < 1:
        raise ExportError(f"max_shard_size: a size in bytes >= 1 ('5GB'), got {value!r}")
    return size


# -- what an export may replace -----------------------------------------------------------------


def _mark(file: Path) -> str | None:
    """What export a safetensors file is (its metadata's mark), or None: not fxstar's export."""
    try:
        with safe_open(file, "pt") as f:
            return (f.metadata() or {}).get(EXPORT_KEY)
    except Exception:  # noqa: BLE001 (anything unreadable is not an export of ours)
        return None


def _export_files(directory: Path) -> set[str] | None:
    """The files a previous export wrote in `directory` (the weight files marked as a
    transformers export, its index and configs), or None if it holds no export."""
    with os.scandir(directory) as scan:
        weights = {e.name for e in scan if e.name.endswith(".safetensors") and e.is_file()}
    marked = {name for name in weights if _mark(directory / name) == PRETRAINED}
    return {CONFIG, GENERATION_CONFIG, INDEX, *marked} if marked else None


EXPORT = Kind("export", "export", _export_files)


def _replaceable_file(target: Path) -> None:
    """A state dict export replaces nothing but a previous one (a user's file is refused)."""
    if not os.path.lexists(target):
        if not target.parent.is_dir():
            raise ExportError(f"cannot export to {target}: {target.parent} does not exist")
        return
    if target.is_dir() or _mark(target) != STATE_DICT:
        what = "a directory" if target.is_dir() else "a file fxstar did not export"
        raise ExportError(
            f"cannot export to {target}: it is {what}, which an export would replace; "
            "give a new file name, or move it away first"
        )
