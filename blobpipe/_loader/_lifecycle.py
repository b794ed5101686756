"""A Loader's lifecycle: one state that only moves forward.

::

    UNOPENED ──open()──► OPEN ──a batch fails──► FAILING ──its error delivered──► FAILED
        │                  │                        │                               │
        └──────────────────┴─────────── aclose() / close() ─────────────────────────┴──► CLOSED

* UNOPENED: constructed; nothing runs. Closing it releases the database.
  Iterating it opens it (a plain ``for`` / ``async for``, ``next``, ``anext``).
* OPEN: the fillers run (``open()``, ``async with``, ``with``, or first use).
* FAILING: making a batch raised; nothing after it is planned, and the batches
  before it are still delivered, then its error.
* FAILED: the consumer received that error; iterating again raises StateError.
* CLOSED: the pipeline is stopped (or being stopped); final.

A Loader is opened once. The errors for the illegal moves (StateError):

=================================  ============================================================
open() / async with, not UNOPENED  "this Loader is <state>; a Loader can be opened once — …"
with, not UNOPENED                 "this Loader is <state>; create a new one"
iterate, CLOSED                    "this Loader is closed; create a new one to iterate again"
iterate, FAILED                    "this Loader stopped after an error: <error>" (from the error)
=================================  ============================================================
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import threading
import weakref
from typing import Any

from .._errors import StateError

__all__ = ["CLOSED_ERROR", "Lifecycle", "State", "close_at_exit", "closed_before_exit"]

CLOSED_ERROR = "this Loader is closed; create a new one to iterate again"


class State(enum.Enum):
    """A Loader's state (see the module docstring)."""

    UNOPENED = "unopened"
    OPEN = "open"
    FAILING = "failing"
    FAILED = "failed"
    CLOSED = "closed"


_MOVES: dict[State, frozenset[State]] = {
    State.UNOPENED: frozenset({State.OPEN, State.CLOSED}),
    State.OPEN: frozenset({State.FAILING, State.CLOSED}),
    State.FAILING: frozenset({State.FAILED, State.CLOSED}),
    State.FAILED: frozenset({State.CLOSED}),
    State.CLOSED: frozenset(),
}


class Lifecycle:
    """The state, moved by the consumer, the fillers' threads and close.

    A move that is not in the diagram is refused (the state stays), so a
    later state is never undone: a filler failing after close leaves CLOSED.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.state = State.UNOPENED
        self.error: BaseException | None = None  # the error delivered (FAILED)

    def __repr__(self) -> str:
        return self.state.value

    def move(self, to: State, *, only_from: State | None = None) -> State | None:
        """Move to ``to`` if the diagram allows it (and the state is ``only_from``,
        when given). Returns the state left, or None when refused."""
        with self._lock:
            state = self.state
            if to not in _MOVES[state] or (only_from is not None and state is not only_from):
                return None
            self.state = to
            return state

    def open(self) -> None:
        """UNOPENED → OPEN. Raises StateError from any other state."""
        if self.move(State.OPEN) is None:
            raise StateError(
                f"this Loader is {self.state.value}; a Loader can be opened once — create a new one"
            )

    def check_enter(self) -> None:
        """Raises StateError unless ``with`` may open the loader (UNOPENED)."""
        state = self.state
        if state is not State.UNOPENED:
            raise StateError(f"this Loader is {state.value}; create a new one")

    def fail(self, error: BaseException) -> None:
        """The consumer receives ``error``: FAILING → FAILED (a failure is posted
        only after its filler moved the loader to FAILING)."""
        self.error = error
        self.move(State.FAILED)

    def check_closed(self) -> None:
        """Raises StateError when the loader is CLOSED."""
        if self.state is State.CLOSED:
            raise StateError(CLOSED_ERROR)

    def check_iterable(self) -> None:
        """Raises StateError unless the pipeline runs (OPEN, FAILING or FAILED);
        a Loader opens an UNOPENED pipeline before it asks it for a batch."""
        state = self.state
        if state is State.CLOSED:
            raise StateError(CLOSED_ERROR)
        if state is State.UNOPENED:  # pragma: no cover - the Loader opens it first
            raise StateError("this Loader is not open")

    def check_next(self) -> None:
        """Raises StateError unless a batch may be asked for (OPEN or FAILING)."""
        self.check_iterable()
        error = self.error
        if self.state is State.FAILED and error is not None:
            raise StateError(f"this Loader stopped after an error: {error!r}") from error


# Pipelines still open: closed by an atexit hook, so that no filler thread is inside
# native code (OpenCV, NumPy) while the interpreter finalizes.
_open: weakref.WeakSet[Any] = weakref.WeakSet()
_exit_hook = threading.Lock()
_exit_hooked = False


def close_at_exit(pipeline: Any) -> None:
    """Close ``pipeline`` (its ``close()``) when the interpreter exits, unless it was
    closed before (:func:`closed_before_exit`)."""
    global _exit_hooked
    _open.add(pipeline)
    with _exit_hook:
        if not _exit_hooked:
            atexit.register(_close_open)
            _exit_hooked = True


def closed_before_exit(pipeline: Any) -> None:
    """``pipeline`` was closed: nothing to close at exit."""
    _open.discard(pipeline)


def _close_open() -> None:
    for pipeline in list(_open):
        with contextlib.suppress(Exception):  # exiting: close what can be closed
            pipeline.close()
