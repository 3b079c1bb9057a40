"""One chunk or bf16/fp16 engine per model, and what the last one left in it.

Such an engine rebinds the model's parameters to its own chunk homes, so a second engine over
the same model would train a copy the first never sees (and the model would show only one of
them). The model names its engine by a weak reference that copies and pickles leave behind.

An engine whose step stopped halfway refuses to go on (runtime/state_guard.py), but the model
keeps those values once the engine is closed: the model records it, and compiling it again
warns by name rather than training on from a half-stepped model without a word.
"""

from __future__ import annotations

import warnings
import weakref
from typing import TYPE_CHECKING

from torch import nn

from fxstar.errors import EngineStateError

if TYPE_CHECKING:
    from fxstar.engine import Engine

__all__ = ["claim", "owner", "release", "record_half_written"]

OWNER = "_fxstar_engine"  # the model's attribute naming the engine that owns its parameters
HALF_WRITTEN = "_fxstar_half_written"  # what left the model's parameters half written


def claim(model: nn.Module, engine: Engine) -> None:
    """`engine` owns `model`'s parameters; refused where another engine keeps them in chunks
    or this one would."""
    other = owner(model)
    if (
        other is not None
        and other.model is model
        and (other.topology.uses_chunks or engine.topology.uses_chunks)
    ):
        theirs = other.topology.uses_chunks
        raise EngineStateError(
            f"{type(model).__name__} is already compiled by another fxstar engine that "
            + ("keeps" if theirs else "would share")
            + " its parameters"
            + (" in chunks" if theirs else " with this chunk engine")
            + "; two engines over one model would train two copies. Compile a copy "
            "(copy.deepcopy(model)), or close the first engine (engine.close()) before "
            "compiling again."
        )
    reason = model.__dict__.pop(HALF_WRITTEN, None)
    if reason is not None:
        warnings.warn(
            f"{type(model).__name__}'s parameters were left half written by the engine that "
            f"trained them: {reason}, so some of them are a step ahead of the others. This "
            "compile starts from them as they are; to train from a whole state, load a "
            "checkpoint (engine.load(path)) after it.",
            stacklevel=4,
        )
    model.__dict__[OWNER] = _Owner(engine)


def record_half_written(model: nn.Module, reason: str | None) -> None:
    """What left `model`'s parameters half written (None: they are whole again)."""
    if reason is None:
        model.__dict__.pop(HALF_WRITTEN, None)
    else:
        model.__dict__[HALF_WRITTEN] = reason


def owner(model: nn.Module) -> Engine | None:
    """The engine that owns `model`'s parameters, if one is alive."""
    held = model.__dict__.get(OWNER)
    return held() if held is not None else None


def release(model: nn.Module, engine: Engine) -> None:
    """`engine` (closed) no longer owns `model`'s parameters."""
    if owner(model) is engine:
        del model.__dict__[OWNER]


class _Owner:
    """A weak reference to the engine that owns a model's parameters, which copies and pickles
    of the model (`torch.save(model)`, `copy.deepcopy`) leave behind."""

    def __init__(self, engine: Engine | None = None):
        self.ref = weakref.ref(engine) if engine is not None else None

    def __call__(self) -> Engine | None:
        return self.ref() if self.ref is not None else None

    def __reduce__(self):
        return (_Owner, ())

    def __deepcopy__(self, memo: dict) -> _Owner:
        return _Owner()
