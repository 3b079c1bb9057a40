"""Model weights read tensor by tensor into places given to us: chunk homes, not a second model.

A model built on the meta device has no storage; the engine gives each parameter a home (a view
into a host chunk) and this module fills the homes, so the host never holds the model twice:

- `WeightSource` opens safetensors weights: one file, a transformers checkpoint directory
  (`model.safetensors`, or shards named by `model.safetensors.index.json`; a Hugging Face hub
  cache snapshot, whose names link into the repository's `blobs/`, too), an fxstar checkpoint
  (its parameter files, verified against its checksums first), or a directory of
  `*.safetensors` files. An index may name files of its directory only. It parses the headers
  itself and reads each tensor with `readinto` straight into its destination: no mmap (whose
  touched pages would count against the process until the file is closed), no whole-file
  load, and no temporary at all when the destination is a contiguous CPU tensor of the file's
  dtype. A cast (fp32 file, bf16 home) goes through a
  bounded scratch buffer.
- `materialize(destinations, source)` checks every name and shape first (one error lists every
  problem, before minutes of reading), then reads each tensor once.
- `bind(module, destinations)` makes a meta module's parameters (and any buffers given) those
  destination tensors; `initialize` binds and then runs the model's own init
  (`reset_parameters`, transformers' `_init_weights`, or a callable), so random values land in
  the homes directly.
"""

from __future__ import annotations

import difflib
import json
import os
import sys
import time
import warnings
import zlib
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn
from tqdm import tqdm

from fxstar.errors import FxstarError

__all__ = [
    "InitReport",
    "ReadReport",
    "WeightSource",
    "WeightsError",
    "bind",
    "initialize",
    "is_transformers",
    "materialize",
    "tied_names",
]

INDEX = "model.safetensors.index.json"  # transformers' sharded layout: weight_map name -> file
SINGLE = "model.safetensors"
ALIASES_KEY = "fxstar.aliases"  # fxstar checkpoints: {alias: stored name} in the header metadata
HUB_REPOS = ("models--", "datasets--", "spaces--")  # a Hugging Face hub cache's repository folders
MAX_HEADER = 100 * 2**20  # what safetensors itself accepts
SCRATCH = 64 * 2**20  # bytes read at a time when a tensor must be cast or copied to a device
PROGRESS_BYTES = 2**30  # a load smaller than this finishes too soon for a bar to help
LISTED = 20  # names listed in an error before "... and N more"

# safetensors dtype names; a dtype this torch lacks (or a sub-byte one) maps to None and is
# refused only when that tensor is asked for
_DTYPES: dict[str, torch.dtype | None] = {
    name: getattr(torch, attr, None)
    for name, attr in {
        "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16",
        "I32": "int32", "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16",
        "BF16": "bfloat16", "F32": "float32", "F64": "float64", "C64": "complex64",
        "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
    }.items()
}  # fmt: skip


_NAMES = {dtype: name for name, dtype in _DTYPES.items() if dtype is not None}


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
) -> dict[str, int]:
    """Write a safetensors file tensor by tensor, straight from each tensor's memory (safetensors'
    own save_file first turns every tensor into bytes, a second copy of the whole model);
    returns each tensor's CRC-32, computed on the bytes as they are written. A tensor elsewhere
    than the host comes over one at a time."""
    return write_safetensors_streamed(path, tensors, tensors.items(), metadata)


