"""The progress bar keeps to one row of a terminal of any width, and is silent off one.

The terminal is modelled by :func:`rows_touched` (a line wraps when a character is
written past the last column, as xterm does); the size comes from a real
pseudo-terminal (``TIOCSWINSZ``) or from ``$COLUMNS``.
"""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import struct
import termios
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

import pytest

from blobpipe._tools._progress import Progress, terminal_columns


def rows_touched(text: str, columns: int) -> int:
    """How many rows of a ``columns``-wide terminal ``text`` writes on."""
    row = col = last = 0
    for ch in text:
        if ch == "\r":
            col = 0
        elif ch == "\n":
            row, col = row + 1, 0
        else:
            if col == columns:  # the character goes past the last column: wrap
                row, col = row + 1, 0
            col += 1
        last = max(last, row)
    return last + 1


def run_bar(stream: TextIO, total: int | None = 1000, steps: int = 40) -> None:
    """Advance a bar ``steps`` times, each late enough to redraw, and close it."""
    now = [0.0]
    with Progress(total, "convert", stream=stream, clock=lambda: now[0]) as bar:
        for _ in range(steps):
            now[0] += 0.25
            bar.advance(7)


@contextmanager
def terminal(columns: int) -> Iterator[tuple[TextIO, list[bytes]]]:
    """A text stream on a pseudo-terminal ``columns`` wide, and what reaches its screen
    (complete once the block has ended)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    attrs = termios.tcgetattr(slave)
    attrs[1] &= ~termios.OPOST  # the screen gets the bytes as written ("\n" stays "\n")
    termios.tcsetattr(slave, termios.TCSANOW, attrs)
    received: list[bytes] = []

    def read() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the writer closed the terminal
                return
            if not data:
                return
            received.append(data)

    reader = threading.Thread(target=read)
    reader.start()
    stream = open(slave, "w", encoding="utf-8")  # noqa: SIM115  (closed below)
    try:
        yield stream, received
    finally:
        stream.close()
        reader.join(timeout=10)
        os.close(master)


@pytest.mark.parametrize("columns", [40, 60, 200])
@pytest.mark.parametrize("total", [1000, None])
def test_one_row_on_a_terminal_of_any_width(columns: int, total: int | None) -> None:
    with terminal(columns) as (stream, received):
        assert terminal_columns(stream) == columns
        run_bar(stream, total)
    screen = b"".join(received).decode()
    assert screen.startswith("\rconvert") and screen.endswith("\n")
    assert screen.count("\n") == 1
    assert rows_touched(screen[:-1], columns) == 1
    drawn = screen[1:-1].split("\r")
    assert len(drawn) == 41  # 40 redraws and the final one
    assert all(len(line) <= columns - 1 for line in drawn)
    final = drawn[-1].rstrip()
    assert "280/1000 records  28%" in final if total else "280 records" in final
    if columns == 200:  # wide: everything, with the full bar
        assert re.search(r"\[#{6}-{18}\] 280/1000 records  28%  28\.0 records/s  ETA", final) or (
            total is None and "280 records  28.0 records/s  elapsed 0:00:10" in final
        )


def test_the_line_fits_every_width_and_drops_the_least_useful_first() -> None:
    bar = Progress(1000, "convert", enabled=True, stream=io.StringIO(), clock=lambda: 0.0)
    bar.done = 500
    full = bar.render(now=10.0)
    assert full == (
        "convert  [############------------] 500/1000 records  50%  50.0 records/s  ETA 0:00:10"
    )
    for width in range(0, len(full) + 5):
        assert len(bar.render(now=10.0, width=width)) <= width
    assert bar.render(now=10.0, width=len(full)) == full
    # narrower: the bar shrinks, then the rate goes, then the time, then the bar
    assert bar.render(now=10.0, width=len(full) - 10) == full.replace("#" * 5 + "-" * 5, "", 1)
    assert bar.render(now=10.0, width=59) == (
        "convert  [######-------] 500/1000 records  50%  ETA 0:00:10"
    )
    assert bar.render(now=10.0, width=45) == "convert  [######------] 500/1000 records  50%"
    assert bar.render(now=10.0, width=39) == "convert  [###---] 500/1000 records  50%"
    assert bar.render(now=10.0, width=38) == "convert  500/1000 records  50%"
    assert bar.render(now=10.0, width=12) == "convert  500"


def test_a_terminal_that_narrows_between_redraws_keeps_one_row(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The width is read at each redraw; the blanking after a shorter line is cut to
    the new width too."""

    class FakeTTY(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = FakeTTY()
    now = [0.0]
    monkeypatch.setenv("COLUMNS", "200")  # shutil.get_terminal_size reads it first
    with Progress(1000, "convert", stream=stream, clock=lambda: now[0]) as bar:
        bar.advance(100)
        wide = stream.getvalue()
        monkeypatch.setenv("COLUMNS", "40")
        now[0] += 1
        bar.advance(100)
        narrow = stream.getvalue()[len(wide) :]
    assert len(wide) > 80
    assert narrow.startswith("\rconvert")
    assert len(narrow) - 1 <= 39


def test_columns_from_the_environment_when_the_stream_has_no_terminal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class FakeTTY(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setenv("COLUMNS", "60")
    stream = FakeTTY()
    assert terminal_columns(stream) == 60
    run_bar(stream)
    text = stream.getvalue()
    assert rows_touched(text.rstrip("\n"), 60) == 1
    assert max(len(line) for line in text.split("\r")) <= 59 + 1  # + the final "\n"


@pytest.mark.parametrize("quiet", [False, True])
def test_nothing_is_written_when_not_a_terminal(quiet: bool) -> None:
    read_end, write_end = os.pipe()
    with open(write_end, "w") as pipe:
        run_bar(pipe)
        bar = Progress(10, "x", stream=pipe, quiet=quiet)
        assert not bar.enabled
        bar.clear()
        bar.close()
    with open(read_end, "rb") as out:
        assert out.read() == b""
    with terminal(60) as (stream, received), Progress(10, "x", stream=stream, quiet=True) as bar:
        bar.advance(10)
    assert received == []


def test_a_resumed_job_counts_only_new_units_in_its_rate() -> None:
    now = [0.0]
    bar = Progress(1000, "convert", enabled=True, stream=io.StringIO(), clock=lambda: now[0])
    bar.skip(900)  # done by the interrupted run
    now[0] = 2.0
    bar.advance(10)
    line = bar.render(width=200)
    assert "910/1000" in line
    assert "5.0 records/s" in line  # 10 new records in 2 s, not 910
    assert "ETA 0:00:18" in line


def test_stop_leaves_no_bar_behind() -> None:
    out = io.StringIO()
    now = [0.0]
    bar = Progress(10, "convert", enabled=True, stream=out, clock=lambda: now[0])
    bar.advance(3)
    bar.stop()
    drawn = out.getvalue()
    bar.advance(1)
    bar.close()  # after stop: nothing more
    assert out.getvalue() == drawn
    assert drawn.endswith("\r")  # the line blanked, the cursor at its start
