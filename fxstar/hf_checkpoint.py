"""A transformers checkpoint seen under its model's names, by transformers' own loading rules.

transformers 5 stores some tensors unlike the modules that hold them: a mixture of experts one
expert at a time (`mlp.experts.3.gate_proj.weight`) where the module holds them fused
(`mlp.experts.gate_up_proj`), old names (`LayerNorm.gamma`), a base model's checkpoint under a
task model (`base_model_prefix`), tensors the model does not keep (`position_ids`, a buffer
not persistent). `from_pretrained` renames and converts by the model's conversion mapping
(`transformers.conversion_mapping`: `WeightRenaming`s, then one `WeightConverter` with its
operations) and ignores what the model's rules say to ignore. `converted_source` applies the
same rules, through transformers' own functions, to the names of a `WeightSource`.

Reading keeps `WeightSource`'s promise, one checkpoint tensor at a time into its destination:
transformers' operations run once on stand-ins (`_Placed`) that record, for operations that
only arrange tensors (stack, concatenate, transpose), where each checkpoint tensor lands; each
is then read straight into its slice of the destination (an expert's `gate_proj` into its rows
of `gate_up_proj`). A conversion with any other operation (a split, a permutation, a
dequantization) runs on the real tensors of that one conversion, read for it, and the result
is copied in: one converted tensor at a time, never the whole model.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fxstar.weights import WeightsError, WeightSource, _kind, is_transformers

__all__ = ["ConvertedSource", "converted_source"]

Pieces = list[tuple[str, torch.Tensor]]  # (checkpoint name, the destination view it is read into)


class _NotPlaceable(Exception):
    """An operation that does more than arrange whole tensors: the conversion runs for real."""


class _Placed:
    """Stands in for a tensor while transformers' conversion operations run: it has a shape,
    and `pieces(destination)` says which checkpoint tensor is read into which view of a
    destination of that shape. Only arranging operations are known; any other use raises."""

    def __init__(self, shape: tuple[int, ...], pieces: Callable[[torch.Tensor], Pieces]):
        self.shape = torch.Size(shape)
        self.pieces = pieces

    @classmethod
    def stored(cls, name: str, shape: tuple[int, ...]) -> _Placed:
        return cls(shape, lambda dest: [(name, dest)])

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def contiguous(self) -> _Placed:
        return self  # read into its place, it is the destination's layout

    def transpose(self, dim0: int, dim1: int) -> _Placed:
        return _transpose(self, dim0, dim1)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        handler = _HANDLERS.get(func)
        if handler is None:
            raise _NotPlaceable(getattr(func, "__name__", str(func)))
        return handler(*args, **(kwargs or {}))


def _dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        raise _NotPlaceable(f"dim {dim} of {ndim}")
    return dim % ndim


def _parts(tensors: Any) -> list[_Placed]:
    parts = list(tensors)
    if not parts or not all(isinstance(t, _Placed) for t in parts):
        raise _NotPlaceable("a mix of tensors and stand-ins")
    return parts


def _stack(tensors: Any, dim: int = 0, *, out: Any = None) -> _Placed:
    parts = _parts(tensors)
    if out is not None or len({p.shape for p in parts}) != 1:
        raise _NotPlaceable("stack")
    d = _dim(dim, parts[0].ndim + 1)
    shape = (*parts[0].shape[:d], len(parts), *parts[0].shape[d:])

    def pieces(dest: torch.Tensor) -> Pieces:
        return [piece for i, p in enumerate(parts) for piece in p.pieces(dest.select(d, i))]

    return _Placed(shape, pieces)


def _cat(tensors: Any, dim: int = 0, *, axis: int | None = None, out: Any = None) -> _Placed:
    parts = _parts(tensors)
    d = _dim(dim if axis is None else axis, parts[0].ndim)
    rest = {(*p.shape[:d], *p.shape[d + 1 :]) for p in parts}
    if out is not None or len(rest) != 1 or len({p.ndim for p in parts}) != 1:
        raise _NotPlaceable("cat")
    sizes = [p.shape[d] for p in parts]
    shape = (*parts[0].shape[:d], sum(sizes), *parts[0].shape[d + 1 :])

    def pieces(dest: torch.Tensor) -> Pieces:
        found, start = [], 0
        for p, size in zip(parts, sizes, strict=True):
            found += p.pieces(dest.narrow(d, start, size))
            start += size
        return found

    return _Placed(shape, pieces)


def _transpose(input: _Placed, dim0: int, dim1: int) -> _Placed:
    a, b = _dim(dim0, input.ndim), _dim(dim1, input.ndim)
    shape = list(input.shape)
    shape[a], shape[b] = shape[b], shape[a]
    return _Placed(tuple(shape), lambda dest: input.pieces(dest.transpose(a, b)))


_HANDLERS: dict[Any, Callable[..., _Placed]] = {
    torch.stack: _stack,
    torch.cat: _cat,
    torch.concat: _cat,
    torch.concatenate: _cat,
    torch.transpose: _transpose,
    torch.swapaxes: _transpose,
    torch.swapdims: _transpose,
}


# -- the checkpoint's names, mapped as from_pretrained maps them -----------------------------------


@dataclass
class _Conversion:
    """One `WeightConverter` application: the checkpoint tensors it collects (transformers'
    `add_tensor` arguments, in its order) and the model tensors it makes."""

    key: str  # the first target's name: transformers' `layer_name`
    converter: Any  # a fresh copy of the mapping's WeightConverter
    collected: list[tuple[str, str, str]] = field(default_factory=list)  # (target, stored, pattern)
    placed: dict[str, _Placed] | None = None  # target -> where each stored tensor lands
    shapes: dict[str, torch.Size] = field(default_factory=dict)  # target -> its shape

    @property
    def stored(self) -> list[str]:
        return [stored for _, stored, _ in self.collected]

    def listed(self) -> str:
        """Its checkpoint tensors, for a message: the first three and a count."""
        more = len(self.stored) - 3
        return ", ".join(self.stored[:3]) + (f" and {more} more" if more > 0 else "")

    def run(self, model: nn.Module, tensor: Callable[[str], Any]) -> dict[str, Any]:
        """transformers' own conversion, on `tensor(stored name)` for each collected tensor."""
        converter = copy.deepcopy(self.converter)
        for target, stored, pattern in self.collected:
            converter.add_tensor(target, stored, pattern, lambda s=stored: tensor(s))
        out = converter.convert(self.key, model=model, config=model.config)
        return {name: value[0] if isinstance(value, list) else value for name, value in out.items()}


