"""ParameterStore: every tensor an engine's graphs are fed, by name, shared by all captures.

At first it holds the model's own parameters and buffers, so gradients land in the model's
`.grad`. Rewrite passes change what a name stands for without the engine knowing why:
- `derive` replaces a parameter by parts cut from it (tiles of a tiled linear, a rank's shard
  under tensor parallelism), with a function that glues the parts back together, so
  `state_dict()` still gives the original names and shapes;
- `rebind` points a name at another tensor holding the same values (a view into a chunk).
Both are idempotent per name: the second capture of an engine (a new input shape) finds the
parts the first one made, so every capture trains the same tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

Consolidate = Callable[[dict[str, torch.Tensor]], torch.Tensor]


@dataclass
class Derived:
    parts: dict[str, nn.Parameter]  # full name -> part
    consolidate: Consolidate  # parts (by full name) -> the original tensor's values
    make_parts: Callable[[torch.Tensor], dict[str, torch.Tensor]]  # values -> suffix -> part


class ParameterStore:
    def __init__(self, model: nn.Module):
        self.model = model
        # name (every alias) -> tensor fed to the graph; aliases share one tensor
        self._tensors: dict[str, torch.Tensor] = dict(
            model.named_parameters(remove_duplicate=False)
        )
        self._buffers: dict[str, torch.Tensor] = dict(model.named_buffers(remove_duplicate=False))
        self._derived: dict[str, Derived] = {}  # original name (canonical) -> its parts
        self._canonical_of: dict[str, str] = {}  # every original name -> its first alias
        for name, tensor in self._tensors.items():
            first = next(n for n, t in self._tensors.items() if t is tensor)
            self._canonical_of[name] = first

    # -- what the graphs are fed ----------------------------------------------------------------

    def tensors(self) -> dict[str, torch.Tensor]:
        """Name -> tensor for every parameter (aliases, derived parts) and buffer."""
        fed = dict(self._tensors)
        for derived in self._derived.values():
            fed.update(derived.parts)
        fed.update(self._buffers)
        return fed

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors()[name]

    def aliases(self, name: str) -> list[str]:
        """Every original name of the parameter called `name` (a tied weight has several)."""
        canonical = self._canonical(name)
        return [n for n, c in self._canonical_of.items() if c == canonical]

    # -- rewriting ------------------------------------------------------------------------------

    def derive(
        self,
        name: str,
        make_parts: Callable[[torch.Tensor], dict[str, torch.Tensor]],
        consolidate: Consolidate,
    ) -> dict[str, nn.Parameter]:
        """Replace parameter `name` (and its aliases) by parts made from its values.

        `make_parts(original)` returns suffix -> tensor; each becomes an nn.Parameter named
        `name.suffix` (or `name` itself for the suffix ""), trainable like the original.
        `consolidate(parts by full name)` must give the original's values back.
        Returns full name -> part; a name derived before returns the parts made then.
        """
        canonical = self._canonical(name)
        if canonical in self._derived:
            return self._derived[canonical].parts
        original = self._tensors[canonical]
        parts = {}
        with torch.no_grad():
            for suffix, value in make_parts(original.detach()).items():
                full = f"{canonical}.{suffix}" if suffix else canonical
                parts[full] = nn.Parameter(value.clone(), requires_grad=original.requires_grad)
        for alias in self.aliases(canonical):
            del self._tensors[alias]
        self._derived[canonical] = Derived(parts, consolidate, make_parts)
        return parts

    def cut(self, name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
        """Fed name -> values, for `value` given as the model's full tensor `name`: itself, or
        the parts a pass derived from it, cut from `value` the same way."""
        canonical = self._canonical(name)
        derived = self._derived.get(canonical)
        if derived is None:
            return {name: value}
        return {
            (f"{canonical}.{suffix}" if suffix else canonical): part
            for suffix, part in derived.make_parts(value).items()
        }

    def assign(self, name: str, value: torch.Tensor) -> None:
        """Copy `value` (the model's full tensor `name`) into what is fed in its place, in
        place (a checkpoint loaded into a tiled or sharded engine)."""
        fed = self.tensors()
        with torch.no_grad():
            for full, part in self.cut(name, value.detach()).items():
                fed[full].copy_(part)

    def rebind(self, name: str, tensor: torch.Tensor) -> None:
        """Feed `tensor` wherever `name` or one of its aliases was fed (same values); `name`
        may be a derived part."""
        for derived in self._derived.values():
            if name in derived.parts:
                derived.parts[name] = tensor
                return
        if self._canonical(name) in self._derived:
            raise ValueError(f"{name!r} was derived into parts; rebind the parts instead")
        for alias in self.aliases(name):
            self._tensors[alias] = tensor

    def _canonical(self, name: str) -> str:
        try:
            return self._canonical_of[name]
        except KeyError:
            raise KeyError(f"no parameter {name!r} in the store") from None

    def origin(self, name: str) -> str:
        """The model's name for a fed name: a derived part maps to what it was cut from."""
        for original, derived in self._derived.items():
            if name in derived.parts:
                return original
        return name

    def consolidate_grads(
        self, grads: Mapping[str, torch.Tensor | None]
    ) -> dict[str, torch.Tensor | None]:
        """Gradients by fed name -> by the model's names: the parts' gradients of a derived
        parameter glued like its values (a part without gradient counts as zeros), under every
        alias; other names pass through."""
        out = {n: g for n, g in grads.items() if self.origin(n) == n}
        for canonical, derived in self._derived.items():
            got = {n: grads.get(n) for n in derived.parts}
            if all(g is None for g in got.values()):
                glued = None
            else:
                glued = derived.consolidate(
                    {
                        n: torch.zeros_like(derived.parts[n]) if g is None else g
                        for n, g in got.items()
                    }  # fmt: skip
                )
            for alias in self.aliases(canonical):
                out[alias] = glued
        return out

    # -- what users and optimizers see ----------------------------------------------------------

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Trainable tensors once each, in the model's order; derived parts where their
        original stood."""
        seen: set[int] = set()
        for name, _ in self.model.named_parameters(remove_duplicate=False):
            if name in self._tensors:
                items = [(name, self._tensors[name])]
            else:
                items = list(self._derived[self._canonical(name)].parts.items())
            for full, tensor in items:
                if id(tensor) not in seen:
                    seen.add(id(tensor))
                    yield full, tensor

    def state_dict(
        self, values: Mapping[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """The model's state dict keys and shapes, with current values (derived parts glued).
        `values` (by fed name) stand in for tensors this rank holds as meta (another data-
        parallel rank's chunks, gathered from their owners): they are glued like the parts
        they stand for (under tensor parallelism a remote shard is still a shard)."""
        return {key: self.state_value(key, values) for key in self.model.state_dict()}

    def state_value(
        self, key: str, values: Mapping[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """The current value of state dict entry `key` (see `state_dict`), alone: an export
        takes the model one tensor at a time (collective where parts are glued across ranks)."""
        values = values or {}

        def value(name: str, tensor: torch.Tensor) -> torch.Tensor:
            return (values.get(name, tensor) if tensor.is_meta else tensor).detach()

        if key in self._buffers:
            return self._buffers[key].detach()
        if key in self._tensors:
            return value(key, self._tensors[key])
        derived = self._derived.get(self._canonical(key))
        return derived.consolidate({n: value(n, p) for n, p in derived.parts.items()}).detach()

    def fed_names(self, key: str) -> list[str]:
        """The names the graphs are fed in place of state dict entry `key`: itself (a buffer,
        or a parameter under any of its names), or the parts a pass derived from it."""
        if key in self._buffers or key in self._tensors:
            return [key]
        return list(self._derived[self._canonical(key)].parts)
