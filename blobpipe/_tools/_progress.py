"""A one-line progress bar for long dataset work.

It draws on a terminal only: when the stream is not a TTY (piped, redirected,
captured) or the caller asked for quiet, every method is a no-op, so tools can
call it unconditionally.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["Progress", "format_duration"]

_REDRAW_INTERVAL_S = 0.1
_BAR_WIDTH = 24


def format_duration(seconds: float) -> str:
    """``H:MM:SS`` for a non-negative number of seconds."""
    total = max(0, round(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


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

    def set_total(self, total: int | None) -> None:
        """Change the expected total (e.g. once a resumed job knows what is left)."""
        self.total = total

    def render(self, now: float | None = None) -> str:
        """The line as it would be drawn now (without the carriage return)."""
        now = self._clock() if now is None else now
        elapsed = max(now - self._start, 1e-9)
        rate = self.done / elapsed
        parts = [self.description]
        if self.total:
            frac = min(self.done / self.total, 1.0)
            filled = int(frac * _BAR_WIDTH)
            bar = "#" * filled + "-" * (_BAR_WIDTH - filled)
            parts.append(f"[{bar}] {self.done}/{self.total} {self.unit} {frac:4.0%}")
        else:
            parts.append(f"{self.done} {self.unit}")
        parts.append(f"{rate:,.1f} {self.unit}/s")
        if self.total and rate > 0:
            parts.append(f"ETA {format_duration(max(self.total - self.done, 0) / rate)}")
        else:
            parts.append(f"elapsed {format_duration(elapsed)}")
        return "  ".join(parts)

    def _draw(self, now: float) -> None:
        line = self.render(now)
        pad = " " * max(self._width - len(line), 0)
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

    def close(self) -> None:
        """Draw the final state and end the line; further calls do nothing."""
        if self._closed:
            return
        if self.enabled:
            self._draw(self._clock())
            self._stream.write("\n")
            self._stream.flush()
        self._closed = True
