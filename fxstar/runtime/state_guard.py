"""Whether the training state is whole: an update or a load stopped halfway is not.

An optimizer step writes the parameters and their optimizer state run by run; one stopped
inside (Ctrl-C, a disk's I/O error, a collective that failed) leaves some parameters stepped and
others not, a state that is neither the last step's nor the next one's. Training on it, or
saving it (perhaps over the last good checkpoint), would pass it on with no error. So the
engine refuses to read or train on it until a load replaces the whole state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from fxstar.errors import EngineStateError

__all__ = ["StateGuard"]


class StateGuard:
    """The one record of a write of the whole training state that did not finish."""

    def __init__(self, on_change: Callable[[str | None], object] | None = None) -> None:
        self._stopped: str | None = None  # what stopped halfway, and why; None: whole
        self._loads = 0  # loads under way: their own reads of the state are theirs
        # told each change (the model records it: a later compile of it says so)
        self._on_change = on_change

    @property
    def stopped(self) -> str | None:
        return self._stopped

    @stopped.setter
    def stopped(self, value: str | None) -> None:
        self._stopped = value
        if self._on_change is not None:
            self._on_change(value)

    @contextlib.contextmanager
    def writing(self, what: str, *, replaces: bool = False) -> Iterator[None]:
        """`what` writes the training state: an exception escaping it leaves the state half
        written. With `replaces` (a load of every part) finishing makes the state whole again."""
        try:
            yield
        except BaseException as error:
            reason = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
            self.stopped = f"{what} stopped halfway ({reason})"
            raise
        if replaces:
            self.stopped = None

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        """A load is under way: it may read the state it is about to replace (names and
        shapes to check against)."""
        self._loads += 1
        try:
            yield
        finally:
            self._loads -= 1

    def check(self, action: str) -> None:
        """Refuse `action` on a half-written state, by name (not inside a load)."""
        if self.stopped is not None and not self._loads:
            raise EngineStateError(
                f"{action}: the training state is half written: {self.stopped}, so some "
                "parameters and their optimizer state have changed and others have not. "
                "Nothing reads, saves or trains on it: load a checkpoint (engine.load(path)) "
                "to go on"
            )
