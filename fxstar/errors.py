"""Errors fxstar raises on purpose: each says what went wrong, where, and what to try."""

from __future__ import annotations

__all__ = [
    "CaptureError",
    "CheckpointError",
    "CollectiveError",
    "DiskIOError",
    "EngineStateError",
    "ExportError",
    "FxstarError",
    "IRError",
    "OptionNotImplementedError",
    "PassOrderError",
    "PlanError",
    "RankMismatchError",
    "TargetError",
    "UsageError",
    "VerifyError",
]


class FxstarError(Exception):
    """Base of every error fxstar raises deliberately."""


class PlanError(FxstarError, ValueError):
    """A plan option is unknown, of the wrong type, or out of range; the message names it.
    (A ValueError too: `except ValueError` catches a bad option.)"""


class OptionNotImplementedError(FxstarError, NotImplementedError):
    """A plan sets options whose feature is not built (Plan.check_implemented); the
    message names each option and its feature."""


class TargetError(FxstarError, ValueError):
    """A MODULE:FACTORY target cannot be used: no such module, file or callable, a factory
    that returns something other than (model, example_inputs[, plan]), or a model that does
    not return its loss where training needs one."""


class UsageError(FxstarError, ValueError):
    """Arguments of a command or job that cannot work together, found before any work is
    done: an option given where it is ignored, an output path that cannot be written."""


class CaptureError(FxstarError):
    """The model could not be captured as a graph.

    Keeps the original exception (also chained as ``__cause__``), the module path and source
    line where tracing failed, and a hint of what to try.
    """

    def __init__(
        self,
        message: str,
        *,
        original: BaseException | None = None,
        module_path: str | None = None,
        location: str | None = None,
        hint: str | None = None,
    ):
        self.original = original
        self.module_path = module_path
        self.location = location
        self.hint = hint
        lines = [message]
        if original is not None:
            first = str(original).strip().splitlines()
            lines.append(f"  error: {type(original).__name__}: {first[0] if first else ''}")
        if module_path is not None:
            lines.append(f"  module: {module_path or '(root)'}")
        if location is not None:
            lines.append(f"  at: {location}")
        if hint:
            lines.append(f"  try: {hint}")
        super().__init__("\n".join(lines))


class CheckpointError(FxstarError, ValueError):
    """A checkpoint that does not fit the model (every difference listed), or is unreadable:
    damaged, truncated or edited files, each named with what would fix it."""


class ExportError(CheckpointError):
    """A model cannot be exported as asked: no transformers config for a transformers
    directory, a checkpoint whose names do not fit its model, a target that is not an export
    (a CheckpointError too: what `except CheckpointError` around saving catches)."""


class EngineStateError(FxstarError, RuntimeError):
    """The model or the engine was changed in a way the compiled engine cannot follow (a
    parameter replaced, a dtype or device change under the chunk engine, a second engine
    over the same parameters): says what to do instead."""


class PassOrderError(FxstarError, ValueError):
    """The passes asked for cannot be ordered: unknown names, duplicates, or a cycle."""


class IRError(FxstarError, TypeError):
    """A pass needs the export IR but the Program was captured another way."""


class VerifyError(FxstarError, AssertionError):
    """A pass changed the numerics (loss or a gradient) beyond its declared tolerance."""

    def __init__(self, message: str, *, pass_name: str, tensor: str | None = None):
        self.pass_name = pass_name
        self.tensor = tensor
        super().__init__(message)


class CollectiveError(FxstarError, RuntimeError):
    """A collective timed out or lost a peer: another rank failed, stopped calling the engine,
    or diverged. Raised in place of gloo's bare 'Timed out waiting ...' or 'Connection closed by
    peer', naming the collective, the rank and the group; the original is its `__cause__`.
    Also raised on every rank, before the collective runs, when the ranks are out of step (one
    raised mid-step and went on, or captured another batch shape) or tensor-parallel ranks
    were fed different inputs (runtime/step_check.py), naming each rank's step."""


class RankMismatchError(FxstarError, RuntimeError):
    """The ranks compiled different plans, graphs or parameters; the message names every
    difference with its value per rank. Every rank raises the same message."""


class DiskIOError(FxstarError, OSError):
    """A file of the disk tier could not be opened, read, written or synced: the disk is full
    (ENOSPC; EFBIG over a file size limit), the device failed (EIO), the directory vanished
    (ENOENT) or is read-only (EROFS, EACCES), or a read or write moved fewer bytes than asked
    (errno None: the file ends early). Raised where the bytes were needed, never replaced by
    zeros. An OSError too, with `errno`, `strerror` and `filename` set; also `operation`
    ('open', 'read', 'write', 'sync'), `path`, `offset` and `nbytes` of the request, and
    `failed_at`, the file offset where the transfer stopped."""

    def __init__(
        self,
        message: str,
        *,
        operation: str,
        path: str,
        offset: int,
        nbytes: int,
        failed_at: int,
        errno: int | None,
        strerror: str,
    ):
        super().__init__(message)
        self.operation = operation
        self.path = path
        self.offset = offset
        self.nbytes = nbytes
        self.failed_at = failed_at
        self.errno = errno
        self.strerror = strerror
        self.filename = path

    def __str__(self) -> str:
        return self.args[0]
