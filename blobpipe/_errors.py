"""The exceptions blobpipe raises.

Every error derives from :class:`BlobpipeError`; each subclass also derives from
the standard exception a caller would naturally catch, so ``except ValueError``
keeps working::

    BlobpipeError
    ├── ArgumentError(ValueError)          a bad argument value (batch_size=0, phase="val", ...)
    ├── ArgumentTypeError(TypeError)       an argument of the wrong type
    ├── FileMissingError(FileNotFoundError)  a named file (mean file, list, root...) is missing
    ├── ShapeError(ValueError)             bad shape, axis count, negative dim, dtype
    ├── BlobIndexError(IndexError)         axis or index out of range
    ├── UnsupportedOperationError(TypeError)  math on integer blobs, etc.
    ├── StateError(RuntimeError)           use after close, closed batch, wrong head
    ├── BackendUnavailableError(RuntimeError)  CuPy / a CUDA device is missing
    ├── MissingDependencyError(ImportError)  an optional package (h5py) is not installed
    ├── PoolMemoryError(MemoryError)       the pool's limit or the device is exhausted
    ├── ProtoError(ValueError)             a BlobProto / prototxt that cannot be used
    ├── OutputExistsError(FileExistsError)  a tool's output exists and force was not given
    ├── DiskFullError(OSError)             a tool's output does not fit on its disk (ENOSPC)
    └── DataError(ValueError)              a bad record or database (names path and key)
        ├── DatabaseNotFoundError(FileNotFoundError)
        └── RecordNotFoundError(KeyError)  no record under that key
"""

from __future__ import annotations

import contextlib
import errno
import threading
from collections.abc import Iterator

__all__ = [
    "ArgumentError",
    "ArgumentTypeError",
    "BackendUnavailableError",
    "BlobIndexError",
    "BlobpipeError",
    "DataError",
    "DatabaseNotFoundError",
    "DiskFullError",
    "FileMissingError",
    "MissingDependencyError",
    "OutputExistsError",
    "PoolMemoryError",
    "ProtoError",
    "RecordNotFoundError",
    "ShapeError",
    "StateError",
    "UnsupportedOperationError",
    "command_line",
    "spell",
]


# The surface the caller uses, for messages that tell it what to pass: the command
# line while a ``blobpipe`` command runs (for every thread: a command's worker threads
# raise in its name), else Python.
_command_lines = 0
_surface_lock = threading.Lock()


@contextlib.contextmanager
def command_line() -> Iterator[None]:
    """While it lasts, :func:`spell` names options as the command line does."""
    global _command_lines
    with _surface_lock:
        _command_lines += 1
    try:
        yield
    finally:
        with _surface_lock:
            _command_lines -= 1


def spell(name: str, value: object = True, *, placeholder: bool = False) -> str:
    """Option ``name`` set to ``value`` as the caller writes it: ``name=value`` in
    Python (``force=True``, ``encode_type='jpg'``); on the command line
    (:func:`command_line`) ``--name`` for True, else ``--name value`` (underscores as
    dashes: ``--encode-type jpg``). ``placeholder``: ``value`` stands for one to
    choose (``crop_size=N``), written as it is."""
    shown = value if placeholder else repr(value)
    if not _command_lines:
        return f"{name}={shown}"
    flag = "--" + name.replace("_", "-")
    return flag if value is True else f"{flag} {value}"


class BlobpipeError(Exception):
    """Base class of every error raised by blobpipe."""


class ArgumentError(BlobpipeError, ValueError):
    """An argument's value is not acceptable; the message names the argument, the
    value given and what is expected."""


class ArgumentTypeError(BlobpipeError, TypeError):
    """An argument is of the wrong type (the message shows what was passed)."""


class FileMissingError(BlobpipeError, FileNotFoundError):
    """A file or folder named by the caller (mean file, prototxt, list file, image
    root) does not exist.

    ``filename`` is the path, as for :class:`FileNotFoundError`.
    """

    def __init__(self, message: str, *, path: object) -> None:
        super().__init__(errno.ENOENT, message, str(path))

    def __str__(self) -> str:
        if str(self.filename) in str(self.strerror):
            return str(self.strerror)
        return f"{self.strerror}: {self.filename!r}"

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_file_missing, (self.strerror, self.filename))


def _rebuild_file_missing(message: str, path: str) -> FileMissingError:
    return FileMissingError(message, path=path)


class ShapeError(BlobpipeError, ValueError):
    """A shape, axis count, dimension or dtype is not acceptable."""


class BlobIndexError(BlobpipeError, IndexError):
    """An axis or an index lies outside a blob's shape."""


class UnsupportedOperationError(BlobpipeError, TypeError):
    """The operation is not defined for this blob (e.g. math on an integer blob)."""


class StateError(BlobpipeError, RuntimeError):
    """An object is used in a state that does not allow it (closed, ...)."""


class BackendUnavailableError(BlobpipeError, RuntimeError):
    """The requested device backend cannot be used on this machine."""


class MissingDependencyError(BlobpipeError, ImportError):
    """An optional package a feature needs is not installed; the message names the
    package and the extra that installs it."""


class PoolMemoryError(BlobpipeError, MemoryError):
    """A buffer pool could not provide a block, even after freeing its cache."""


class ProtoError(BlobpipeError, ValueError):
    """A protobuf message or prototxt file cannot be used."""


class OutputExistsError(BlobpipeError, FileExistsError):
    """A tool's output path exists and ``force`` was not given (the message says how)."""


class DiskFullError(BlobpipeError, OSError):
    """A tool's output does not fit on the disk that holds it.

    ``errno`` is ``ENOSPC`` and ``filename`` the output path; the message says how
    much space was needed and free, and what became of the partial output.
    """

    def __init__(self, message: str, *, path: object) -> None:
        super().__init__(message)
        self.errno = errno.ENOSPC
        self.strerror = message
        self.filename = str(path)

    def __str__(self) -> str:
        return str(self.strerror)

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_disk_full, (str(self), self.filename))


def _rebuild_disk_full(message: str, path: str) -> DiskFullError:
    return DiskFullError(message, path=path)


def _describe(message: str, path: object = None, key: bytes | str | None = None) -> str:
    parts = [message]
    if key is not None:
        parts.append(f"record key {key!r}")
    if path is not None:
        parts.append(f"database {str(path)!r}")
    return "; ".join(parts)


class DataError(BlobpipeError, ValueError):
    """A record or a database cannot be read.

    ``path`` and ``key`` name the database and the record, when known, and are
    part of the message.
    """

    def __init__(
        self, message: str, *, path: object = None, key: bytes | str | None = None
    ) -> None:
        super().__init__(_describe(message, path, key))
        self.path = path
        self.key = key

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_data_error, (type(self), str(self), self.path, self.key))


class DatabaseNotFoundError(DataError, FileNotFoundError):
    """The database path does not exist or is not an LMDB environment."""


class RecordNotFoundError(DataError, KeyError):
    """The database holds no record under the requested key."""

    # KeyError.__str__ would print the message as a quoted repr.
    __str__ = Exception.__str__


def _rebuild_data_error(
    cls: type[DataError], text: str, path: object, key: bytes | str | None
) -> DataError:
    err = cls.__new__(cls)
    Exception.__init__(err, text)
    err.path = path
    err.key = key
    return err
