"""Outputs that appear whole or not at all.

Every tool writes into ``<OUT>.partial`` beside the final path (same directory,
hence same filesystem) and renames it into place only once it is complete.
Invariants:

* ``<OUT>`` exists only when complete; it is replaced only with ``force=True``,
  and the old one is moved aside (``<OUT>.replaced``) before the new one is
  renamed in, so no moment has a half-written ``<OUT>``.
* ``<OUT>.partial`` may be resumed or removed by the tool that made it; a
  path of that name holding anything the tool did not write is never removed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any

from .._errors import DatabaseNotFoundError, DiskFullError, OutputExistsError, spell
from .._io._database import Reader, open_reader

__all__ = [
    "MARKER_NAME",
    "check_output",
    "check_space",
    "disk_full",
    "free_space",
    "open_database",
    "partial_path",
    "promote",
    "read_marker",
    "remove_partial",
    "write_marker",
]

MARKER_NAME = "blobpipe-partial.json"
"""File inside a ``.partial`` directory saying what is being built and how far it got."""


def partial_path(out: Path) -> Path:
    """``<out>.partial``: where ``out`` is built before it is renamed into place."""
    return out.with_name(out.name + ".partial")


def open_database(db: str | os.PathLike[str]) -> Reader:
    """Open the database ``db`` (an LMDB or a LevelDB) for reading; the caller closes it.

    Raises :class:`DatabaseNotFoundError` as the readers do, except
    that when ``db`` is missing but ``<db>.partial`` exists the message says the
    conversion is unfinished and how to finish it.
    """
    try:
        return open_reader(db)
    except DatabaseNotFoundError as exc:
        partial = partial_path(Path(db))
        if not partial.is_dir():
            raise
        raise DatabaseNotFoundError(
            f"no finished database here: an unfinished conversion is in {str(partial)!r}; "
            "rerun the same convert-imageset command to finish it",
            path=os.fspath(db),
        ) from exc


def free_space(path: Path) -> int | None:
    """Bytes free to an unprivileged writer on the disk holding ``path`` (or its nearest
    existing parent); None when that cannot be told."""
    for p in (path, *path.parents):
        if p.exists():
            try:
                return shutil.disk_usage(p).free
            except OSError:
                return None
    return None


def check_space(path: Path, need: int, what: str) -> None:
    """Raise :class:`DiskFullError` before writing when ``what`` (``need`` bytes) cannot
    fit on the disk holding ``path``; nothing has been written yet."""
    free = free_space(path)
    if free is not None and free < need:
        raise DiskFullError(
            f"no space left on device: {what} needs about {need} bytes, the disk holding "
            f"{str(path)!r} has {free} free; free some space or write elsewhere",
            path=path,
        )


def disk_full(exc: BaseException, path: Path, aftermath: str) -> DiskFullError | None:
    """The :class:`DiskFullError` to raise for ``exc`` when it means the disk holding
    ``path`` is full (ENOSPC, EDQUOT), else None. ``aftermath``: what became of the
    partial output, and how to go on."""
    if not isinstance(exc, OSError) or exc.errno not in (errno.ENOSPC, errno.EDQUOT):
        return None
    free = free_space(path)
    left = f" ({free} bytes free)" if free is not None else ""
    return DiskFullError(
        f"no space left on device: the disk holding {str(path)!r} is full{left}; {aftermath}",
        path=path,
    )


def _replaced_path(out: Path) -> Path:
    return out.with_name(out.name + ".replaced")


def check_output(out: Path, *, force: bool) -> None:
    """Raise :class:`OutputExistsError` when ``out`` exists and ``force`` is false."""
    if (out.exists() or out.is_symlink()) and not force:
        raise OutputExistsError(
            f"output {str(out)!r} already exists; pass {spell('force')} to replace it"
        )


def read_marker(partial: Path) -> dict[str, Any] | None:
    """The marker of an unfinished output, or ``None`` when absent or unreadable."""
    try:
        data = json.loads((partial / MARKER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_marker(partial: Path, marker: dict[str, Any]) -> None:
    """Replace the marker atomically (write, fsync, rename)."""
    tmp = partial / (MARKER_NAME + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(marker, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, partial / MARKER_NAME)


def remove_partial(partial: Path, allowed: frozenset[str]) -> None:
    """Remove a ``.partial`` output that holds only files named in ``allowed``.

    Raises :class:`OutputExistsError` if it holds anything else: then it is not
    ours, and the user must move it.
    """
    if not (partial.exists() or partial.is_symlink()):
        return
    if partial.is_dir() and not partial.is_symlink():
        names = {p.name for p in partial.iterdir()}
        foreign = names - allowed - {MARKER_NAME, MARKER_NAME + ".tmp"}
        if not foreign:
            shutil.rmtree(partial)
            return
    raise OutputExistsError(
        f"{str(partial)!r} exists but was not written by blobpipe; move or delete it"
    )


def _remove_any(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def promote(partial: Path, out: Path, *, force: bool) -> None:
    """Rename a finished ``partial`` to ``out`` (replacing it only with ``force``).

    The caller marks the output complete first and may delete the marker from
    ``out`` afterwards; a kill in between leaves a complete ``out`` whose marker
    says so.
    """
    check_output(out, force=force)
    replaced = _replaced_path(out)
    _remove_any(replaced)
    if out.exists() or out.is_symlink():
        os.replace(out, replaced)
    os.replace(partial, out)
    _fsync_dir(out.parent)
    _remove_any(replaced)
