"""The options of :class:`~blobpipe.Batches`, declared once: :class:`BatchesOptions`.

One frozen record holds each option's type, default and description, and
:meth:`BatchesOptions.__post_init__` is the one place their values are checked
(and ``shard``/``ranks_per_node`` resolved, so that a pickled Batches reopens
with the shard it had). A :class:`~blobpipe.Loader` passes the same keywords
through. ``help(Batches)`` and ``help(Loader)`` describe each option with the
record's own text (:func:`with_options_doc`) and show the record's defaults
(:func:`signature_with_options`). :class:`BatchesKeywords` (and
:class:`PassThroughKeywords`, a Loader's share of them) type the same keywords
for static checkers (``**options: Unpack[BatchesKeywords]``);
``tests/test_loader_options.py`` holds them to the record's names and types.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import textwrap
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict, cast

from .._errors import ArgumentError, ArgumentTypeError
from ._order import Order, ShardMode, ranks_per_node_from, shard_from
from ._transform import Phase, Transform, check_phase

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # pragma: no cover - Python 3.10
    from typing_extensions import Unpack

__all__ = [
    "DEFAULT_MAX_BATCH_BYTES",
    "BatchesKeywords",
    "BatchesOptions",
    "Last",
    "Mode",
    "PassThroughKeywords",
    "Record",
    "Unpack",
    "check_keywords",
    "signature_with_options",
    "with_options_doc",
]

Mode = Literal["wrap", "epoch"]
Last = Literal["keep", "drop", "pad"]
Record = Literal["auto", "datum", "blobproto"]

#: Largest batch (the data array of one batch, each source's) Batches plans by default.
DEFAULT_MAX_BATCH_BYTES = 4 << 30


def _doc(text: str) -> dict[str, str]:
    """A field's metadata: its description, on one line."""
    return {"doc": " ".join(text.split())}


