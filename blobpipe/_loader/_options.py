"""A Loader's arguments: its own checked here, Batches' options defined once (a
Loader takes them as ``**options`` and passes them to :class:`~blobpipe.Batches`
unchanged).

A Batches option added to :class:`BatchesOptions` is a Loader option too, typed
and shown by ``help(Loader)``, with no edit to the Loader.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable, Collection, Mapping
from typing import Any, Literal, TypedDict

from .._errors import ArgumentError, ArgumentTypeError
from .._io._batches import Batches
from .._io._order import Order
from .._io._transform import Phase, Transform

if sys.version_info >= (3, 11):
    from typing import Unpack
else:
    from typing_extensions import Unpack

__all__ = [
    "BatchesOptions",
    "Unpack",
    "check_loader_args",
    "check_options",
    "signature_with_options",
]


class BatchesOptions(TypedDict, total=False):
    """The keyword options of :class:`~blobpipe.Batches` that a Loader passes through
    (their defaults, checks and errors are Batches'). ``order`` is the Loader's own
    (it adds ``shuffle``), as are ``source`` and ``batch_size`` (a default of 64)."""

    transform: Transform | Mapping[str, Transform] | None
    phase: Phase
    buffer_size: int | None
    seed: int
    shard: tuple[int, int] | Literal["auto"] | None
    shard_mode: Literal["strided", "contiguous", "node"]
    pad_shards: bool | Literal["drop"]
    mode: Literal["wrap", "epoch"]
    last: Literal["keep", "drop", "pad"]
    readahead: bool
    state: dict[str, Any] | None
    label_dtype: Literal["float32", "int64"]
    record: (
        Literal["auto", "datum", "blobproto"] | Mapping[str, Literal["auto", "datum", "blobproto"]]
    )
    blob_dtype: Literal["float32", "float64"]
    share_random: bool | Collection[str]
    max_batch_bytes: int
    ranks_per_node: int | None


def check_options(options: Mapping[str, object], owner: str) -> None:
    """Raises TypeError for a keyword that is not a Batches option, as Python
    would for ``owner``'s own signature."""
    for name in options:
        if name not in BatchesOptions.__optional_keys__:
            raise ArgumentTypeError(f"{owner}() got an unexpected keyword argument {name!r}")


def signature_with_options(function: Callable[..., Any]) -> inspect.Signature:
    """``function``'s signature with its ``**options`` spelled out as Batches'
    parameters (names, annotations, defaults): what ``help()`` and IDEs show."""
    own = inspect.signature(function)
    batches = inspect.signature(Batches.__init__).parameters
    params = [p for p in own.parameters.values() if p.kind is not p.VAR_KEYWORD]
    params += [batches[name] for name in BatchesOptions.__annotations__]
    return own.replace(parameters=params)


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
    check_options(options, "Loader.__init__")
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
