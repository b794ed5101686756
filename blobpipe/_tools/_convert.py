"""``convert_imageset``: images + a Caffe list file → an LMDB of Datums, as Caffe writes it.

Caffe's semantics (``tools/convert_imageset.cpp``, ``util/io.cpp``), kept exactly:

* a list line is ``path label``, split at the LAST space, the label read as
  C's ``atoi`` reads it (``1_000`` is 1; labels that are not plain integers are
  counted and reported once, and refused with ``strict_labels``); the key is
  ``%08d_<path as listed>`` where the number is the line index (after
  ``--shuffle``), counted before unreadable files are skipped;
* images are read as OpenCV's ``imread`` reads them (BGR; colour → 3 channels,
  gray → 1): the file's bytes, read by their bytes path (names that are not
  UTF-8 work, as in Caffe), decoded from memory after a header size check,
  and resized with ``cv2.resize``'s default bilinear only when both sizes are > 0;
* ``encode_type`` implies encoding; ``encoded`` without a type takes the
  file's extension. The file's own bytes are stored when no size is set and
  the extension matches the type (``jpeg`` matches ``jpg``), otherwise the
  image is re-encoded with ``cv2.imencode`` (JPEG quality 95);
* raw Datums carry channels/height/width/data/label and an explicit
  ``encoded: false``; encoded ones only data/label/``encoded: true``.

Deliberate differences: ``shuffle`` is reproducible (``seed``); the output is
built in ``<DB>.partial`` and renamed when complete (see :mod:`._output`);
``check_size`` compares decoded shapes (Caffe's compares an encoded Datum's
byte count with 0 and always fails); a line without a label is an error
instead of label 0; a conversion that writes no record is an error, and leaves
no database.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import DataError, FileMissingError, spell
from .._io._encode import encode_encoded_datum, encode_raw_datum
from .._io._image import (
    DEFAULT_MAX_PIXELS,
    Undecodable,
    decode_image,
    encode_image,
    imread_flag,
    resize_image,
)
from ._leveldbwrite import LEVELDB_FILES, LevelDbWriter
from ._lmdbwrite import DEFAULT_MAP_SIZE, LmdbWriter
from ._output import (
    MARKER_NAME,
    check_output,
    disk_full,
    partial_path,
    promote,
    read_marker,
    remove_partial,
    write_marker,
)
from ._progress import Progress

__all__ = ["ConvertResult", "SkippedImage", "convert_imageset", "read_list_file"]

_log = logging.getLogger("blobpipe")

_DB_FILES = frozenset({"data.mdb", "lock.mdb"}) | LEVELDB_FILES
_CHUNK_BYTES = 64 << 20
_INT32 = (-(2**31), 2**31 - 1)
# C's atoi: leading white space (isspace in the C locale), a sign, decimal digits;
# whatever follows the digits is ignored.
_ATOI = re.compile(rb"[ \t\n\v\f\r]*([+-]?[0-9]+)")
# a label atoi reads whole: an integer, white space around it at most
_INTEGER = re.compile(rb"[ \t\n\v\f\r]*[+-]?[0-9]+[ \t\n\v\f\r]*")
_MAX_KEY = 511  # LMDB's largest key (MDB_MAXKEYSIZE)
_MARKER_KIND = "convert-imageset"


@dataclass(frozen=True)
class SkippedImage:
    """A list entry that produced no record: ``index`` is its (0-based) line index."""

    index: int
    path: str
    reason: str


@dataclass(frozen=True)
class ConvertResult:
    """What :func:`convert_imageset` wrote.

    ``records`` is the number of records in the database; ``skipped`` lists
    every entry without a record (across resumed runs); ``resumed_at`` is the
    line index this run started from (0 for a fresh run); ``seed`` the shuffle
    seed used (``None`` without shuffle).
    """

    path: Path
    records: int
    lines: int
    skipped: tuple[SkippedImage, ...]
    resumed_at: int
    seed: int | None
    loose_labels: int = 0


@dataclass(frozen=True)
class _LooseLabels:
    """The list's labels that are not plain integers (read as ``atoi`` reads them):
    how many, and the first one's line number, text and value."""

    count: int = 0
    line: int = 0
    text: bytes = b""
    label: int = 0

    def notice(self, list_file: Path) -> str:
        """The one line that reports them (with the first example)."""
        many = "" if self.count == 1 else f" ({self.count} such labels in the list)"
        return (
            f"list file {str(list_file)!r} line {self.line}: label {_shown(self.text)} is "
            f"not an integer; read as Caffe's atoi reads it, as {self.label}{many}; pass "
            f"{spell('strict_labels')} to refuse such labels"
        )


