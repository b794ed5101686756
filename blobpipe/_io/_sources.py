"""The databases a :class:`~blobpipe.Batches` reads: its *sources*.

A source has a name (``"data"`` for a single database), one or several databases
read as one (a list: record ``i`` of the whole lies in the database holding it, in
list order; ``ConcatFiller``), one record kind (Datum or BlobProto, told from the
first record or named) and one filler with its transform. Several named sources are
read in lockstep, row by row: :func:`open_sources` checks at open that they hold the
same keys, in the same order. The first (``"data"`` when there is one) is the
primary: its keys make the order, its plan is ``batch.data``'s.

Random words: a source's crop and flip come from the primary's words mixed with a
salt of its name; sources in ``share_random`` share one salt (none when the primary
is among them), so they draw the same crop and flip, and adding a source never
changes the primary's draws.
"""

from __future__ import annotations

import os
import zlib
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import ArgumentError, ArgumentTypeError, DataError
from ._concat import ConcatFiller
from ._database import open_reader
from ._fill import Filler, RecordSource, RowFiller, shape_fix
from ._kernels import mix_words
from ._leveldb import LevelDbReader
from ._lmdb import LmdbReader
from ._options import Record
from ._plan import BatchPlan, read_only
from ._records import BLOBPROTO, DATUM, RecordKind, record_kind
from ._transform import Phase, Transform

__all__ = ["Part", "Record", "Source", "SourceArg", "Sources", "check_shared", "open_sources"]

# records read at open, besides the first, to tell a database's kind
_SAMPLE = 8
# the most bytes of their values requested from the OS at once before they are read
_SAMPLE_BYTES = 16 << 20
_NAMES = {DATUM: "Datum", BLOBPROTO: "BlobProto"}
SourceArg = str | os.PathLike[str] | RecordSource
Sources = SourceArg | list[SourceArg] | tuple[SourceArg, ...]


@dataclass(eq=False)
class Part:
    """One database: its reader (closed by Batches when ``owned``), path and keys."""

    reader: RecordSource
    owned: bool
    path: object
    keys: Any = ()


