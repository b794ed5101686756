"""A one-line progress bar for long dataset work.

It draws on a terminal only: when the stream is not a TTY (piped, redirected,
captured) or the caller asked for quiet, every method is a no-op, so tools can
call it unconditionally.

Invariant: a drawn line is at most ``columns - 1`` characters, the terminal's
width read at each redraw, so the terminal never wraps it and ``\r`` always
returns to its start (a wrapped line leaves one stale row per redraw). On a
narrow terminal the bar shrinks, then the rate, the time and the bar are left
out, and what still does not fit is cut.

Why not tqdm: it would be a new dependency for one line of output, and at
40 columns it cuts its line mid-field; this bar leaves whole fields out and
has :meth:`Progress.clear` for messages between redraws.
"""

from __future__ import annotations

import io
import os
import shutil
import sys
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["Progress", "format_duration", "terminal_columns"]

_REDRAW_INTERVAL_S = 0.1
_BAR_WIDTH = 24
_MIN_BAR_WIDTH = 6


def format_duration(seconds: float) -> str:
    """``H:MM:SS`` for a non-negative number of seconds."""
    total = max(0, round(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def terminal_columns(stream: TextIO) -> int:
    """The width of the terminal ``stream`` writes to: its own size, else
    :func:`shutil.get_terminal_size` (``$COLUMNS``, then stdout's terminal, else 80)."""
    try:
        columns = os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
        columns = 0
    if columns <= 0:  # not a terminal, or one that reports no size
        columns = shutil.get_terminal_size().columns
    return columns if columns > 0 else 80


class Progress:
    """Records done, rate and ETA on one redrawn line of ``stream`` (stderr by default).

    ``enabled=None`` means "draw when the stream is a terminal"; ``quiet=True``
    turns it off whatever the stream. Redraws are throttled to ten a second.
    Use as a context manager, or call :meth:`close` to end the line.
    """

    def __init__(
        self,
        total: int | None,
        description: str,
        *,
        unit: str = "records",
        stream: TextIO | None = None,
        quiet: bool = False,
        enabled: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._stream = sys.stderr if stream is None else stream
        if quiet:
            enabled = False
        elif enabled is None:
            isatty = getattr(self._stream, "isatty", None)
            enabled = bool(isatty()) if callable(isatty) else False
        self.enabled: bool = enabled
        self.total = total
        self.description = description
        self.unit = unit
        self.done = 0
        self._skipped = 0  # done before this run (a resumed job): not in the rate
        self._clock = clock
        self._start = clock()
        self._last_draw = -float("inf")
        self._width = 0
        self._closed = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def advance(self, n: int = 1) -> None:
        """Count ``n`` more units done and redraw if the last redraw is old enough."""
        self.done += n
        if self.enabled and not self._closed:
            now = self._clock()
            if now - self._last_draw >= _REDRAW_INTERVAL_S:
                self._draw(now)

    def skip(self, n: int) -> None:
        """Count ``n`` units as done already (a resumed job's earlier work): they
        count towards the total, not towards the rate."""
        self.done += n
        self._skipped += n

    def set_total(self, total: int | None) -> None:
        """Change the expected total (e.g. once a resumed job knows what is left)."""
        self.total = total

    def render(self, now: float | None = None, width: int | None = None) -> str:
        """The line as it would be drawn now (without the carriage return), at most
        ``width`` characters (no limit when ``None``)."""
        now = self._clock() if now is None else now
        elapsed = max(now - self._start, 1e-9)
        rate = (self.done - self._skipped) / elapsed
        frac = min(self.done / self.total, 1.0) if self.total else 0.0
        if self.total:
            count = f"{self.done}/{self.total} {self.unit} {frac:4.0%}"
        else:
            count = f"{self.done} {self.unit}"
        speed = f"{rate:,.1f} {self.unit}/s"
        if self.total and rate > 0:
            when = f"ETA {format_duration(max(self.total - self.done, 0) / rate)}"
        else:
            when = f"elapsed {format_duration(elapsed)}"
        limit = sys.maxsize if width is None else max(width, 0)
        # when the line does not fit: a narrower bar, then without the rate, then
        # without the time, then without the bar; what still does not fit is cut
        for fields in ([speed, when], [when], []):
            line = "  ".join([self.description, count, *fields])
            room = min(_BAR_WIDTH, limit - len(line) - 3)  # "[" bar "] "
            if self.total and room >= _MIN_BAR_WIDTH:
                filled = int(frac * room)
                bar = "[" + "#" * filled + "-" * (room - filled) + "]"
                return "  ".join([self.description, f"{bar} {count}", *fields])
            if len(line) <= limit and not self.total:
                return line
        line = "  ".join([self.description, count])
        return line[:limit]

    def _draw(self, now: float) -> None:
        width = terminal_columns(self._stream) - 1  # the last column would wrap on some terminals
        line = self.render(now, width)
        pad = " " * max(min(self._width, width) - len(line), 0)
        self._width = len(line)
        self._stream.write("\r" + line + pad)
        self._stream.flush()
        self._last_draw = now

    def clear(self) -> None:
        """Blank the drawn line so that other output can be printed; the next advance redraws."""
        if self.enabled and self._width and not self._closed:
            self._stream.write("\r" + " " * self._width + "\r")
            self._stream.flush()
            self._width = 0
            self._last_draw = -float("inf")

    def stop(self) -> None:
        """Blank the drawn line and end the bar without a final state (an
        interrupted job says what became of it instead); further calls do nothing."""
        self.clear()
        self._closed = True

    def close(self) -> None:
        """Draw the final state and end the line; further calls do nothing."""
        if self._closed:
            return
        if self.enabled:
            self._draw(self._clock())
            self._stream.write("\n")
            self._stream.flush()
        self._closed = True