def _shown(text: bytes) -> str:
    return repr(text.decode(errors="replace"))


def read_list_file(
    list_file: str | os.PathLike[str], *, strict_labels: bool = False
) -> list[tuple[bytes, int]]:
    """Parse a Caffe list file into ``(path bytes, label)`` pairs, one per line.

    Lines split at the last space (paths may contain spaces); the label is read
    as Caffe's ``atoi`` reads it (leading white space and a sign, then digits; what
    follows them is ignored: ``1_000`` is 1, ``7abc`` is 7, ``3.7`` is 3), unless
    ``strict_labels``. A blank line keeps its index with an empty path (Caffe skips
    it as unreadable).

    Raises:
        FileMissingError: the list file does not exist.
        DataError: (naming the line) a label that holds no digits (Caffe's atoi
            gives 0), that does not fit int32, or, with ``strict_labels``, that is
            not a plain integer; a path too long for an LMDB key; a list file that
            cannot be read.
    """
    path = Path(list_file)
    entries, _ = _parse_list(_read_list(path), path, strict_labels)
    return entries


def _read_list(path: Path) -> bytes:
    """The list file's bytes.

    Raises:
        FileMissingError: it does not exist.
        DataError: it cannot be read.
    """
    try:
        return path.read_bytes()
    except FileNotFoundError as exc:
        raise FileMissingError("the list file does not exist", path=path) from exc
    except OSError as exc:
        raise DataError(f"cannot read list file {str(path)!r}: {exc.strerror}") from exc


def _parse_list(
    raw: bytes, path: Path, strict: bool
) -> tuple[list[tuple[bytes, int]], _LooseLabels]:
    """:func:`read_list_file` of the bytes ``raw`` (of ``path``), and the labels read
    as ``atoi`` reads them."""
    pieces = raw.split(b"\n")
    if pieces and pieces[-1] == b"":
        pieces.pop()
    entries: list[tuple[bytes, int]] = []
    loose = _LooseLabels()
    for number, line in enumerate(pieces, start=1):
        if not line.strip():
            entries.append((b"", 0))
            continue
        pos = line.rfind(b" ")
        digits = _ATOI.match(line, pos + 1) if pos >= 0 else None
        if digits is None:
            raise DataError(
                f"list file {str(path)!r} line {number}: expected 'path label' "
                f"(label an integer after the last space), got {line.decode(errors='replace')!r}"
            )
        label = int(digits.group(1))
        if len(b"%08d_" % (number - 1)) + pos > _MAX_KEY:
            raise DataError(
                f"list file {str(path)!r} line {number}: the path is {pos} bytes; the "
                f"record's key ('%08d_' and the path) would exceed LMDB's {_MAX_KEY}-byte "
                "key limit: use shorter paths (relative to the image root)"
            )
        if not _INT32[0] <= label <= _INT32[1]:
            raise DataError(
                f"list file {str(path)!r} line {number}: label {label} does not fit Caffe's int32"
            )
        text = line[pos + 1 :]
        if not _INTEGER.fullmatch(text):
            if strict:
                raise DataError(
                    f"list file {str(path)!r} line {number}: label {_shown(text)} is not an "
                    f"integer ({spell('strict_labels')}; Caffe's atoi would read "
                    f"{label})"
                )
            if not loose.count:
                loose = _LooseLabels(1, number, text, label)
            else:
                loose = dataclasses.replace(loose, count=loose.count + 1)
        entries.append((line[:pos], label))
    return entries, loose