def write_safetensors_streamed(
    path: str | os.PathLike[str],
    layout: Mapping[str, torch.Tensor],
    values: Iterable[tuple[str, torch.Tensor]],
    metadata: Mapping[str, str] | None = None,
) -> dict[str, int]:
    """Write a safetensors file whose header `layout` gives (name -> a tensor of its shape and
    dtype, a meta tensor will do) from `values`, the (name, tensor) pairs in `layout`'s order:
    each is written and let go before the next is drawn, so a stream that makes its tensors
    one at a time never holds two. Returns each tensor's CRC-32."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, t in layout.items():
        if t.dtype not in _NAMES:
            raise WeightsError(f"{name}: dtype {t.dtype} has no safetensors name")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}  # fmt: skip
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    crcs = {}
    expected = iter(layout.items())
    with open(path, "wb") as file:
        file.write(len(text).to_bytes(8, "little"))
        file.write(text)
        for name, t in values:
            want_name, want = next(expected, (None, None))
            if name != want_name or (t.dtype, t.shape) != (want.dtype, want.shape):
                raise WeightsError(f"{path}: {name!r} {t.dtype} {list(t.shape)} does not come "
                                   "where its header puts it")  # fmt: skip
            data = _bytes(t.detach().to("cpu").contiguous()) if t.numel() else memoryview(b"")
            crcs[name] = zlib.crc32(data)
            file.write(data)
            del t, data
        if next(expected, None) is not None:
            raise WeightsError(f"{path}: the tensors ended before its header's last")
    return crcs


class WeightsError(FxstarError, ValueError):
    """Weights that cannot go where they are asked to: a missing, unexpected or misshapen
    tensor, an unreadable file, a module that cannot be initialised. Names each one."""


# -- reading -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies: its file, dtype, shape and the absolute byte range."""

    name: str
    file: Path
    dtype_name: str
    shape: tuple[int, ...]
    begin: int
    nbytes: int

    @property
    def dtype(self) -> torch.dtype:
        dtype = _DTYPES.get(self.dtype_name)
        if dtype is None:
            raise WeightsError(
                f"{self.name!r} in {self.file} has dtype {self.dtype_name}, which this torch "
                f"({torch.__version__}) cannot hold"
            )
        return dtype


