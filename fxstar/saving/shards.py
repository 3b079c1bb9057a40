"""Tensors streamed into safetensors files of a bounded size, laid out as transformers shards.

One file `model.safetensors` when the tensors fit in `max_shard_size`, else
`model-00001-of-0000N.safetensors` ... and `model.safetensors.index.json` naming the file of
each tensor (transformers' and huggingface_hub's layout: tensors kept in order, a new file
begun where the next tensor would pass the size, a tensor larger than the size alone in its
own file). Every file is written from a stream of the tensors, one at a time
(weights.write_safetensors_streamed): a shard is never held in memory.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from fxstar.weights import INDEX, SINGLE, write_safetensors_streamed

# transformers 5's save_pretrained default (decimal units, as huggingface_hub parses them)
DEFAULT_MAX_SHARD_SIZE = 50 * 10**9


def plan_shards(layout: Mapping[str, torch.Tensor], max_shard_size: int) -> list[list[str]]:
    """The names of each file, in `layout`'s order, as huggingface_hub splits a state dict."""
    shards: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name, tensor in layout.items():
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > max_shard_size:  # alone in a file of its own
            shards.append([name])
            continue
        if current and size + nbytes > max_shard_size:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current or not shards:
        shards.append(current)
    return shards


def shard_file(index: int, count: int) -> str:
    """The name of file `index` (from 0) of `count`."""
    return SINGLE if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def write_shards(
    directory: Path,
    layout: Mapping[str, torch.Tensor],
    values: Iterator[tuple[str, torch.Tensor]],
    max_shard_size: int,
    metadata: Mapping[str, str],
) -> list[str]:
    """Write `values` (the (name, tensor) pairs of `layout`, in its order) into `directory` as
    shards of at most `max_shard_size` bytes each, with the index when there are several;
    returns the files written."""
    shards = plan_shards(layout, max_shard_size)
    files = [shard_file(i, len(shards)) for i in range(len(shards))]
    for file, names in zip(files, shards, strict=True):
        part = {name: layout[name] for name in names}
        write_safetensors_streamed(directory / file, part, itertools.islice(values, len(names)),
                                   metadata)  # fmt: skip
    if len(files) > 1:
        total = sum(t.numel() * t.element_size() for t in layout.values())
        weight_map = {name: file for file, names in zip(files, shards, strict=True)
                      for name in names}  # fmt: skip
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        text = json.dumps(index, indent=2, sort_keys=True) + "\n"
        (directory / INDEX).write_text(text, encoding="utf-8")
        files.append(INDEX)
    return files