def _match_ext(filename: str, encoding: str) -> bool:
    dot = filename.rfind(".")
    ext = (filename[dot + 1 :] if dot >= 0 else filename).lower()
    enc = encoding.lower()
    return ext == enc or (enc == "jpg" and ext == "jpeg")


def _read_image(filename: str, is_color: bool) -> npt.NDArray[np.uint8]:
    """The image as Caffe's ``cv::imread`` reads it, ``(H, W, C)`` (C = 1 for gray):
    the file's bytes read here (by their bytes path, so any name the file system
    holds works, as in Caffe) and decoded from memory by the image module
    (``decode_image``: its header's size checked first).

    Raises:
        _Skip: the file cannot be read or decoded, or announces more than
            ``DEFAULT_MAX_PIXELS`` (the reason says which).
    """
    try:
        with open(os.fsencode(filename), "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise _Skip(f"cannot read file: {exc.strerror}") from None
    flag = imread_flag(is_color, not is_color)
    img = decode_image(data, flag, DEFAULT_MAX_PIXELS, too_large="resize it first")
    if isinstance(img, Undecodable):
        raise _Skip(img.reason)
    return img


def _join_root(root: str, path: str) -> str:
    # Caffe concatenates root + path; add the separator Caffe users forget.
    if root and not root.endswith(("/", os.sep)):
        root += os.sep
    return root + path


class _Skip(Exception):
    pass


def _make_record(
    filename: str,
    label: int,
    *,
    key: bytes,
    is_color: bool,
    height: int,
    width: int,
    encoding: str,
) -> tuple[bytes, tuple[int, int, int]]:
    """One Datum as Caffe's ``ReadImageToDatum`` builds it, and the image's CHW shape."""
    if not filename or not os.path.isfile(filename):
        raise _Skip("file not found")
    img = _read_image(filename, is_color)
    if height > 0 and width > 0:
        img = resize_image(img, height, width)
    chw = img.transpose(2, 0, 1)
    shape = (int(chw.shape[0]), int(chw.shape[1]), int(chw.shape[2]))
    if encoding:
        if not height and not width and _match_ext(filename, encoding):
            try:
                with open(filename, "rb") as fh:
                    return encode_encoded_datum(fh.read(), label), shape
            except OSError as exc:
                raise _Skip(f"cannot read file: {exc}") from None
        try:
            encoded = encode_image(img, encoding)
        except DataError as exc:
            raise DataError(
                f"{filename!r}: {exc}; {spell('encode_type', 'jpg')} or "
                f"{spell('encode_type', 'png')}",
                key=key,
            ) from exc
        return encode_encoded_datum(encoded, label), shape
    return encode_raw_datum(chw, label), shape


def _fingerprint(list_bytes: bytes, options: dict[str, Any]) -> str:
    h = hashlib.sha256(list_bytes)
    h.update(repr(sorted(options.items())).encode())
    return h.hexdigest()


def convert_imageset(
    root: str | os.PathLike[str],
    list_file: str | os.PathLike[str],
    db: str | os.PathLike[str],
    *,
    resize_height: int = 0,
    resize_width: int = 0,
    gray: bool = False,
    shuffle: bool = False,
    seed: int | None = None,
    encoded: bool = False,
    encode_type: str = "",
    check_size: bool = False,
    strict_labels: bool = False,
    force: bool = False,
    commit_every: int = 1000,
    map_size: int = DEFAULT_MAP_SIZE,
    quiet: bool = True,
    report: Callable[[str], None] | None = None,
    backend: str = "lmdb",
) -> ConvertResult:
    """Convert ``root`` + ``list_file`` into the LMDB ``db``, exactly as Caffe's tool does.

    ``backend="leveldb"`` writes a LevelDB instead, as Caffe's ``--backend=leveldb``
    leaves one (its write-ahead log holding every record, one write batch per
    ``commit_every`` records; byte for byte Caffe's log, MANIFEST and CURRENT).

    The database is built in ``<db>.partial`` (committed every ``commit_every``
    records, with the map doubled whenever it fills) and renamed to ``db`` when
    complete. Rerunning after an interruption resumes from the last commit
    when the list file and options are unchanged, otherwise starts over.
    ``report`` receives one line per skipped image and per notice (default:
    the ``blobpipe`` logger); ``quiet=False`` draws a progress bar on a
    terminal stderr.

    Labels are read as Caffe's ``atoi`` reads them; those that are not plain
    integers (``3.7``, ``12abc``) are counted (``loose_labels``) and reported once,
    with the first one, or refused with ``strict_labels``. Unreadable images are
    skipped and reported, like Caffe; a conversion that writes no record at all
    raises and leaves no database (nor a partial one).

    Raises:
        OutputExistsError: ``db`` exists and ``force`` is false.
        FileMissingError: the root or the list file does not exist.
        DataError: a root that is not a directory, a malformed list line (a loose
            label with ``strict_labels``), an image that cannot be encoded,
            (``check_size``) a size mismatch, or no record written (every list
            entry skipped, or none).
        ValueError: bad options.
    """
    if resize_height < 0 or resize_width < 0:
        raise ValueError(
            f"resize sizes must be >= 0, got height={resize_height} width={resize_width}"
        )
    if commit_every < 1:
        raise ValueError(f"commit_every must be >= 1, got {commit_every}")
    if seed is not None and not shuffle:
        raise ValueError("seed is only meaningful with shuffle=True")
    if backend not in ("lmdb", "leveldb"):
        raise ValueError(f"backend must be 'lmdb' or 'leveldb', got {backend!r}")
    say = report if report is not None else _log.warning
    root_s = os.fspath(root)
    out = Path(db)
    partial = partial_path(out)
    check_output(out, force=force)
    if not os.path.isdir(root_s):
        if not os.path.exists(root_s):
            raise FileMissingError("the image root does not exist", path=root_s)
        raise DataError(f"image root {root_s!r} is not a directory")
    list_path = Path(list_file)
    list_bytes = _read_list(list_path)
    entries, loose = _parse_list(list_bytes, list_path, strict_labels)
    if loose.count:
        say(loose.notice(list_path))
    is_color = not gray
    encoding = encode_type.lower()
    options: dict[str, Any] = {
        "root": os.path.abspath(root_s),
        "resize_height": resize_height,
        "resize_width": resize_width,
        "gray": gray,
        "shuffle": shuffle,
        "encoded": encoded,
        "encode_type": encoding,
        "check_size": check_size,
    }
    if backend != "lmdb":
        options["backend"] = backend
    if seed is not None:
        options["seed"] = seed
    fingerprint = _fingerprint(list_bytes, options)

    marker = read_marker(partial)
    if marker is not None and (
        marker.get("kind") != _MARKER_KIND or marker.get("fingerprint") != fingerprint
    ):
        say(f"{str(partial)!r} holds an unfinished conversion with other inputs; starting over")
        remove_partial(partial, _DB_FILES)
        marker = None
    elif marker is None:
        # The marker is written before LMDB creates a file: no marker, nothing to keep.
        remove_partial(partial, _DB_FILES)

    if marker is None:
        used_seed = (
            (seed if seed is not None else random.SystemRandom().randrange(2**63))
            if shuffle
            else None
        )
        partial.mkdir(parents=True)
        marker = {
            "kind": _MARKER_KIND,
            "fingerprint": fingerprint,
            "seed": used_seed,
            "next_index": 0,
            "lines": len(entries),
            "skipped": [],
            "shape": None,
            "complete": False,
        }
        write_marker(partial, marker)
    else:
        used_seed = marker.get("seed")
    start = int(marker["next_index"])
    skipped = [SkippedImage(int(i), str(p), str(r)) for i, p, r in marker["skipped"]]
    expected_shape = tuple(marker["shape"]) if marker.get("shape") else None
    if start:
        say(f"resuming the conversion in {str(partial)!r} at line index {start}")

    order = list(range(len(entries)))
    if shuffle:
        random.Random(used_seed).shuffle(order)

    pending: list[tuple[bytes, bytes]] = []
    pending_bytes = 0
    writer: LmdbWriter | LevelDbWriter = (
        LevelDbWriter(partial) if backend == "leveldb" else LmdbWriter(partial, map_size=map_size)
    )
    with (
        writer,
        Progress(len(entries), "convert", quiet=quiet) as bar,
    ):
        bar.skip(start)

        def commit(next_index: int) -> None:
            nonlocal pending_bytes
            writer.put_many(pending)
            pending.clear()
            pending_bytes = 0
            marker["next_index"] = next_index
            marker["skipped"] = [[s.index, s.path, s.reason] for s in skipped]
            marker["shape"] = list(expected_shape) if expected_shape else None
            try:
                write_marker(partial, marker)
            except OSError as exc:
                full = disk_full(exc, partial, "the records committed before are kept")
                raise exc if full is None else full from exc

        def notice(message: str) -> None:
            bar.clear()
            say(message)

        try:
            for line_id in range(start, len(entries)):
                path_bytes, label = entries[order[line_id]]
                path = os.fsdecode(path_bytes)
                key = b"%08d_" % line_id + path_bytes
                enc = encoding
                if encoded and not enc:
                    dot = path.rfind(".")
                    enc = path[dot + 1 :].lower() if dot >= 0 else ""
                filename = _join_root(root_s, path) if path else ""
                try:
                    value, shape = _make_record(
                        filename,
                        label,
                        key=key,
                        is_color=is_color,
                        height=resize_height,
                        width=resize_width,
                        encoding=enc,
                    )
                except _Skip as why:
                    skipped.append(SkippedImage(line_id, path, str(why)))
                    shown = filename or "(blank line)"
                    notice(f"skipped {key.decode(errors='replace')!r}: {shown!r}: {why}")
                    bar.advance()
                    continue
                if check_size:
                    if expected_shape is None:
                        expected_shape = shape
                    elif shape != expected_shape:
                        raise DataError(
                            f"image {filename!r} has shape {shape}, the first one had "
                            f"{expected_shape} ({spell('check_size')}); resize them all "
                            f"({spell('resize_height', 'H', placeholder=True)} and "
                            f"{spell('resize_width', 'W', placeholder=True)}) or leave out "
                            f"{spell('check_size')}",
                            key=key,
                        )
                pending.append((key, value))
                pending_bytes += len(key) + len(value)
                if len(pending) >= commit_every or pending_bytes >= _CHUNK_BYTES:
                    commit(line_id + 1)
                bar.advance()
            commit(len(entries))
        except BaseException as exc:
            what = "interrupted" if isinstance(exc, KeyboardInterrupt) else "stopped"
            fix = "" if isinstance(exc, KeyboardInterrupt) else "fix the problem and "
            bar.stop()  # nothing is drawn after this message
            # What a rerun resumes from is the marker on disk, whenever the interruption
            # came (before, during or after its write): every line before its next index
            # is a record or one of its skipped lines.
            kept = read_marker(partial) or marker
            upto = int(kept["next_index"])
            say(
                f"{what}: {upto - len(kept['skipped'])} records (list lines up to {upto} of "
                f"{len(entries)}) are committed in {str(partial)!r}; {fix}rerun the same "
                f"command to resume at line {upto}"
            )
            raise
        records = writer.entries()
        if records:
            writer.sync()
            marker["complete"] = True
            write_marker(partial, marker)
    if not records:
        remove_partial(partial, _DB_FILES)
        raise DataError(_nothing_written(len(entries), skipped, root_s, list_path))
    promote(partial, out, force=force)
    (out / MARKER_NAME).unlink(missing_ok=True)
    return ConvertResult(
        path=out,
        records=records,
        lines=len(entries),
        skipped=tuple(skipped),
        resumed_at=start,
        seed=used_seed,
        loose_labels=loose.count,
    )


def _nothing_written(lines: int, skipped: list[SkippedImage], root: str, list_file: Path) -> str:
    """Why a conversion wrote no record, and what to check."""
    if not lines:
        return f"nothing to convert: the list file {str(list_file)!r} holds no lines"
    first = skipped[0]
    return (
        f"no record written: all {lines} list entries were skipped (the first, "
        f"{first.path or '(blank line)'!r}: {first.reason}); the list's paths are read "
        f"relative to the image root {root!r}: check that they name images there"
    )