def _header(file: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """The tensors of one safetensors file and its metadata, from its header alone (the
    format: 8 bytes little-endian header length, a JSON header, then the data)."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as fh:
            raw = fh.read(8)
            length = int.from_bytes(raw, "little") if len(raw) == 8 else -1
            if not 0 < length <= min(MAX_HEADER, size - 8):
                raise WeightsError(
                    f"{file} is not a safetensors file (its header length {length} does not fit "
                    f"its {size} bytes)"
                )
            header = json.loads(fh.read(length))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise WeightsError(f"{file}: cannot read its safetensors header ({err})") from err
    if not isinstance(header, dict):
        raise WeightsError(f"{file}: its safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise WeightsError(f"{file}: its safetensors header's __metadata__ is not a JSON object")
    start = 8 + length
    tensors = {}
    for name, entry in header.items():
        try:
            dtype_name, shape = str(entry["dtype"]), tuple(int(d) for d in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as err:
            raise WeightsError(f"{file}: the header entry of {name!r} is malformed") from err
        dtype = _DTYPES.get(dtype_name)
        numel = 1
        for d in shape:
            numel *= d
        expected = numel * dtype.itemsize if dtype is not None else end - begin
        if not 0 <= begin <= end <= size - start or end - begin != expected:
            raise WeightsError(
                f"{name!r} in {file}: its bytes [{begin}, {end}) do not fit its shape "
                f"{list(shape)} of {dtype_name} or the file's {size - start} data bytes; the "
                "file is damaged or truncated"
            )
        tensors[name] = TensorInfo(name, file, dtype_name, shape, start + begin, end - begin)
    return tensors, {str(k): str(v) for k, v in metadata.items()}


def _inside(directory: Path, name: Any, index: Path) -> Path:
    """A file an index names: a name in the index's directory, whose file lies there too, or
    (a link) in the blobs of the Hugging Face hub cache repository the directory is a snapshot
    of (`snapshots/<rev>/x -> ../../blobs/<hash>`); a name or link leading anywhere else is
    refused."""
    plain = isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name
    path = directory / name if plain and "\\" not in name else None
    if path is None or path.resolve().parent not in (directory.resolve(), _hub_blobs(directory)):
        raise WeightsError(f"{index} names {name!r}, which is not a file in {directory}")
    return path


def _hub_blobs(directory: Path) -> Path | None:
    """The `blobs` folder of the hub cache repository (`models--org--name`, `datasets--...`)
    whose `snapshots/<revision>` `directory` is, or None."""
    snapshot = directory.resolve()
    repo = snapshot.parent.parent
    if snapshot.parent.name != "snapshots" or not repo.name.startswith(HUB_REPOS):
        return None
    blobs = repo / "blobs"
    return blobs.resolve() if blobs.is_dir() else None


def parse_aliases(file: Path, text: str) -> dict[str, str]:
    """The {alias: stored name} an fxstar checkpoint's file records, checked."""
    try:
        aliases = json.loads(text)
    except (ValueError, RecursionError) as err:
        raise WeightsError(f"{file}: its {ALIASES_KEY} metadata is not JSON ({err})") from err
    if not isinstance(aliases, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()
    ):
        raise WeightsError(f"{file}: its {ALIASES_KEY} metadata is not an object of names")
    return aliases


class WeightSource:
    """Named tensors in safetensors files, read one at a time into given tensors.

    `path`: a `.safetensors` file; or a directory holding `model.safetensors.index.json`
    (transformers' shards, a Hugging Face hub cache snapshot's too), else `model.safetensors`,
    else every `*.safetensors` in it (a name in two of them is an error). An fxstar checkpoint
    directory gives the parameter files its training.json names, and with `verify` each file
    read from it is first checked against its checksum (a whole extra read; a damaged file is
    a CheckpointError naming it). Only headers are read on opening; file handles stay open
    for repeated reads until `close()` (or the end of a `with` block).
    """

    def __init__(self, path: str | os.PathLike[str], *, verify: bool = True):
        self.path = Path(path)
        self.verify = verify
        self._tensors: dict[str, TensorInfo] = {}
        self._aliases: dict[str, str] = {}
        self._handles: dict[Path, BinaryIO] = {}
        self._scratch: torch.Tensor | None = None
        files, weight_map = self._files()
        for file in files:
            tensors, metadata = _header(file)
            for name, info in tensors.items():
                if name in self._tensors:
                    raise WeightsError(
                        f"{name!r} is in both {self._tensors[name].file} and {file}: which one "
                        f"to read is ambiguous (give {self.path} an index, or one file)"
                    )
                self._tensors[name] = info
            if ALIASES_KEY in metadata:
                self._aliases.update(parse_aliases(file, metadata[ALIASES_KEY]))
        for name, file in (weight_map or {}).items():
            if name not in self._tensors or self._tensors[name].file != file:
                raise WeightsError(
                    f"{self.path / INDEX} puts {name!r} in {file.name}, which does not hold it; "
                    "the index and its files do not belong together"
                )

    def _files(self) -> tuple[list[Path], dict[str, Path] | None]:
        path = self.path
        if not path.exists():
            raise WeightsError(f"{path}: no such file or directory")
        if self.verify:
            from fxstar.saving import verified_files  # saving reads through this module

            checkpoint = verified_files(path)
            if checkpoint is not None:
                return checkpoint, None
        if path.is_file():
            return [path], None
        if not path.is_dir():
            raise WeightsError(f"{path}: not a file or directory")
        if (path / INDEX).is_file():
            try:
                weight_map = json.loads((path / INDEX).read_text())["weight_map"]
                weight_map = {str(k): _inside(path, v, path / INDEX) for k, v in weight_map.items()}
            except (OSError, KeyError, TypeError, AttributeError, json.JSONDecodeError) as err:
                raise WeightsError(
                    f"{path / INDEX}: not a transformers index (a JSON object with a "
                    f"'weight_map' of tensor name -> file): {err}"
                ) from err
            files = sorted(set(weight_map.values()))
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise WeightsError(f"{path / INDEX} names files that are not there: {missing}")
            return files, weight_map
        if (path / SINGLE).is_file():
            return [path / SINGLE], None
        files = sorted(p for p in path.glob("*.safetensors") if p.is_file())
        if not files:
            raise WeightsError(f"{path} holds no .safetensors file (nor {INDEX})")
        return files, None

    # -- what is there ---------------------------------------------------------------------------

    def names(self) -> list[str]:
        """Every tensor's name, in file order."""
        return list(self._tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __len__(self) -> int:
        return len(self._tensors)

    def info(self, name: str) -> TensorInfo:
        try:
            return self._tensors[name]
        except KeyError:
            close = difflib.get_close_matches(name, self._tensors, n=3)
            hint = f" (close: {', '.join(close)})" if close else ""
            raise WeightsError(f"{name!r} is not in {self.path}{hint}") from None

    def shape(self, name: str) -> torch.Size:
        return torch.Size(self.info(name).shape)

    def dtype(self, name: str) -> torch.dtype:
        return self.info(name).dtype

    def file(self, name: str) -> Path:
        return self.info(name).file

    def nbytes(self, name: str) -> int:
        return self.info(name).nbytes

    def aliases(self) -> dict[str, str]:
        """Names a file records as other names of one of its tensors (an fxstar checkpoint's
        tied weights: {alias: stored name})."""
        return dict(self._aliases)

    # -- reading ---------------------------------------------------------------------------------

    def check(self, name: str, out: torch.Tensor) -> None:
        """Raise unless `name` can be read into `out`: same shape, and no cast between floating
        point and integer numbers (that would silently truncate)."""
        info = self.info(name)
        if out.is_meta:
            raise WeightsError(f"{name!r}: its destination is on the meta device (no storage)")
        if tuple(out.shape) != info.shape:
            raise WeightsError(
                f"{name!r} in {info.file} has shape {list(info.shape)}, but its destination "
                f"has shape {list(out.shape)}"
            )
        if _kind(info.dtype) != _kind(out.dtype):
            raise WeightsError(
                f"{name!r} in {info.file} is {info.dtype}, its destination {out.dtype}: a cast "
                "between those kinds of number is refused"
            )

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Copy the tensor `name` into `out` (its dtype cast to `out`'s if they differ)."""
        self.check(name, out)
        info = self.info(name)
        if info.nbytes == 0:
            return
        fh = self._handle(info.file)
        dst = out.detach()
        if _direct(dst, info.dtype):
            _readinto(fh, info, info.begin, _bytes(dst))
        elif dst.is_contiguous():
            flat, step = dst.view(-1), max(1, SCRATCH // info.dtype.itemsize)
            for first in range(0, flat.numel(), step):
                n = min(step, flat.numel() - first)
                piece = self._scratch_bytes(n * info.dtype.itemsize, pin=dst.is_cuda)
                _readinto(fh, info, info.begin + first * info.dtype.itemsize, piece)
                with torch.no_grad():
                    flat[first : first + n].copy_(piece.view(info.dtype))
        else:  # a strided destination: one temporary of the tensor's size
            tmp = torch.empty(info.shape, dtype=info.dtype)
            _readinto(fh, info, info.begin, _bytes(tmp))
            with torch.no_grad():
                dst.copy_(tmp)

    def read(self, name: str) -> torch.Tensor:
        """The tensor `name` as a new CPU tensor of its own dtype."""
        info = self.info(name)
        out = torch.empty(info.shape, dtype=info.dtype)
        self.read_into(name, out)
        return out

    def _handle(self, file: Path) -> BinaryIO:
        if file not in self._handles:
            try:
                self._handles[file] = open(file, "rb", buffering=0)  # noqa: SIM115 (kept open)
            except OSError as err:
                raise WeightsError(f"{file}: cannot open it ({err})") from err
        return self._handles[file]

    def _scratch_bytes(self, nbytes: int, pin: bool = False) -> torch.Tensor:
        """A reused buffer for reads that cannot land in place; pinned for a CUDA destination
        (the synchronous copy_ returns only once the buffer may be overwritten)."""
        old = self._scratch
        if old is None or old.numel() < nbytes or (pin and not old.is_pinned()):
            size = max(nbytes, 2**20, 0 if old is None else old.numel())
            self._scratch = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
        return self._scratch[:nbytes]

    def close(self) -> None:
        for fh in self._handles.values():
            fh.close()
        self._handles.clear()
        self._scratch = None

    def __enter__(self) -> WeightSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        files = len({i.file for i in self._tensors.values()})
        return f"WeightSource({str(self.path)!r}: {len(self)} tensors in {files} files)"


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "float" if dtype.is_floating_point else "int"


def _direct(dst: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the file's bytes can be read straight into `dst`."""
    return (
        dst.device.type == "cpu"
        and dst.dtype == dtype
        and dst.is_contiguous()
        and sys.byteorder == "little"  # safetensors is little-endian
        and not dst.is_conj()
        and not dst.is_neg()
    )


def _bytes(t: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _readinto(fh: BinaryIO, info: TensorInfo, offset: int, out: memoryview | torch.Tensor) -> None:
    view = _bytes(out) if isinstance(out, torch.Tensor) else out
    try:
        fh.seek(offset)
        done = 0
        while done < len(view):
            n = fh.readinto(view[done:])
            if not n:
                raise WeightsError(f"{info.file} ended inside {info.name!r}: the file is truncated")
            done += n
    except OSError as err:
        raise WeightsError(f"{info.file}: reading {info.name!r} failed ({err})") from err


# -- many tensors --------------------------------------------------------------------------------


@dataclass
class ReadReport:
    """What `materialize` read."""

    tensors: int = 0
    bytes: int = 0  # read from the files
    seconds: float = 0.0
    read_as: dict[str, str] = field(default_factory=dict)  # destination -> other name it came from
    cast: list[str] = field(default_factory=list)  # destinations whose dtype differs from the file
    unexpected: list[str] = field(default_factory=list)  # in the files, wanted by no destination

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def __str__(self) -> str:
        text = (
            f"read {self.tensors} tensors, {self.bytes / 1e9:.3f} GB in {self.seconds:.2f} s "
            f"({self.gb_per_s:.2f} GB/s)"
        )
        if self.read_as:
            text += f"; {len(self.read_as)} through another name"
        if self.cast:
            text += f"; {len(self.cast)} cast"
        if self.unexpected:
            text += f"; {len(self.unexpected)} in the files not read"
        return text


def _groups(pairs: Iterable[tuple[str, str]]) -> dict[str, set[str]]:
    """Names of one tensor, joined transitively: name -> every name of its group."""
    group: dict[str, set[str]] = {}
    for a, b in pairs:
        joined = group.get(a, {a}) | group.get(b, {b})
        for name in joined:
            group[name] = joined
    return group


def _listing(lines: Sequence[str]) -> str:
    shown = [f"  {line}" for line in lines[:LISTED]]
    if len(lines) > LISTED:
        shown.append(f"  ... and {len(lines) - LISTED} more")
    return "\n".join(shown)


def _same_place(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.device == b.device
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.data_ptr() == b.data_ptr()
    )


def materialize(
    destinations: Mapping[str, torch.Tensor],
    source: WeightSource | str | os.PathLike[str],
    *,
    aliases: Mapping[str, Sequence[str]] | None = None,
    strict: bool = True,
    progress: bool | None = None,
    elsewhere: Collection[str] = (),
    settled: Callable[[], object] | None = None,
) -> ReadReport:
    """Read each destination's tensor from `source` into it, one tensor at a time. `source`:
    a path, a `WeightSource`, or a reader of its interface under other names (a transformers
    checkpoint under its model's names: `fxstar.hf_checkpoint.converted_source`).

    A destination is found under its own name, else under another name of the same tensor:
    `aliases` ({name: [other names]}, e.g. `tied_names(model)`; a tied weight is stored once)
    and the aliases the files record. Every name and shape is checked before anything is read:
    missing tensors (with the closest names in the files), misshapen ones and, when `strict`,
    tensors of the files that no destination wants are one WeightsError; with `strict=False`
    the unexpected ones are a warning and listed in the report. Destinations named in
    `elsewhere` are read by another process (data parallel, sharded payloads): their shapes
    are checked, nothing is read into them. Destinations that are one
    tensor under several names are read once. `progress`: a tqdm bar on stderr; None shows one
    on a terminal for loads of PROGRESS_BYTES or more.
    `settled`, if given, runs after each tensor is written: the destinations' owner may give
    the pages written back (a disk tier's mapped masters)."""
    owned = isinstance(source, (str, os.PathLike))
    src = WeightSource(source) if owned else source
    try:
        return _materialize(destinations, src, aliases or {}, strict, progress, elsewhere,
                            settled)  # fmt: skip
    finally:
        if owned:
            src.close()


def _materialize(
    destinations: Mapping[str, torch.Tensor],
    src: WeightSource,
    aliases: Mapping[str, Sequence[str]],
    strict: bool,
    progress: bool | None,
    elsewhere: Collection[str] = (),
    settled: Callable[[], object] | None = None,
) -> ReadReport:
    pairs = [(a, b) for a, others in aliases.items() for b in others]
    pairs += list(src.aliases().items())
    group = _groups(pairs)
    plan: list[tuple[str, str, torch.Tensor]] = []  # (destination, stored name, tensor)
    missing, problems, wanted = [], [], set()
    for name, out in destinations.items():
        names = group.get(name, {name})
        wanted |= names
        stored = name if name in src else next((n for n in sorted(names) if n in src), None)
        if stored is None:
            missing.append(name)
            continue
        if name in elsewhere:
            if tuple(src.shape(stored)) != tuple(out.shape):
                problems.append(f"{stored!r}: shape {tuple(src.shape(stored))} in the files, "
                                f"{tuple(out.shape)} in the model")  # fmt: skip
            continue
        try:
            src.check(stored, out)
        except WeightsError as err:
            problems.append(str(err))
            continue
        plan.append((name, stored, out))
    unexpected = [n for n in src.names() if n not in wanted]
    if missing:
        for i, name in enumerate(missing[:LISTED]):  # difflib is slow: only for those shown
            close = difflib.get_close_matches(name, src.names(), n=3)
            missing[i] = name + (f"  (close: {', '.join(close)})" if close else "")
        problems.insert(
            0,
            f"{len(missing)} of {len(destinations)} tensors are not in {src.path} "
            f"({len(src)} tensors there):\n{_listing(missing)}\n  (a tied weight stored under "
            "another name: pass aliases=, e.g. fxstar.weights.tied_names(model))",
        )
    if unexpected and strict:
        problems.append(
            f"{len(unexpected)} tensors of {src.path} belong to no destination:\n"
            f"{_listing(unexpected)}\n  (pass strict=False to leave them unread)"
        )
    if problems:
        raise WeightsError("weights do not fit their destinations:\n" + "\n".join(problems))
    if unexpected:
        warnings.warn(
            f"{len(unexpected)} tensors of {src.path} belong to no destination and are not "
            f"read: {', '.join(unexpected[:LISTED])}"
            + (" ..." if len(unexpected) > LISTED else ""),
            stacklevel=3,
        )

    # one read per storage place: a tied weight given under two names is one tensor
    done: dict[tuple[str, int], list[torch.Tensor]] = {}
    todo = []
    for name, stored, out in plan:
        same = done.setdefault((str(out.device), out.data_ptr()), [])
        if not any(_same_place(out, d) for d in same):
            same.append(out)
            todo.append((name, stored, out))
    report = ReadReport(unexpected=unexpected)
    total = sum(src.nbytes(stored) for _, stored, _ in todo)
    progress = _show_progress(progress, total)
    start = time.perf_counter()
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="weights",
              disable=not progress, leave=False) as bar:  # fmt: skip
        for _, stored, out in todo:
            src.read_into(stored, out)
            if settled is not None:
                settled()
            report.tensors += 1
            report.bytes += src.nbytes(stored)
            bar.update(src.nbytes(stored))
    report.seconds = time.perf_counter() - start
    for name, stored, out in plan:
        if stored != name:
            report.read_as[name] = stored
        if out.dtype != src.dtype(stored):
            report.cast.append(name)
    return report


# -- binding a module to its homes, and initialising it there ------------------------------------


def tied_names(module: nn.Module) -> dict[str, list[str]]:
    """{name: [the other names of the same parameter]} for every tied parameter (by identity,
    so it works on a meta-built model): the `aliases` of `materialize`."""
    by_id: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return {n: [m for m in names if m != n] for names in by_id.values() if len(names) > 1
            for n in names}  # fmt: skip


def _owners(
    module: nn.Module, kind: str
) -> dict[int, tuple[torch.Tensor, list[str], list[tuple[nn.Module, str]]]]:
    """id -> (tensor, its names, its (owner module, attribute) pairs), for parameters or
    buffers; a tied one has several."""
    found: dict[int, tuple[torch.Tensor, list[str], list[tuple[nn.Module, str]]]] = {}
    for prefix, mod in module.named_modules(remove_duplicate=False):
        for attr, t in getattr(mod, kind).items():
            if t is None:
                continue
            entry = found.setdefault(id(t), (t, [], []))
            name = f"{prefix}.{attr}" if prefix else attr
            if name not in entry[1]:
                entry[1].append(name)
            if not any(m is mod and a == attr for m, a in entry[2]):
                entry[2].append((mod, attr))
    return found


def bind(module: nn.Module, destinations: Mapping[str, torch.Tensor],
         elsewhere: Collection[str] = ()) -> list[str]:  # fmt: skip
    """Make `module`'s parameters (and any buffers named) the given tensors, which then hold
    their values: a parameter keeps its identity (`torch.utils.swap_tensors`), its attributes
    and its ties; it takes the destination's dtype and device. Every parameter still on the
    meta device needs a destination (under any of its names), but those named in `elsewhere`
    (another process holds them: data parallel, sharded payloads). Returns the names of
    buffers left on the meta device."""
    params, buffers = _owners(module, "_parameters"), _owners(module, "_buffers")
    known = {n for _, names, _ in [*params.values(), *buffers.values()] for n in names}
    problems = []
    unknown = [n for n in destinations if n not in known]
    for i, name in enumerate(unknown):
        close = difflib.get_close_matches(name, known, n=3) if i < LISTED else []
        problems.append(f"{name} is no parameter or buffer of the module" +
                        (f" (close: {', '.join(close)})" if close else ""))  # fmt: skip
    chosen: list[tuple[torch.Tensor, torch.Tensor, list[tuple[nn.Module, str]], bool]] = []
    for tensors, is_param in ((params, True), (buffers, False)):
        for t, names, owners in tensors.values():
            given = [(n, destinations[n]) for n in names if n in destinations]
            if not given:
                if is_param and t.is_meta and not any(n in elsewhere for n in names):
                    problems.append(
                        f"{names[0]} (a parameter on the meta device) has no destination"
                    )
                continue
            dest = given[0][1]
            for n, other in given[1:]:
                if not _same_place(dest, other):
                    problems.append(
                        f"{given[0][0]} and {n} are one tensor but have two destinations"
                    )
            if dest.shape != t.shape:
                problems.append(
                    f"{names[0]} has shape {list(t.shape)}, its destination {list(dest.shape)}"
                )
            chosen.append((t, dest, owners, is_param))
    if problems:
        raise WeightsError(f"cannot bind {type(module).__name__} to its destinations:\n"
                           + _listing(problems))  # fmt: skip
    for t, dest, owners, is_param in chosen:
        if not is_param:
            for mod, attr in owners:
                mod._buffers[attr] = dest
            continue
        new = nn.Parameter(dest.detach(), requires_grad=t.requires_grad)
        new.__dict__.update(t.__dict__)  # swap_tensors swaps __dict__: keep the old attributes
        try:
            torch.utils.swap_tensors(t, new)
        except RuntimeError:  # t is referenced in a way swap refuses (weakref, autograd): replace
            new.__dict__.clear()
            new.__dict__.update(t.__dict__)
            for mod, attr in owners:
                mod._parameters[attr] = new
    return [name for name, b in module.named_buffers() if b.is_meta]


@dataclass
class InitReport:
    """What `initialize` did."""

    init: str  # "reset_parameters", "transformers" or the callable's name
    modules: list[str]  # modules whose init ran, in order ('' is the root)
    meta_buffers: list[str]  # buffers no destination was given for, left on the meta device
    seconds: float


def is_transformers(module: nn.Module) -> bool:
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers")
               for c in type(module).__mro__)  # fmt: skip


def initialize(
    module: nn.Module,
    destinations: Mapping[str, torch.Tensor],
    *,
    init: Callable[[nn.Module], object] | str | None = None,
    elsewhere: Collection[str] = (),
    settled: Callable[[], object] | None = None,
    progress: bool | None = None,
) -> InitReport:
    """Bind `module` (built on the meta device) to `destinations` (see `bind`) and initialise
    it there under `torch.no_grad()`, so the values land in the destinations. Parameters
    named in `elsewhere` stay on the meta device (another process holds them): the init
    runs on them as on any meta tensor, drawing nothing.

    `init`:
    - "reset_parameters": each module's own `reset_parameters()` (else `_reset_parameters()`),
      in module order, the order constructors run them; a module with parameters of its own
      and neither is an error naming it (nothing runs then).
    - "transformers": the model's `initialize_weights()` (its `_init_weights` per module,
      children first) and `tie_weights()`.
    - a callable: `init(submodule)` for every submodule, children first, like `module.apply`.
    - None: "transformers" for a transformers PreTrainedModel, else "reset_parameters".
    The init runs on every module: a parameter that was already real is initialised too.
    `settled`, if given, runs after each module's init (not inside transformers' one call):
    the destinations' owner may give the pages written back (a disk tier's mapped masters).
    `progress`: a tqdm bar of the modules on stderr; None shows one on a terminal for
    parameters of PROGRESS_BYTES or more (transformers' init is one call: no bar).

    With the same seed the values equal a CPU construction's only where the construction draws
    random numbers in the same order: true of models whose constructors only run
    `reset_parameters`; a model that re-initialises after construction (nanoGPT's
    `self.apply(self._init_weights)`, every transformers model) has drawn twice on the CPU.
    """
    if init is None:
        init = "transformers" if is_transformers(module) else "reset_parameters"
    if isinstance(init, str) and init not in ("reset_parameters", "transformers"):
        raise WeightsError(
            f"initialize: init={init!r} is not 'reset_parameters', 'transformers', a callable "
            "or None"
        )
    if init == "transformers" and not is_transformers(module):
        raise WeightsError(
            f"initialize: init='transformers' needs a transformers PreTrainedModel, got "
            f"{type(module).__name__}"
        )
    modules = list(module.named_modules())
    if init == "reset_parameters":
        bare = [f"{n or '(root)'} ({type(m).__name__})" for n, m in modules
                if next(iter(m.parameters(recurse=False)), None) is not None
                and not callable(getattr(m, "reset_parameters", None))
                and not callable(getattr(m, "_reset_parameters", None))]  # fmt: skip
        if bare:
            raise WeightsError(
                "initialize: these modules have parameters but no reset_parameters(), so "
                f"nothing would initialise them:\n{_listing(bare)}\n  (pass init=, a function "
                "of one module, or init='transformers' for a transformers model)"
            )
    meta_buffers = bind(module, destinations, elsewhere)
    progress = _show_progress(progress, sum(p.nbytes for p in module.parameters()))
    bar = tqdm(total=len(modules), unit="module", desc="init", leave=False,
               disable=not progress or init == "transformers")  # fmt: skip
    start = time.perf_counter()
    ran: list[str] = []
    with torch.no_grad(), bar:
        if init == "reset_parameters":
            for name, mod in modules:
                bar.update()
                reset = getattr(mod, "reset_parameters", None)
                reset = reset if callable(reset) else getattr(mod, "_reset_parameters", None)
                if callable(reset):
                    reset()
                    ran.append(name)
                    if settled is not None:
                        settled()
        elif init == "transformers":
            # what transformers' init_weights does, without its skip when the default device is
            # meta; the homes are fresh memory, so no module counts as initialised yet
            for _, mod in modules:
                mod.__dict__.pop("_is_hf_initialized", None)
            for p in module.parameters():
                p.__dict__.pop("_is_hf_initialized", None)
            module.initialize_weights()  # type: ignore[operator]
            module.tie_weights()  # type: ignore[operator]
            ran = [name for name, _ in modules]
        else:
            names = {id(m): n for n, m in modules}
            for mod in _children_first(module):
                bar.update()
                init(mod)
                ran.append(names[id(mod)])
                if settled is not None:
                    settled()
    seconds = time.perf_counter() - start
    _check_bound(module, destinations)
    label = init if isinstance(init, str) else getattr(init, "__qualname__", repr(init))
    return InitReport(init=label, modules=ran, meta_buffers=meta_buffers, seconds=seconds)


def _show_progress(progress: bool | None, total: int) -> bool:
    """A progress bar's choice: the caller's, else on a terminal for PROGRESS_BYTES or more."""
    if progress is not None:
        return progress
    return total >= PROGRESS_BYTES and sys.stderr.isatty()


def _children_first(module: nn.Module, seen: set[int] | None = None) -> list[nn.Module]:
    seen = set() if seen is None else seen
    order = []
    for child in module.children():
        if id(child) not in seen:
            order += _children_first(child, seen)
    if id(module) not in seen:
        seen.add(id(module))
        order.append(module)
    return order


def _check_bound(module: nn.Module, destinations: Mapping[str, torch.Tensor]) -> None:
    """An init that replaced a parameter (instead of writing into it) would leave the values
    outside their home: refuse it by name."""
    moved = []
    state = dict(module.named_parameters(remove_duplicate=False))
    state.update(module.named_buffers(remove_duplicate=False))
    for name, dest in destinations.items():
        now = state.get(name)
        if now is None or not _same_place(now, dest):
            moved.append(name)
    if moved:
        raise WeightsError(
            "initialize: the init replaced these tensors instead of writing into them, so their "
            f"values are not in their destinations:\n{_listing(moved)}"
        )