@dataclass(frozen=True, kw_only=True)
class BatchesOptions:
    """Batches' keyword options, checked (see the module docstring); ``batch_size``
    with them, checked here too. Made by ``Batches(source, batch_size, **options)``."""

    batch_size: int
    transform: Transform | Mapping[str, Transform] | None = field(
        default=None,
        metadata=_doc(
            """the :class:`~blobpipe.Transform` (default: none, float32 NCHW output); with
            several sources a mapping ``{name: Transform}`` (sources left out get none)."""
        ),
    )
    phase: Phase = field(
        default="train",
        metadata=_doc(
            """"train" (random crops) or "test" (centre crops); mirror is random in both
            when enabled, as in Caffe ("TRAIN" and "TEST" are taken too)."""
        ),
    )
    order: Order = field(
        default="key",
        metadata=_doc(
            """"key" (Caffe), "shuffle" (a global permutation per epoch, seeded by ``(seed,
            epoch)``), "buffer" (a shuffle buffer of ``buffer_size`` records over key
            order: reads stay near each other) or "quasi" (for databases larger than
            memory: runs of ``buffer_size // 32`` consecutive records, permuted,
            shuffled together 32 runs at a time, so an epoch reads from at most
            ``buffer_size`` records' worth of the file at once)."""
        ),
    )
    buffer_size: int | None = field(
        default=None,
        metadata=_doc(
            """the shuffle buffer's or the quasi-random window's size; only with
            ``order="buffer"`` or ``"quasi"``."""
        ),
    )
    seed: int = field(
        default=0,
        metadata=_doc("seeds the shuffle and the per-record randomness (crops, flips)."),
    )
    shard: tuple[int, int] | Literal["auto"] | None = field(
        default=None,
        metadata=_doc(
            """``None``, ``(rank, world_size)`` or "auto": an initialised
            ``torch.distributed`` process group's rank and size, else torchrun's
            ``RANK``/``WORLD_SIZE`` environment variables, else no sharding."""
        ),
    )
    shard_mode: ShardMode = field(
        default="strided",
        metadata=_doc(
            """"strided" (record position ``i`` goes to rank ``i % world``), "contiguous",
            or "node": each node (``ranks_per_node`` consecutive ranks) keeps the same
            part of the records in every epoch, ordered within the node and split
            between its ranks, so a node's page cache holds only its part."""
        ),
    )
    ranks_per_node: int | None = field(
        default=None,
        metadata=_doc(
            """the ranks of one node, with ``shard_mode="node"`` (default: torchrun's
            ``LOCAL_WORLD_SIZE``)."""
        ),
    )
    pad_shards: bool | Literal["drop"] = field(
        default=True,
        metadata=_doc(
            """how sharded epochs are made equal. True: every rank gets ``ceil(n / world)``
            records, the epoch's order wrapping around to repeat its first records, as
            torch's DistributedSampler does; "drop": every rank gets ``floor(n /
            world)``, the last ``n % world`` positions of the epoch's order unread
            (DistributedSampler's ``drop_last``). Either way every rank sees the same
            number of batches, which distributed training needs. False: shards are
            disjoint and cover every record once, and may differ in length by one. No
            effect without shards."""
        ),
    )
    mode: Mode = field(
        default="wrap",
        metadata=_doc(
            """"wrap" (Caffe: the cursor wraps to the start mid-batch, every batch is full,
            iteration is endless) or "epoch" (iteration stops at the end of each epoch;
            iterate again for the next epoch)."""
        ),
    )
    last: Last = field(
        default="keep",
        metadata=_doc(
            """with ``mode="epoch"``, the last partial batch of an epoch is kept (smaller),
            dropped, or padded to ``batch_size`` with the epoch's first records
            (``batch.valid`` counts the real rows): "keep", "drop" or "pad"."""
        ),
    )
    readahead: bool = field(
        default=False,
        metadata=_doc("passed to the LMDB reader (OS readahead; off suits random access)."),
    )
    state: dict[str, Any] | None = field(
        default=None,
        metadata=_doc("""a resume state to start from: ``state_dict()`` or a batch's ``state``."""),
    )
    label_dtype: Literal["float32", "int64"] = field(
        default="float32",
        metadata=_doc(
            """"float32" (Caffe's DataLayer output) or "int64" (the exact int32 labels, as
            class indices: ``CrossEntropyLoss`` takes them)."""
        ),
    )
    record: Record | Mapping[str, Record] = field(
        default="auto",
        metadata=_doc(
            """"auto" (told from the first records), "datum" or "blobproto" (records are
            ``caffe.BlobProto``: batches of shape ``(N, *blob shape)``, no labels); with
            several sources, one value or a mapping by name."""
        ),
    )
    blob_dtype: Literal["float32", "float64"] = field(
        default="float32",
        metadata=_doc(
            """BlobProto batches' element type: "float32" or "float64" (the exact values of
            records holding ``double_data``)."""
        ),
    )
    share_random: bool | Collection[str] = field(
        default=False,
        metadata=_doc(
            """with several sources, which draw the same random crop and flip per row (an
            image and its label map): True (all), or a collection of names; others draw
            their own. Sharing sources need the same ``crop_size`` and ``mirror``, and
            records of one height and width."""
        ),
    )
    max_batch_bytes: int = field(
        default=DEFAULT_MAX_BATCH_BYTES,
        metadata=_doc(
            """the largest data array one batch may need (each source's; default 4 GiB): a
            batch the records would make larger is a DataError naming the record, before
            anything is allocated."""
        ),
    )
    split_transform: bool = field(
        default=False,
        metadata=_doc(
            """True: where the primary source holds Datums and its transform outputs
            float32, its rows are filled with the transform's host half (crop and mirror
            into uint8 NCHW, :meth:`~blobpipe.Transform.host_half`), the rest left to a
            device (a Loader's device transform); ``split_from`` is then the whole
            transform."""
        ),
    )

    def __post_init__(self) -> None:
        """Check every option's value (the one place; ``transform``, ``record`` and
        ``share_random`` name sources, so the sources check them as they open), and
        resolve the shard.

        Raises:
            ArgumentError: a value out of its range or choices, or options that
                contradict each other.
            ArgumentTypeError: ``shard`` or ``split_transform`` of the wrong type.
        """
        _positive("batch_size", self.batch_size)
        _positive("max_batch_bytes", self.max_batch_bytes)
        _set(self, "phase", check_phase(self.phase))
        _one_of("order", self.order, ("key", "shuffle", "buffer", "quasi"))
        if self.order in ("buffer", "quasi"):
            if self.buffer_size is None or self.buffer_size < 1:
                raise ArgumentError(
                    f"order={self.order!r} needs buffer_size >= 1, got "
                    f"buffer_size={self.buffer_size!r}"
                )
        elif self.buffer_size is not None:
            raise ArgumentError(
                f"buffer_size is only used with order='buffer' or 'quasi', not {self.order!r}"
            )
        _one_of("mode", self.mode, ("wrap", "epoch"))
        _one_of("last", self.last, ("keep", "drop", "pad"))
        _one_of("shard_mode", self.shard_mode, ("strided", "contiguous", "node"))
        _one_of("label_dtype", self.label_dtype, ("float32", "int64"))
        _one_of("blob_dtype", self.blob_dtype, ("float32", "float64"))
        if isinstance(self.seed, bool) or int(self.seed) != self.seed or self.seed < 0:
            raise ArgumentError(f"seed must be a non-negative integer, got {self.seed!r}")
        if self.pad_shards not in (True, False, "drop"):
            raise ArgumentError(
                f"pad_shards must be True, False or 'drop', got {self.pad_shards!r}"
            )
        if not isinstance(self.split_transform, bool):
            raise ArgumentTypeError(
                f"split_transform must be True or False, got {self.split_transform!r}"
            )
        rank, world = shard_from(self.shard)
        _set(self, "shard", (rank, world))
        if self.shard_mode == "node":
            _set(self, "ranks_per_node", ranks_per_node_from(self.ranks_per_node, world))

    @property
    def rank_world(self) -> tuple[int, int]:
        """``(rank, world_size)``: the shard, as resolved when the record was made."""
        return cast("tuple[int, int]", self.shard)

    @property
    def per_node(self) -> int:
        """The ranks of one node (1 unless ``shard_mode="node"``)."""
        return cast(int, self.ranks_per_node) if self.shard_mode == "node" else 1

    def keywords(self) -> dict[str, Any]:
        """The options as keywords of ``Batches(source, **keywords)`` (``batch_size``
        included): a copy made from them is this record again."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


class PassThroughKeywords(TypedDict, total=False):
    """:class:`BatchesOptions` as keyword types but ``batch_size``, and ``order`` and
    ``split_transform`` (which a Loader decides): the options a Loader passes
    through, for ``**options: Unpack[PassThroughKeywords]``."""

    transform: Transform | Mapping[str, Transform] | None
    phase: Phase
    buffer_size: int | None
    seed: int
    shard: tuple[int, int] | Literal["auto"] | None
    shard_mode: ShardMode
    ranks_per_node: int | None
    pad_shards: bool | Literal["drop"]
    mode: Mode
    last: Last
    readahead: bool
    state: dict[str, Any] | None
    label_dtype: Literal["float32", "int64"]
    record: Record | Mapping[str, Record]
    blob_dtype: Literal["float32", "float64"]
    share_random: bool | Collection[str]
    max_batch_bytes: int


class BatchesKeywords(PassThroughKeywords, total=False):
    """:class:`BatchesOptions` as keyword types but ``batch_size``, for
    ``**options: Unpack[BatchesKeywords]``."""

    order: Order
    split_transform: bool


def _set(options: BatchesOptions, name: str, value: object) -> None:
    object.__setattr__(options, name, value)  # a frozen record, normalised as it is made


def _positive(name: str, value: Any) -> None:
    try:
        whole = not isinstance(value, bool) and int(value) == value and value >= 1
    except (TypeError, ValueError):  # not a number
        whole = False
    if not whole:
        raise ArgumentError(f"{name} must be a positive integer, got {value!r}")


def _one_of(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        listed = ", ".join(repr(c) for c in choices[:-1]) + f" or {choices[-1]!r}"
        raise ArgumentError(f"{name} must be {listed}, got {value!r}")


def option_names(exclude: Collection[str] = ()) -> list[str]:
    """The keyword options, in the record's order, but ``batch_size`` and ``exclude``."""
    return [
        f.name
        for f in dataclasses.fields(BatchesOptions)
        if f.name != "batch_size" and f.name not in exclude
    ]


