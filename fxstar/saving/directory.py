"""Where a save writes and what it may replace: a new directory swapped in for the old one.

A save never deletes what fxstar did not write. The target may be absent, an empty directory,
or an fxstar checkpoint (a manifest or training.json of this format) holding only the files it
names; anything else (a directory of other files, a checkpoint with a file of the user's in
it, a file) is refused with a CheckpointError naming it, before anything is written, as is the
working directory or one holding it (`save(".")`). A symbolic link is followed: the checkpoint
it points to is replaced and the link kept (`latest -> run-100` writes run-100).

A save writes into `<dir>.tmp-<host>-<pid>-XXXX/<dir>` next to the target, moves the old `<dir>`
into `<dir>.old-<host>-<pid>-XXXX/<dir>`, renames the new one into place and deletes the old: a
crash at any point leaves the previous checkpoint whole, and `resolve` finds it under `.old-`
if it was caught between the two renames. Each scratch directory holds a marker fxstar writes
when it makes it (the format, which path it is for, host and pid): only a directory with that
marker is ever taken for a leftover, so a user's `run.old-v1` beside `run` is neither deleted
nor loaded (nor are markerless leftovers of older fxstar versions). The renames hold an flock
on the parent directory, so two processes saving one path each leave a whole checkpoint (the
last wins); a save first deletes the `.tmp-` directories of killed saves (same host, pid
gone). Siblings are matched by exact name prefix, never by a glob: a name with `*`, `?` or `[`
only ever touches its own.

An export (saving/export.py) is written and swapped in the same way, under its own `Kind`: it
replaces only a previous export.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fxstar.checkpoint_values import is_file_name
from fxstar.errors import CheckpointError
from fxstar.saving.file_format import FORMAT, MANIFEST, MARKER, STATE


@dataclass(frozen=True)
class Kind:
    """What a save writes: its words in a refusal, and the files of a directory it wrote
    (None: the directory is not of this kind), so a save replaces only its own kind."""

    verb: str  # "save a checkpoint": what "cannot ..." refuses
    noun: str  # "checkpoint": what an fxstar directory of this kind is called
    own_files: Callable[[Path], set[str] | None]


def write_atomically(
    path: str | os.PathLike, write: Callable[[Path], Any], kind: Kind | None = None
) -> Path:
    """Run `write(dir)` on a new directory, then swap it in for `path`, the old one kept until
    the new one is in place (see `_target` for what may be replaced; `kind`: a checkpoint
    unless given)."""
    kind = kind or CHECKPOINT
    target = prepare(path, kind)
    scratch = new_scratch(target, "tmp")
    try:
        (scratch / target.name).mkdir()
        write(scratch / target.name)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return swap_in(scratch, target, kind)


def prepare(path: str | os.PathLike, kind: Kind | None = None) -> Path:
    """The directory a save of `path` writes (see `_target`), its parent made and what killed
    saves of it left removed: before anything is written, so a refusal costs nothing."""
    kind = kind or CHECKPOINT
    target = _target(path, kind)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CheckpointError(f"cannot {kind.verb} to {path}: {error}") from error
    with _locked(target.parent):  # not between another save's two renames of `target`
        _replaceable(target, kind)
    _remove_killed_saves(target)  # first: the space they hold may be what this save needs
    return target


def _target(path: str | os.PathLike, kind: Kind) -> Path:
    """Where a save of `path` goes: a symbolic link is followed (the checkpoint it points to is
    replaced and the link kept, as `open` writes through a link); the working directory, or
    one holding it, is refused by name."""
    given = Path(path).absolute()
    try:
        target = given.resolve()
    except (OSError, RuntimeError) as error:  # a loop of links
        raise CheckpointError(f"cannot {kind.verb} to {given}: {error}") from error
    with suppress(OSError):  # a working directory that was deleted holds nothing
        cwd = Path.cwd().resolve()
        if target == cwd or target in cwd.parents:
            raise CheckpointError(
                f"cannot {kind.verb} to {given}: it is the working directory {cwd} or "
                "holds it, and a save replaces the whole directory; save to a directory of its "
                f"own, e.g. {given / 'checkpoint'}"
            )
    return target


def _replaceable(target: Path, kind: Kind) -> None:
    """Refuse to replace `target` unless it is absent, an empty directory, or an fxstar
    checkpoint (of `kind`) that holds only files fxstar wrote: a save never deletes anything
    else."""
    if not os.path.lexists(target):
        return
    if not target.is_dir():
        raise CheckpointError(
            f"cannot {kind.verb} to {target}: it is a file, not a {kind.noun} directory; "
            "save to another path, or move the file away first"
        )
    try:
        with os.scandir(target) as scan:
            entries = {e.name: e.is_file(follow_symlinks=False) for e in scan}
    except OSError as error:
        raise CheckpointError(f"cannot {kind.verb} to {target}: {error}") from error
    if not entries:
        return
    own = kind.own_files(target)
    foreign = sorted(n for n, plain in entries.items() if own is None or n not in own or not plain)
    if not foreign:
        return
    shown = ", ".join(foreign[:10]) + (f" and {len(foreign) - 10} more" * (len(foreign) > 10))
    what = f"is not an fxstar {kind.noun} and" if own is None else f"is an fxstar {kind.noun} but"
    raise CheckpointError(
        f"cannot {kind.verb} to {target}: it {what} holds files fxstar did not write "
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


CHECKPOINT = Kind("save a checkpoint", "checkpoint", _own_files)


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


def swap_in(scratch: Path, target: Path, kind: Kind | None = None) -> Path:
    """The checkpoint written in `scratch`, synced, in place of `target`; the old one moved
    into an `.old-` scratch directory until the new one is in, then deleted."""
    new = scratch / target.name
    try:
        for file in new.iterdir():
            _fsync(file)
        _fsync(new)
        with _locked(target.parent):
            _replaceable(target, kind or CHECKPOINT)  # again, under the lock: what is there now
            if os.path.lexists(target):
                os.replace(target, new_scratch(target, "old") / target.name)
            os.replace(new, target)
            _fsync(target.parent)
            # the one moved aside now, and any an interrupted save left: a newer one is in place
            for old in leftovers(target, "old"):
                shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # its marker alone, once the rename is done
    return target


def new_scratch(target: Path, kind: str) -> Path:
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


def leftovers(target: Path, kind: str, *, killed: bool = False) -> Iterator[Path]:
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
    """The marker `scratch` wrote in `scratch`, or None."""
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
    for path in leftovers(target, "tmp", killed=True):
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


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # directories cannot be fsynced on every platform
        pass
    finally:
        os.close(fd)


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint directory; if a save was interrupted between its two renames, the
    previous checkpoint it had moved aside (`<dir>.old-XXXX/<dir>`, found by fxstar's marker
    in it, never by its name alone)."""
    target = Path(path).absolute()
    if (target / STATE).exists() or (target / MANIFEST).exists():
        return target
    with suppress(OSError, RuntimeError):
        real = target.resolve()  # a save wrote beside the directory a link points to
        olds = [old / real.name for old in leftovers(real, "old")
                if (old / real.name / STATE).exists()]  # fmt: skip
        if not real.exists() and olds:
            old = max(olds, key=lambda p: (p / STATE).stat().st_mtime)
            warnings.warn(f"{target} missing: loading {old}, left by an interrupted save",
                          stacklevel=3)  # fmt: skip
            return old
    raise CheckpointError(f"no fxstar checkpoint at {target} ({STATE} not found)")
