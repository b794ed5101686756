"""Fault injection: one epoch over copies of a database with a byte flipped, in a worker process.

``python -m tests._faults MODE BASE WORK`` reads flips from stdin, one a line
(``number offset mask``), and for each writes a copy of ``BASE`` (an LMDB data
file) into a fresh directory under ``WORK`` with ``byte[offset] ^= mask``,
reads it, and prints one line, flushed, before it starts the next flip:

* ``number data DIGEST``: the epoch's records (key, label, centre-cropped pixels)
  hashed, the same way in both modes;
* ``number error KIND MESSAGE``: the read failed; KIND is ``clean`` for a
  :class:`blobpipe.BlobpipeError` whose message names the copy, else the type.

MODE ``lmdb`` is the reference: py-lmdb's own cursor, each value parsed by the
generated ``caffe_pb2`` (a value that is no valid raw Datum of at least the crop
size is an error). MODE ``blobpipe`` runs :class:`blobpipe.Batches` (centre
crop, uint8 output, int64 labels, ``mode="epoch"``). A flip that kills the worker
(a signal) or hangs it shows as a missing line: the caller sees which flip did it.
"""

from __future__ import annotations

import hashlib
import os
import selectors
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

CROP = 8
BATCH = 16


def _digest(records: list[tuple[bytes, int, np.ndarray]]) -> str:
    h = hashlib.sha256()
    for key, label, pixels in records:
        h.update(len(key).to_bytes(4, "little") + key)
        h.update(int(label).to_bytes(8, "little", signed=True))
        h.update(np.ascontiguousarray(pixels, np.uint8).tobytes())
    return h.hexdigest()


def _centre(chw: np.ndarray) -> np.ndarray:
    _, h, w = chw.shape
    top, left = (h - CROP) // 2, (w - CROP) // 2
    return chw[:, top : top + CROP, left : left + CROP]


def read_with_lmdb(path: Path) -> str:
    """The digest of the epoch py-lmdb's cursor gives (raises on a bad record)."""
    import lmdb

    from blobpipe._proto.caffe_pb2 import Datum

    records = []
    env = lmdb.open(str(path), readonly=True, lock=False, create=False, max_dbs=0)
    try:
        with env.begin() as txn:
            for key, value in txn.cursor():
                d = Datum.FromString(value)
                shape = (d.channels, d.height, d.width)
                if d.encoded or d.channels != 3 or min(d.height, d.width) < CROP:
                    raise ValueError(f"not a raw 3-channel Datum: {shape}")
                pixels = np.frombuffer(d.data, np.uint8)
                if pixels.size != d.channels * d.height * d.width:
                    raise ValueError("data size differs from the shape")
                records.append((bytes(key), d.label, _centre(pixels.reshape(shape))))
    finally:
        env.close()
    if not records:
        raise ValueError("no records")
    return _digest(records)


def read_with_blobpipe(path: Path) -> str:
    """The digest of one epoch of :class:`blobpipe.Batches` over ``path``."""
    import blobpipe

    transform = blobpipe.Transform(crop_size=CROP, dtype="uint8")
    records = []
    with blobpipe.Batches(
        path, BATCH, transform=transform, phase="test", mode="epoch", label_dtype="int64"
    ) as batches:
        for batch in batches:
            for r in range(batch.valid):
                records.append((batch.keys[r], int(batch.label[r]), batch.data[r]))
    return _digest(records)


Flip = tuple[int, int, int]  # (number, offset, xor mask)


def run_flips(
    mode: str, base: Path, work: Path, flips: Sequence[Flip], *, per_flip: float = 20.0
) -> dict[int, str]:
    """Each flip's outcome line (without its number) in ``mode``, from as few workers as
    possible: a worker that dies or hangs (no line for ``per_flip`` seconds, which
    includes its start) is replaced, the flip it was on re-run alone (``signal N``,
    ``exit N`` or ``hang`` when it does so again), and the rest go to a new worker."""
    outcomes: dict[int, str] = {}
    todo = list(flips)
    while todo:
        got = _worker(mode, base, work, todo, per_flip)
        got.pop(-1, None)
        outcomes.update(got)
        rest = [f for f in todo if f[0] not in got]
        if not rest:
            break
        first, todo = rest[0], rest[1:]
        alone = _worker(mode, base, work, [first], per_flip)
        outcomes[first[0]] = alone.get(first[0], alone.get(-1, "hang"))
    return outcomes


def _worker(
    mode: str, base: Path, work: Path, flips: Sequence[Flip], per_flip: float
) -> dict[int, str]:
    """The lines one worker printed; key -1: how it ended, when it did not end well
    (``signal N``, ``exit N``, or ``hang``: no line for ``per_flip`` seconds)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests._faults", mode, str(base), str(work)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        cwd=Path(__file__).resolve().parent.parent,  # -m finds tests/ and blobpipe/ there
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("".join(f"{n} {o} {m}\n" for n, o, m in flips).encode())
    proc.stdin.close()
    got: dict[int, str] = {}
    pending = b""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            if not sel.select(per_flip):
                proc.kill()
                got[-1] = "hang"
                break
            chunk = os.read(proc.stdout.fileno(), 1 << 16)
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                number, _, result = line.decode().partition(" ")
                got[int(number)] = result
    code = proc.wait()
    proc.stdout.close()
    if -1 not in got and code:
        got[-1] = f"signal {-code}" if code < 0 else f"exit {code}"
    for n, _, _ in flips:  # the copy a killed worker left
        shutil.rmtree(work / f"{mode}-{n}", ignore_errors=True)
    return got


def main(argv: list[str]) -> int:
    mode, base, work = argv[1], Path(argv[2]), Path(argv[3])
    import blobpipe

    read = read_with_lmdb if mode == "lmdb" else read_with_blobpipe
    whole = base.read_bytes()
    for line in sys.stdin:
        number, offset, mask = (int(x) for x in line.split())
        db = work / f"{mode}-{number}"
        db.mkdir(parents=True)
        flipped = bytearray(whole)
        flipped[offset] ^= mask
        (db / "data.mdb").write_bytes(flipped)
        try:
            result = "data " + read(db)
        except blobpipe.BlobpipeError as exc:
            text = str(exc).replace("\n", " ")
            kind = "clean" if str(db) in text else type(exc).__name__
            result = f"error {kind} {text}"
        except Exception as exc:
            text = str(exc).replace("\n", " ")
            result = f"error {type(exc).__name__} {text}"
        shutil.rmtree(db)
        sys.stdout.write(f"{number} {result}\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