class ConvertedSource:
    """A `WeightSource` under the model's names: what `materialize` reads through it is what
    `from_pretrained` would load, read one checkpoint tensor at a time.

    Names it serves: every model tensor the checkpoint gives (renamed or converted), and the
    checkpoint's tensors that map to none under their own names (`materialize` reports them
    as unexpected). Tensors transformers' rules ignore are left out.
    """

    def __init__(self, source: WeightSource, model: nn.Module):
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
        )

        self.source = source
        self.path = source.path
        self._model = model
        self._renamed: dict[str, str] = {}  # model name -> checkpoint name
        self._conversions: dict[str, _Conversion] = {}  # target -> its conversion
        self._unmatched: dict[str, str] = {}  # checkpoint name -> the name rules give it
        self._computed: tuple[str, dict[str, torch.Tensor]] | None = None  # last one run
        mapping = get_model_conversion_mapping(model)
        renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in mapping if isinstance(m, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        expected = dict.fromkeys(model.state_dict(keep_vars=True), True)
        prefix = model.base_model_prefix
        groups: dict[str, _Conversion] = {}
        for stored in sorted(source.names(), key=dot_natural_key):  # transformers' order
            name, pattern = rename_source_key(stored, renamings, converters, prefix, expected)
            if name not in expected and stored in expected:
                name, pattern = rename_source_key(stored, [], [], prefix, expected)
            if name not in expected:
                self._unmatched[stored] = name
            elif pattern is not None:
                group = groups.setdefault(
                    name, _Conversion(name, copy.deepcopy(by_pattern[pattern]))
                )
                group.collected.append((name, stored, pattern))
            elif name in self._renamed:  # a second tensor for one name: from_pretrained
                self._unmatched[stored] = stored  # reads the first only
            else:
                self._renamed[name] = stored
        for group in groups.values():
            for target in self._outcome(group):
                self._conversions[target] = group
        self.ignored = self._ignored(model)
        # as from_pretrained leaves it: save_pretrained writes the layout it was read from
        model._weight_conversions = [m for m in mapping if m.was_used()]  # type: ignore[attr-defined]

    def _outcome(self, group: _Conversion) -> list[str]:
        """The targets of a conversion and their shapes, without reading: where each stored
        tensor lands when the operations only arrange them, else the operations' result on
        meta tensors (on the real ones when even that fails)."""
        src = self.source
        try:
            out = group.run(self._model, lambda s: _Placed.stored(s, tuple(src.shape(s))))
            if all(isinstance(v, _Placed) for v in out.values()):
                names = [n for v, d in zip(out.values(), _metas(out), strict=True)
                         for n, _ in v.pieces(d)]  # fmt: skip
                if sorted(names) == sorted(group.stored):  # each read once, none dropped
                    group.placed = out
        except Exception:  # noqa: BLE001 (any operation unknown to the stand-ins)
            group.placed = None
        if group.placed is not None:
            group.shapes = {name: placed.shape for name, placed in group.placed.items()}
            return list(group.shapes)
        try:
            out = group.run(self._model, lambda s: torch.empty(src.shape(s), dtype=src.dtype(s),
                                                               device="meta"))  # fmt: skip
        except Exception:  # noqa: BLE001 (an operation that needs values)
            out = self._run(group)
        group.shapes = {name: torch.Size(t.shape) for name, t in out.items()}
        return list(group.shapes)

    def _run(self, group: _Conversion) -> dict[str, torch.Tensor]:
        """The conversion on the real tensors, each read in the model tensor's dtype first,
        as from_pretrained casts them."""
        model_dtype = _model_dtype(self._model, group.key)

        def read(stored: str) -> torch.Tensor:
            t = self.source.read(stored)
            same_kind = model_dtype is not None and _kind(model_dtype) == _kind(t.dtype)
            return t.to(model_dtype) if same_kind else t

        try:
            return group.run(self._model, read)
        except WeightsError:
            raise
        except Exception as err:
            raise WeightsError(
                f"transformers' conversion of {group.listed()} in {self.path} into "
                f"{group.key} failed: {type(err).__name__}: {err}"
            ) from err

    def _ignored(self, model: nn.Module) -> list[str]:
        """Checkpoint tensors the model's rules say to drop (`_keys_to_ignore_on_load_unexpected`,
        old `position_ids` and `rotary_emb.inv_freq`), by transformers' own filter."""
        from transformers.utils.loading_report import LoadStateDictInfo

        adjust = getattr(model, "_adjust_missing_and_unexpected_keys", None)
        if not self._unmatched or not callable(adjust):
            return []
        info = LoadStateDictInfo(missing_keys=set(), unexpected_keys=set(self._unmatched.values()),
                                 mismatched_keys=set(), error_msgs=[], conversion_errors={},
                                 skipped_pp_keys=set())  # fmt: skip
        adjust(info)
        ignored = [s for s, name in self._unmatched.items() if name not in info.unexpected_keys]
        for stored in ignored:
            del self._unmatched[stored]
        return ignored

    @property
    def changed(self) -> bool:
        """Whether any name differs from the checkpoint's or any tensor is left out."""
        return bool(self._conversions or self.ignored
                    or any(n != s for n, s in self._renamed.items()))  # fmt: skip

    # -- WeightSource's reading interface, under the model's names ---------------------------------

    def names(self) -> list[str]:
        return [*self._renamed, *self._conversions, *self._unmatched]

    def __contains__(self, name: object) -> bool:
        return name in self._renamed or name in self._conversions or name in self._unmatched

    def __len__(self) -> int:
        return len(self._renamed) + len(self._conversions) + len(self._unmatched)

    def aliases(self) -> dict[str, str]:
        return self.source.aliases()

    def _stored(self, name: str) -> str:
        return self._renamed.get(name, name)

    def shape(self, name: str) -> torch.Size:
        group = self._conversions.get(name)
        return group.shapes[name] if group else self.source.shape(self._stored(name))

    def dtype(self, name: str) -> torch.dtype:
        group = self._conversions.get(name)
        return self.source.dtype(group.stored[0] if group else self._stored(name))

    def nbytes(self, name: str) -> int:
        if name not in self._conversions:
            return self.source.nbytes(self._stored(name))
        return math.prod(self.shape(name)) * self.dtype(name).itemsize

    def conversions(self) -> dict[str, list[str]]:
        """{model tensor: the checkpoint tensors it is made of} for every converted one."""
        return {name: group.stored for name, group in self._conversions.items()}

    def check(self, name: str, out: torch.Tensor) -> None:
        group = self._conversions.get(name)
        if group is None:
            self.source.check(self._stored(name), out)
            return
        if out.is_meta:
            raise WeightsError(f"{name!r}: its destination is on the meta device (no storage)")
        if tuple(out.shape) != tuple(group.shapes[name]):
            raise WeightsError(
                f"{name!r}, converted by transformers' rules from {group.listed()} in "
                f"{self.path}, has shape {list(group.shapes[name])}, but its destination has "
                f"shape {list(out.shape)}"
            )
        for stored in group.stored:
            if _kind(self.source.dtype(stored)) != _kind(out.dtype):
                raise WeightsError(
                    f"{stored!r} in {self.source.file(stored)} is {self.source.dtype(stored)}, "
                    f"its destination {name!r} {out.dtype}: a cast between those kinds of "
                    "number is refused"
                )

    def read_into(self, name: str, out: torch.Tensor) -> None:
        group = self._conversions.get(name)
        if group is None:
            self.source.read_into(self._stored(name), out)
            return
        self.check(name, out)
        if group.placed is not None:
            for stored, view in group.placed[name].pieces(out.detach()):
                self.source.read_into(stored, view)
            return
        if self._computed is None or self._computed[0] != group.key:
            self._computed = None  # the previous conversion's tensors go first
            self._computed = (group.key, self._run(group))
        with torch.no_grad():
            out.copy_(self._computed[1][name])

    def read(self, name: str) -> torch.Tensor:
        out = torch.empty(self.shape(name), dtype=self.dtype(name))
        self.read_into(name, out)
        return out

    def close(self) -> None:
        self._computed = None

    def __repr__(self) -> str:
        return (f"ConvertedSource({self.source!r}: {len(self._conversions)} tensors converted, "
                f"{sum(n != s for n, s in self._renamed.items())} renamed, "
                f"{len(self.ignored)} ignored)")  # fmt: skip


def _metas(out: dict[str, _Placed]) -> Iterator[torch.Tensor]:
    return (torch.empty(p.shape, device="meta") for p in out.values())


def _model_dtype(model: nn.Module, name: str) -> torch.dtype | None:
    module, _, attr = name.rpartition(".")
    try:
        t = getattr(model.get_submodule(module), attr)
    except AttributeError:
        return None
    return t.dtype if isinstance(t, torch.Tensor) else None


def converted_source(model: nn.Module, source: WeightSource) -> ConvertedSource | None:
    """`source` under `model`'s names by transformers' loading rules, or None: the model is no
    transformers model, or its checkpoint's names need nothing renamed, converted or left out.
    transformers is imported only for a transformers model."""
    if not is_transformers(model):
        return None
    converted = ConvertedSource(source, model)
    return converted if converted.changed else None
