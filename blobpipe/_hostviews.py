"""A host buffer's typed views, as a Blob hands them out: made once per buffer and
shape and shared by the blob and its views (``Blob.view``), each caller getting a fresh
view of one (what a caller does to its own is not the next caller's).

A read-only accessor's array is a view of the read-only twin, so its flag cannot be
set again; a blob with an owner (a loader batch's lease) hands out views of an array
whose base references the owner (:func:`~blobpipe._backends._base.hold_array`), made
from the twin's array interface for a read-only one.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._backends._base import hold_array

__all__ = ["TypedViews", "held_key"]

#: the held-array cache's key of a host array of data or diff, by (which, writable)
_KEYS = {
    ("data", True): "data",
    ("data", False): "data (read-only)",
    ("diff", True): "diff",
    ("diff", False): "diff (read-only)",
}


def held_key(which: str, writable: bool) -> str:
    """The key a blob caches its held array of ``which`` ("data", "diff") under."""
    return _KEYS[which, writable]


class TypedViews:
    """A buffer's typed view for a shape, its read-only twin, and their array
    interfaces, each made when first asked for (two threads racing make equal ones)."""

    __slots__ = ("interface", "raw", "readonly", "readonly_interface", "shape", "typed")

    def __init__(self, raw: Any, shape: tuple[int, ...], typed: np.ndarray[Any, Any]) -> None:
        self.raw = raw
        self.shape = shape
        self.typed = typed
        self.readonly: np.ndarray[Any, Any] | None = None
        self.interface: dict[str, Any] | None = None
        self.readonly_interface: dict[str, Any] | None = None

    def read_only(self) -> np.ndarray[Any, Any]:
        """The typed view, read-only (views of it are too)."""
        if self.readonly is None:
            readonly = self.typed.view()
            readonly.flags.writeable = False
            self.readonly = readonly
        return self.readonly

    def held(self, owner: object, writable: bool) -> np.ndarray[Any, Any]:
        """The typed view (or, not ``writable``, its read-only twin, whose views cannot
        be made writable) as an array whose base references ``owner``."""
        if writable:
            if self.interface is None:
                self.interface = self.typed.__array_interface__
            return hold_array(self.typed, owner, self.interface)
        if self.readonly_interface is None:
            self.readonly_interface = self.read_only().__array_interface__
        return hold_array(self.typed, owner, self.readonly_interface)