def check_keywords(options: Mapping[str, object], owner: str, exclude: Collection[str]) -> None:
    """Refuse a keyword that is not an option (or is one of ``exclude``), as Python
    would for ``owner``'s own signature.

    Raises:
        ArgumentTypeError: names the keyword.
    """
    known = set(option_names(exclude))
    for name in options:
        if name not in known:
            raise ArgumentTypeError(f"{owner}() got an unexpected keyword argument {name!r}")


def signature_with_options(
    function: Callable[..., Any], exclude: Collection[str] = ()
) -> inspect.Signature:
    """``function``'s signature with its ``**options`` spelled out as the record's
    keyword options (names, annotations, defaults) but ``exclude``: what ``help()``
    and IDEs show."""
    own = inspect.signature(function)
    params = [p for p in own.parameters.values() if p.kind is not p.VAR_KEYWORD]
    taken = {p.name for p in params}
    fields = {f.name: f for f in dataclasses.fields(BatchesOptions)}
    for name in option_names(exclude):
        if name not in taken:
            f = fields[name]
            params.append(
                inspect.Parameter(
                    name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type
                )
            )
    return own.replace(parameters=params)


#: The line of a docstring that :func:`with_options_doc` replaces.
OPTIONS_MARK = "{options}"


def with_options_doc(doc: str | None, exclude: Collection[str] = ()) -> str:
    """``doc`` with its line ``{options}`` replaced by every keyword option's
    description but ``exclude``, ``name: text`` at that line's indentation."""
    if doc is None:  # pragma: no cover - run with -OO
        return ""
    fields = {f.name: f for f in dataclasses.fields(BatchesOptions)}
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        if line.strip() == OPTIONS_MARK:
            indent = line[: len(line) - len(line.lstrip())]
            described = []
            for name in option_names(exclude):
                # code spans (``...``) are never broken across lines
                text = re.sub(
                    r"``.*?``",
                    lambda m: m.group().replace(" ", "\0"),
                    f"{name}: {fields[name].metadata['doc']}",
                )
                wrapped = textwrap.wrap(
                    text,
                    width=88,
                    initial_indent=indent,
                    subsequent_indent=indent + "    ",
                    break_on_hyphens=False,
                    break_long_words=False,
                )
                described += [line.replace("\0", " ") for line in wrapped]
            lines[i : i + 1] = described
            return "\n".join(lines)
    raise ValueError("the docstring has no {options} line")  # pragma: no cover
