"""A Loader's own arguments, checked here. Batches' options are declared once, in
``_io/_options.py`` (:class:`~blobpipe._io._options.BatchesOptions`): a Loader takes
them as ``**options`` and passes them to :class:`~blobpipe.Batches` unchanged, but
``order`` (the Loader's own, with ``shuffle``) and ``split_transform`` (the Loader
decides it: ``device_transform``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from .._backends import Backend
from .._errors import ArgumentError
from .._io._options import check_keywords
from .._io._order import Order

__all__ = ["LOADER_DECIDES", "check_loader_args", "split_on_device"]

#: Batches options a Loader decides itself (not among its ``**options``).
LOADER_DECIDES = frozenset({"order", "split_transform"})


def check_loader_args(
    options: Mapping[str, object],
    prefetch: int,
    workers: int | None,
    order: Order | None,
    shuffle: bool,
) -> tuple[int, int, Order]:
    """A Loader's arguments checked: ``(prefetch, workers, order)``, with workers
    defaulting to the CPU count and order to ``shuffle``'s (Batches checks the rest).

    Raises:
        ArgumentTypeError: a keyword in ``options`` that is not a Batches option.
        ArgumentError: prefetch or workers not a positive integer; ``shuffle``
            contradicting ``order``.
    """
    check_keywords(options, "Loader.__init__", LOADER_DECIDES)
    if isinstance(prefetch, bool) or int(prefetch) != prefetch or prefetch < 1:
        raise ArgumentError(f"Loader: prefetch must be a positive integer, got {prefetch!r}")
    if workers is None:
        workers = os.cpu_count() or 1
    if isinstance(workers, bool) or int(workers) != workers or workers < 1:
        raise ArgumentError(f"Loader: workers must be a positive integer, got {workers!r}")
    if order is None:
        order = "shuffle" if shuffle else "key"
    elif shuffle and order != "shuffle":
        raise ArgumentError(f"Loader: shuffle=True contradicts order={order!r} (give one of them)")
    return int(prefetch), int(workers), order


def split_on_device(requested: bool | None, backend: Backend, device: object) -> bool:
    """Whether to ask the Batches to split the transform for the device (Batches'
    ``split_transform``): with a device, unless ``device_transform=False``. Batches
    then splits a float32 transform over Datums; the Loader checks the rest.

    Raises:
        ArgumentError: ``device_transform=True`` without a device (``device`` is the
            argument the user passed).
    """
    if requested and not backend.has_device:
        raise ArgumentError(
            f"device_transform=True needs a device, but device={device!r} resolved to the "
            f"{backend.name!r} backend"
        )
    return backend.has_device and requested is not False
