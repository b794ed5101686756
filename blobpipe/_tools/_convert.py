"""``convert_imageset``: images + a Caffe list file → an LMDB of Datums, as Caffe writes it.

Caffe's semantics (``tools/convert_imageset.cpp``, ``util/io.cpp``), kept exactly:

* a list line is ``path label``, split at the LAST space, the label read as
  C's ``atoi`` reads it (``1_000`` is 1); the key is
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
instead of label 0.
"""

from __future__ import annotations

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

from .._errors import DataError
from .._io._encode import encode_encoded_datum, encode_raw_datum
from .._io._image import DEFAULT_MAX_PIXELS
from .._io._imagehead import image_size
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


def read_list_file(list_file: str | os.PathLike[str]) -> list[tuple[bytes, int]]:
    """Parse a Caffe list file into ``(path bytes, label)`` pairs, one per line.

    Lines split at the last space (paths may contain spaces); the label is read
    as Caffe's ``atoi`` reads it (leading white space and a sign, then digits; what
    follows them is ignored: ``1_000`` is 1, ``7abc`` is 7). A blank line keeps its
    index with an empty path (Caffe skips it as unreadable).
    Raises :class:`DataError` (with the line number) for a line whose label holds no
    digits (Caffe's atoi gives 0) or does not fit int32, or whose path is too long
    for an LMDB key, and :class:`FileNotFoundError` when the file is missing.
    """
    path = Path(list_file)
    try:
        raw = path.read_bytes()
    except FileNotFoundError as exc:
        raise DataError(f"list file {str(path)!r} not found", path=None) from exc
    pieces = raw.split(b"\n")
    if pieces and pieces[-1] == b"":
        pieces.pop()
    entries: list[tuple[bytes, int]] = []
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
        entries.append((line[:pos], label))
    return entries


def _match_ext(filename: str, encoding: str) -> bool:
    dot = filename.rfind(".")
    ext = (filename[dot + 1 :] if dot >= 0 else filename).lower()
    enc = encoding.lower()
    return ext == enc or (enc == "jpg" and ext == "jpeg")


def _read_image(filename: str, is_color: bool) -> np.ndarray[Any, Any] | None:
    """The image as Caffe's ``cv::imread`` reads it: the file's bytes read here (by
    their bytes path, so any name the file system holds works, as in Caffe) and
    decoded from memory by OpenCV, once its header has been checked.

    Raises:
        _Skip: the file cannot be read, or announces more than ``DEFAULT_MAX_PIXELS``.
    """
    try:
        with open(os.fsencode(filename), "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise _Skip(f"cannot read file: {exc.strerror}") from None
    size = image_size(data)
    if isinstance(size, str):
        return None  # no decoder OpenCV has takes it (or its header is cut short)
    if size.width * size.height > DEFAULT_MAX_PIXELS:
        raise _Skip(
            f"it announces {size.width}×{size.height} pixels, more than {DEFAULT_MAX_PIXELS} "
            "(the pixel limit blobpipe decodes); resize it first"
        )
    import cv2

    flag = cv2.IMREAD_COLOR if is_color else cv2.IMREAD_GRAYSCALE
    try:
        img = cv2.imdecode(np.frombuffer(data, np.uint8), flag)
    except cv2.error:
        return None
    return None if img is None else np.asarray(img)


def _resize(img: np.ndarray[Any, Any], height: int, width: int) -> np.ndarray[Any, Any]:
    import cv2

    return np.asarray(cv2.resize(img, (width, height)))


def _imencode(img: np.ndarray[Any, Any], encoding: str) -> bytes | None:
    import cv2

    try:
        ok, buf = cv2.imencode("." + encoding, img)
    except cv2.error:
        return None
    return bytes(buf) if ok else None


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
    if img is None:
        raise _Skip("OpenCV cannot decode it")
    if height > 0 and width > 0:
        img = _resize(img, height, width)
    chw = img[None] if img.ndim == 2 else img.transpose(2, 0, 1)
    shape = (int(chw.shape[0]), int(chw.shape[1]), int(chw.shape[2]))
    if encoding:
        if not height and not width and _match_ext(filename, encoding):
            try:
                with open(filename, "rb") as fh:
                    return encode_encoded_datum(fh.read(), label), shape
            except OSError as exc:
                raise _Skip(f"cannot read file: {exc}") from None
        encoded = _imencode(img, encoding)
        if encoded is None:
            raise DataError(
                f"OpenCV cannot encode {filename!r} as {encoding!r}; pass --encode-type jpg or png",
                key=key,
            )
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

    Raises :class:`OutputExistsError` when ``db`` exists and ``force`` is false,
    :class:`DataError` for a missing root or list file, a malformed list line,
    an image that cannot be encoded, or (``check_size``) a size mismatch, and
    :class:`ValueError` for bad options. Unreadable images are skipped and
    reported, like Caffe.
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
        raise DataError(f"image root {root_s!r} is not a directory")
    list_path = Path(list_file)
    try:
        list_bytes = list_path.read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read list file {str(list_path)!r}: {exc.strerror}") from exc
    entries = read_list_file(list_path)
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
        committed = writer.entries()  # the records the marker accounts for

        def commit(next_index: int) -> None:
            nonlocal pending_bytes, committed
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
            committed = writer.entries()

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
                            f"{expected_shape} (check_size); resize with --resize-height/"
                            "--resize-width or drop --check-size",
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
            # what the marker records is what a rerun resumes from
            say(
                f"{what}: {committed} records (list lines up to {marker['next_index']} of "
                f"{len(entries)}) are committed in {str(partial)!r}; {fix}rerun the same "
                f"command to resume at line {marker['next_index']}"
            )
            raise
        records = writer.entries()
        writer.sync()
        marker["complete"] = True
        write_marker(partial, marker)
    promote(partial, out, force=force)
    (out / MARKER_NAME).unlink(missing_ok=True)
    return ConvertResult(
        path=out,
        records=records,
        lines=len(entries),
        skipped=tuple(skipped),
        resumed_at=start,
        seed=used_seed,
    )