@dataclass(eq=False)
class Source:
    """One named source of a Batches: its databases (several read as one), their
    keys joined, its filler, and the salt of its random words (0: the first
    source's words; sources sharing their crops and flips share a salt)."""

    name: str
    parts: list[Part]
    keys: Any = ()
    filler: Any = None  # a RowFiller once open_sources made it
    salt: int = 0
    split_from: Transform | None = None  # the whole transform when the filler has its host half

    @property
    def path(self) -> object:
        paths = [p.path for p in self.parts]
        if len(paths) == 1:
            return paths[0]
        return " + ".join(str(p) for p in paths)

    def words(self, words: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
        """This source's random words (read-only) for rows whose primary words are
        ``words``."""
        if not self.salt:
            return words
        return read_only(mix_words(words, self.salt))

    def close(self) -> None:
        """Close the filler, and the readers this source opened."""
        if self.filler is not None:
            self.filler.close()
        for part in self.parts:
            if part.owned:
                close = getattr(part.reader, "close", None)
                if close is not None:
                    close()
            part.keys = ()  # views of the database's index: its map goes with the reader
        self.keys = ()


def open_sources(
    opened: list[Source],
    source: Sources | Mapping[str, Sources],
    transform: Transform | Mapping[str, Transform] | None,
    record: Record | Mapping[str, Record],
    blob_dtype: np.dtype[Any],
    share_random: bool | Collection[str],
    readahead: bool,
    phase: Phase,
    split: bool = False,
) -> tuple[Source, ...]:
    """Open every source into ``opened`` (the primary first; appended as they open,
    so the caller closes what opened if this raises), tell each one's record kind,
    check that their keys agree, and give each its filler. With ``split``, a primary
    of Datums whose transform outputs float32 is filled with the transform's host
    half (:meth:`Transform.host_half`; its ``split_from`` the whole one).
    Returns the sources that share their crops and flips.

    Raises:
        ValueError, TypeError: bad names, transforms, record kinds or sharing.
        DataError: keys that differ between sources, kinds that differ between
            the databases of one source, sharing sources whose crops differ.
    """
    if isinstance(source, Mapping):
        named = dict(source)
        if not named:
            raise ArgumentError("source is an empty mapping: name at least one database")
        for name in named:
            if not isinstance(name, str) or not name:
                raise ArgumentTypeError(f"source names must be non-empty strings, got {name!r}")
    else:
        named = {"data": source}
    names = list(named)
    if "data" in names:  # batch.data is the source named "data", else the first
        names.remove("data")
        names.insert(0, "data")
    transforms = _per_source("transform", transform, names, multi=isinstance(source, Mapping))
    records = _per_source("record", record, names, multi=True)
    shared = _shared_names(share_random, names)
    for name in names:
        arg = named[name]
        src = Source(name, [])
        opened.append(src)
        ones = list(arg) if isinstance(arg, (list, tuple)) else [arg]
        if not ones:
            raise ArgumentError(f"source {name!r} is an empty list: name at least one database")
        for one in ones:
            if isinstance(one, (str, os.PathLike)):
                part = Part(open_reader(one, readahead=readahead), True, os.fspath(one))
            else:
                part = Part(one, False, getattr(one, "path", None))
            src.parts.append(part)
            keys = part.reader.keys()
            # readers' keys are bytes already, as are those of sources that make records
            made = (LmdbReader, LevelDbReader)
            if not isinstance(part.reader, made) and not hasattr(part.reader, "record_kind"):
                keys = tuple(bytes(k) for k in keys)
            part.keys = keys
        if len(src.parts) == 1:
            src.keys = src.parts[0].keys
        else:
            src.keys = tuple(k for part in src.parts for k in part.keys)
    primary = opened[0]
    for src in opened[1:]:
        _check_same_keys(primary, src)
    group_salt = 0 if primary.name in shared else _salt("\0shared")
    for src in opened:
        t = transforms.get(src.name)
        t = Transform() if t is None else t
        kinds = [_record_kind(records[src.name], part) for part in src.parts]
        for part, kind in zip(src.parts[1:], kinds[1:], strict=True):
            if kind != kinds[0]:
                raise DataError(
                    f"the databases of source {src.name!r} hold different kinds of "
                    f"record: {src.parts[0].path} holds {kinds[0]}s, {part.path} "
                    f"{kind}s; databases read as one must hold one kind",
                    path=part.path,
                )
        if split and src is primary and kinds[0] == DATUM and t.dtype == np.float32:
            src.split_from, t = t, t.host_half()  # a device finishes the rows
        src.filler = _make_filler(src, t, phase, kinds[0], blob_dtype)
        if len(src.parts) > 1:
            _check_part_shapes(src)
        if src is not primary:
            src.salt = group_salt if src.name in shared else _salt(src.name)
    sharing = [s for s in opened if s.name in shared]
    for src in sharing[1:]:
        a, b = sharing[0].filler.transform, src.filler.transform
        if (a.crop_size, a.mirror) != (b.crop_size, b.mirror):
            raise ArgumentError(
                f"sources {sharing[0].name!r} and {src.name!r} share their random crops "
                f"and flips but their transforms differ (crop_size {a.crop_size} and "
                f"{b.crop_size}, mirror {a.mirror} and {b.mirror}): give them the same "
                "crop_size and mirror"
            )
    return tuple(sharing)


def check_shared(plans: list[BatchPlan], sharing: tuple[Source, ...]) -> None:
    """Sources that share their crops and flips have records of one height and
    width (rows of one batch share their shape, so the first rows tell).

    Raises:
        DataError: naming the key and both sources.
    """
    names = {s.name: s for s in sharing}
    shared = [p for p in plans if p.name in names]
    for p in shared[1:]:
        a, b = shared[0], p
        if a.record_shape[-2:] != b.record_shape[-2:]:
            src = names[b.name]
            raise DataError(
                f"sources {a.name!r} and {b.name!r} share their random crops and flips, "
                f"but record {a.keys[0]!r} has shape {a.record_shape} in {a.name!r} and "
                f"{b.record_shape} in {b.name!r}: shared crops need records of one height "
                "and width",
                path=src.path,
                key=a.keys[0],
            )


def _per_source(what: str, value: Any, names: list[str], *, multi: bool) -> dict[str, Any]:
    """``value`` (one for all, or a mapping by source name) as a mapping by name.

    Raises:
        ValueError: a mapping naming a source that does not exist, or one transform
            for several sources.
    """
    if isinstance(value, Mapping):
        unknown = [k for k in value if k not in names]
        if unknown:
            raise ArgumentError(f"{what} names {unknown[0]!r}, which is not a source; the sources "
                             f"are {names}")  # fmt: skip
        return dict(value)
    if what == "transform" and multi and len(names) > 1 and value is not None:
        raise ArgumentError(
            "with several sources, give transform as a mapping {name: Transform}: each "
            "source has its own (an image's mean does not belong on its label map)"
        )
    return dict.fromkeys(names, value)


def _shared_names(share_random: bool | Collection[str], names: list[str]) -> frozenset[str]:
    """The sources that share their random crops and flips."""
    if share_random is True:
        return frozenset(names)
    if share_random is False:
        return frozenset()
    if isinstance(share_random, str):
        raise ArgumentTypeError("share_random takes True, False or a collection of source names")
    chosen = frozenset(share_random)
    unknown = sorted(chosen - set(names))
    if unknown:
        raise ArgumentError(
            f"share_random names {unknown[0]!r}, which is not a source; the sources are {names}"
        )
    return chosen


def _salt(name: str) -> int:
    """A source's salt for its random words (never 0, the primary's)."""
    return (zlib.crc32(name.encode()) << 1) | 1


def _make_filler(
    src: Source, transform: Transform, phase: Phase, kind: RecordKind, blob_dtype: Any
) -> RowFiller:
    """The filler of ``src``: one database's, or one per database joined; a source
    that fills its own rows (``row_filler``: Hdf5Data's) makes its own."""
    fillers = [
        own(transform, phase, p.path, blob_dtype)
        if (own := getattr(p.reader, "row_filler", None)) is not None
        else Filler(p.reader, p.keys, transform, phase, p.path, kind, blob_dtype)
        for p in src.parts
    ]
    if len(fillers) == 1:
        return fillers[0]
    return ConcatFiller(fillers, [len(p.keys) for p in src.parts])


def _record_kind(record: Any, src: Part) -> RecordKind:
    """The record kind of the database ``src``: named, or told from its first record.

    Raises:
        ValueError: a bad ``record`` value.
    """
    if record == "datum":
        return DATUM
    if record == "blobproto":
        return BLOBPROTO
    if record != "auto":
        raise ArgumentError(f"record must be 'auto', 'datum' or 'blobproto', got {record!r}")
    known: RecordKind | None = getattr(src.reader, "record_kind", None)
    if known is not None:  # a source that makes its records (ImageList, Hdf5Data's)
        return known
    keys = src.keys
    n = len(keys)
    if not n:
        return DATUM  # empty: refused with its own message
    # the kind most records have, told from a few spread over the database: a first
    # record of the other kind is the one named
    picks = sorted({(n - 1) * i // _SAMPLE for i in range(1, _SAMPLE + 1)} - {0})
    if isinstance(src.reader, LmdbReader):
        # all of them requested before the first is read: a cold file reads them at
        # once, not one after another (a hint: a cached file costs a lookup a record)
        src.reader.will_need(np.array([0, *picks], np.int64), _SAMPLE_BYTES)
    first = record_kind(src.reader.get(keys[0]))
    seen = {i: record_kind(src.reader.get(keys[i])) for i in picks}
    counts: Counter[RecordKind] = Counter(k for k in seen.values() if k is not None)
    majority = counts.most_common(1)[0][0] if counts else None
    if first is None:  # neither: read as the others are, whose path names record 0
        return DATUM if majority is None else majority
    if majority is not None and majority != first and counts[majority] > len(picks) // 2:
        other = next(keys[i] for i, k in seen.items() if k == majority)
        raise DataError(
            f"record {keys[0]!r} is a caffe.{_NAMES[first]} but the database's other "
            f"records are {_NAMES[majority]}s (e.g. {other!r}): a database must hold one "
            "kind of record; remove it, or rebuild the database",
            path=src.path,
            key=keys[0],
        )
    return first


def _check_part_shapes(src: Source) -> None:
    """The databases of ``src`` make rows of one shape, as far as their first records
    tell (a batch's rows share a shape).

    Raises:
        DataError: naming both records (key and database) and the fix.
    """
    filler = src.filler
    seen: tuple[bytes, object, tuple[int, ...], tuple[int, ...]] | None = None
    start = 0
    for part in src.parts:
        if len(part.keys):
            key = part.keys[0]
            shape, _ = filler.first(start)
            out, _ = filler.output(shape, key)
            if seen is None:
                seen = (key, part.path, shape, out)
            elif out != seen[3]:
                key0, path0, shape0, _ = seen
                raise DataError(
                    f"the databases of source {src.name!r} are read as one, but record "
                    f"{key0!r} of {path0} has shape {shape0} and record {key!r} of "
                    f"{part.path} has shape {shape}: the rows of a batch share one shape; "
                    + shape_fix(shape0, shape, filler.kind == DATUM),
                    path=part.path,
                    key=key,
                )
        start += len(part.keys)


def _check_same_keys(a: Source, b: Source) -> None:
    """Sources read in lockstep hold the same keys, in the same order.

    Raises:
        DataError: naming the first key that differs and both databases.
    """
    ka, kb = a.keys, b.keys
    if ka is kb or (len(ka) == len(kb) and tuple(ka) == tuple(kb)):
        return
    for has, lacks in ((a, b), (b, a)):
        present = set(lacks.keys)
        key = next((k for k in has.keys if k not in present), None)
        if key is not None:
            raise DataError(
                f"sources {a.name!r} and {b.name!r} must hold the same keys: key {key!r} of "
                f"{has.name!r} ({has.path}) is not in {lacks.name!r} ({lacks.path}); sources "
                "read in lockstep are one dataset, row by row (write both databases from "
                "one list)",
                path=b.path,
                key=key,
            )
    raise DataError(
        f"sources {a.name!r} and {b.name!r} hold the same keys in another order "
        f"({a.name!r} is {a.path}); read them through LMDB, which orders keys by bytes",
        path=b.path,
    )
