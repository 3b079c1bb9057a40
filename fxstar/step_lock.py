"""One engine, several threads: a training step belongs to the thread that began it.

Forward and step change the chunks' state: one thread at a time (a second waits). A step
(forward .. step()/zero_grad()) is its thread's: another thread's forward meanwhile is refused
(it would interleave with that step's backward, which runs outside any lock); save, load and
the state and gradient reads wait for it to end.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

from fxstar.errors import EngineStateError

__all__ = ["StepLock", "whole_state"]


class StepLock:
    """The engine's lock, and which thread has a step open."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._step_ended = threading.Condition(self.lock)
        self._step_thread: threading.Thread | None = None  # whose step is open

    def __enter__(self) -> None:
        self.lock.__enter__()

    def __exit__(self, *exc_info: Any) -> None:
        self.lock.__exit__(*exc_info)

    def refuse_other_threads_step(self) -> None:
        """Before a forward: another thread's open step is refused by name."""
        owner = self._open_step_elsewhere()
        if owner is not None:
            raise EngineStateError(
                f"engine forward in thread {threading.current_thread().name!r} while thread "
                f"{owner.name!r} has a step open (its forward ran; its engine.step() or "
                "zero_grad() has not): the two forwards and backwards would mix their chunks "
                "and gradients. Train one engine from one thread, or end the other thread's "
                "step first (engine.step() or engine.zero_grad())"
            )

    def open_step(self) -> None:
        """A forward left a graph to run backward on: this thread's step is open."""
        self._step_thread = threading.current_thread()

    def end_step(self) -> None:
        self._step_thread = None
        self._step_ended.notify_all()

    @contextlib.contextmanager
    def between_steps(self) -> Iterator[None]:
        """The engine's lock, once no other thread has a step open: what is read or written
        meanwhile (parameters, optimizer state, gradients, the step count) is whole, never
        halfway through another thread's step. A step open in this thread is its own."""
        with self.lock:
            while self._open_step_elsewhere() is not None:
                self._step_ended.wait(timeout=1.0)  # also wakes to see whether it has ended
            yield

    def _open_step_elsewhere(self) -> threading.Thread | None:
        """The other thread whose step is open, if any (one that ended left its step to the
        threads that come next, as an abandoned forward in one thread is)."""
        owner = self._step_thread
        if owner is None or owner is threading.current_thread():
            return None
        if not owner.is_alive():
            self._step_thread = None
            return None
        return owner


def whole_state(method: Callable | None = None, *, writes: bool = False) -> Callable:
    """`method` of an Engine runs between steps (StepLock.between_steps): reads and writes of
    the whole training state; the pages of the disk tier's mapped masters it touched go back
    to the host after it (Engine.release_mapped_pages). A reader (`writes` False) is refused
    on a state a step or load left half written (Engine.state_guard); a writer may replace it."""
    if method is None:
        return functools.partial(whole_state, writes=writes)

    @functools.wraps(method)
    def whole(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self.step_lock.between_steps():
            if not writes:
                self.state_guard.check(f"engine.{method.__name__}")
            try:
                with self.state_guard.loading() if writes else contextlib.nullcontext():
                    return method(self, *args, **kwargs)
            finally:
                self.release_mapped_pages()

    return whole
