"""Helpers shared by test modules.

The one place tests write and read LMDBs with py-lmdb (independently of blobpipe's
reader): tiny databases of generated records, in-place edits, a direct read back.
Also the waits tests use instead of sleeping: :func:`wait_until` a condition holds
(bounded by a generous deadline), :func:`stays` true over a window, and a
:class:`GatedBackend` whose copies land when the test says so.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from itertools import islice
from pathlib import Path
from typing import Any

import anyio
import cv2
import lmdb
import numpy as np

import blobpipe
from blobpipe.testing import EmulatedBackend


def epochs(b: blobpipe.Batches, n: int) -> list[list[blobpipe.ArrayBatch]]:
    """``n`` epochs of ``b`` (``mode="epoch"``), each a list of its batches."""
    return [list(islice(iter(b), 10_000)) for _ in range(n)]


def run_script(code: str, *args: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter (from the repository root), so that a signal
    shows as a negative return code and a hang as a timeout, not as a dead test run."""
    root = Path(__file__).parent.parent
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True, text=True, timeout=timeout, check=False, cwd=root,
    )  # fmt: skip


# -- LMDBs -------------------------------------------------------------------------------------

MAP_SIZE = 1 << 28  # room for every test database; LMDB maps it lazily


@contextmanager
def open_lmdb(
    path: Path, *, map_size: int = MAP_SIZE, max_dbs: int = 0
) -> Iterator[lmdb.Environment]:
    """A writable py-lmdb environment at ``path`` (created if missing), closed on exit.

    For what :func:`write_lmdb` does not do: deletes, rewrites, several commits,
    named sub-databases (``max_dbs``).
    """
    env = lmdb.open(str(path), map_size=map_size, max_dbs=max_dbs)
    try:
        yield env
    finally:
        env.close()


def write_lmdb(
    path: Path,
    items: Iterable[tuple[bytes, bytes]],
    *,
    map_size: int = MAP_SIZE,
    commit_every: int | None = None,
) -> Path:
    """An LMDB at ``path`` holding ``items`` (key, value), added to what it holds.

    One transaction, or one per ``commit_every`` items (pages freed and reused).
    """
    with open_lmdb(path, map_size=map_size) as env:
        txn = env.begin(write=True)
        try:
            for n, (k, v) in enumerate(items, 1):
                txn.put(k, v)
                if commit_every is not None and n % commit_every == 0:
                    txn.commit()
                    txn = env.begin(write=True)
            txn.commit()
        except BaseException:
            txn.abort()
            raise
    return path


def dupsort_db(path: Path, items: Iterable[tuple[bytes, bytes]]) -> Path:
    """An LMDB at ``path`` whose main database holds ``items`` with sorted duplicates
    (``MDB_DUPSORT``), as LMDB's C API writes it (py-lmdb sets no flags on the main
    database): written to a named DUPSORT database, whose descriptor is then copied
    into both meta pages' main-database slot."""
    with open_lmdb(path, max_dbs=1) as env:
        sub = env.open_db(b"d", dupsort=True)
        with env.begin(write=True, db=sub) as txn:
            for k, v in items:
                txn.put(k, v)
        with env.begin() as txn:
            descriptor = bytes(txn.get(b"d"))  # the named database's MDB_db: 48 bytes
    data = bytearray((path / "data.mdb").read_bytes())
    psize = int.from_bytes(data[40:44], "little")
    for meta in (0, psize):
        data[meta + 88 : meta + 136] = descriptor  # mm_dbs[MAIN_DBI]
    (path / "data.mdb").write_bytes(data)
    return path


def lmdb_items(path: Path) -> list[tuple[bytes, bytes]]:
    """Every ``(key, value)`` of the LMDB at ``path`` in key order, read with py-lmdb directly."""
    env = lmdb.open(str(path), readonly=True, lock=False, create=False)
    try:
        with env.begin() as txn:
            return [(bytes(k), bytes(v)) for k, v in txn.cursor()]
    finally:
        env.close()


def lmdb_stat(path: Path) -> dict[str, int]:
    """py-lmdb's ``Environment.stat()`` of the LMDB at ``path`` (depth, entries, pages)."""
    env = lmdb.open(str(path), readonly=True, lock=False, create=False)
    try:
        return dict(env.stat())
    finally:
        env.close()


def image(i: int, shape: tuple[int, int, int] = (3, 6, 8)) -> np.ndarray:
    """Random uint8 pixels (C, H, W), the same for the same ``i``."""
    rng = np.random.default_rng(i)
    return rng.integers(0, 256, shape, dtype=np.uint8)


def key(i: int) -> bytes:
    """The key of record ``i`` in the databases below (Caffe's ``%08d`` prefix)."""
    return f"{i:08d}".encode()


def raw_db(path: Path, n: int, shape: tuple[int, int, int] = (3, 10, 12)) -> Path:
    """``n`` raw Datums: record i holds ``image(i, shape)`` and label ``i``."""
    return write_lmdb(
        path, ((key(i), blobpipe.encode_raw_datum(image(i, shape), i)) for i in range(n))
    )


def encoded_db(path: Path, n: int, ext: str, shape: tuple[int, int, int] = (3, 10, 12)) -> Path:
    """``n`` encoded Datums (``ext`` ".jpg" or ".png") of ``image(i, shape)`` as HWC."""

    def encode(i: int) -> bytes:
        hwc = np.ascontiguousarray(image(i, shape).transpose(1, 2, 0))
        ok, buf = cv2.imencode(ext, hwc)
        assert ok
        return blobpipe.encode_encoded_datum(buf.tobytes(), i)

    return write_lmdb(path, ((key(i), encode(i)) for i in range(n)))


def float_db(path: Path, n: int, shape: tuple[int, int, int] = (3, 5, 6)) -> Path:
    """``n`` float_data Datums of normal noise; record i has label ``i``."""

    def value(i: int) -> bytes:
        x = np.random.default_rng(i).normal(0, 10, shape).astype(np.float32)
        return blobpipe.encode_float_datum(x, i)

    return write_lmdb(path, ((key(i), value(i)) for i in range(n)))


def rows_written(monkeypatch: Any, module: Any) -> list[int]:
    """Wrap ``module.decode_rows`` (a compiled decoder's): the list it returns gets, per
    call, how many rows the call wrote."""
    written: list[int] = []
    real = module.decode_rows

    def spy(*args: Any) -> bytes:
        status: bytes = real(*args)
        written.append(sum(status))
        return status

    monkeypatch.setattr(module, "decode_rows", spy)
    return written


# -- waiting on conditions, not on the clock ---------------------------------------------------

DEADLINE = 30.0  # seconds: generous, so a loaded machine never trips it; only a hang does


async def wait_until(
    predicate: Callable[[], object], what: str = "the condition", *, within: float = DEADLINE
) -> None:
    """Return once ``predicate()`` is true; fail if it is still false after ``within`` s.

    Polls at every millisecond or so, yielding to the event loop in between, so a
    test waits exactly as long as the code under test needs, however loaded the machine.
    """
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within:g} s waiting for {what}")
        await anyio.sleep(0.001)


async def stays(predicate: Callable[[], object], what: str, *, window: float = 0.2) -> None:
    """Check that ``predicate()`` holds at every look over ``window`` seconds.

    For "nothing more happens" (a producer that must wait, a closed loader that must
    not start work): call it once the positive condition has been awaited with
    :func:`wait_until`. A correct program passes whatever the load; the window only
    bounds how long a wrong one gets to show itself.
    """
    deadline = time.monotonic() + window
    while True:
        assert predicate(), f"expected {what} to hold throughout, but it changed"
        if time.monotonic() > deadline:
            return
        await anyio.sleep(0.005)


class GatedBackend(EmulatedBackend):
    """An emulated device whose copies land only once the test opens :attr:`gate`.

    Instead of a ``delay`` that a loaded machine may outlast, a copy stays in
    flight for as long as the test needs: "still pending" is certain until
    ``gate.set()`` (or :meth:`open_after`). :attr:`held` is set once a copy has
    waited at the gate; :attr:`waiting` counts the copies waiting there now. A
    safety ``timeout`` opens the gate anyway and sets :attr:`timed_out`, so a
    test that never opens it (or an event loop blocked on a copy) fails, not hangs.
    """

    def __init__(self, timeout: float = DEADLINE) -> None:
        self.gate = threading.Event()
        self.held = threading.Event()
        self.waiting = 0
        self.timed_out = False
        self._timeout = timeout
        self._gate_lock = threading.Lock()
        super().__init__()

    @property  # type: ignore[override]
    def delay(self) -> float:
        """Read by a stream's thread before each copy: waits there while the gate is shut."""
        with self._gate_lock:
            self.waiting += 1
        self.held.set()
        if not self.gate.wait(self._timeout):
            self.timed_out = True
            self.gate.set()
        with self._gate_lock:
            self.waiting -= 1
        return 0.0

    @delay.setter
    def delay(self, value: float) -> None:
        pass  # EmulatedBackend.__init__ sets it; the gate replaces it

    def open_after(self, seconds: float) -> None:
        """Open the gate from another thread after ``seconds`` (while this one blocks on a copy).

        When it opens changes how long the test waits, never what it sees.
        """
        timer = threading.Timer(seconds, self.gate.set)
        timer.daemon = True
        timer.start()


def in_forked_child(fn: Callable[[], bool]) -> int:
    """Run ``fn`` in a forked child; return its exit status (0: it returned true)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            code = 0 if fn() else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


# -- consumer-side device work, queued late ------------------------------------------------------

_SPIN = r"""
extern "C" __global__ void blobpipe_spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""


def queue_late(backend: blobpipe.Backend, fn: Callable[[], object], seconds: float) -> None:
    """Queue ``fn`` (device work on ``backend.xp`` arrays, as a training step's
    kernels) on the caller's current stream, to run ``seconds`` late.

    On the emulated device it runs on the current stream's thread after
    ``seconds``; on CUDA it is launched at once behind a kernel that spins for
    ``seconds``. Anything that reads what ``fn`` writes, or overwrites what it
    reads, without being ordered after the current stream sees the difference.
    """
    if isinstance(backend, EmulatedBackend):
        backend.run_later(fn, seconds)
        return
    cp = backend.xp  # pragma: no cover - GPU machines
    with cp.cuda.Device(backend.device_id):  # pragma: no cover
        # kHz; 2 GHz where the attribute is missing (then it spins at least as long)
        rate_khz = cp.cuda.Device(backend.device_id).attributes.get("ClockRate") or 2_000_000
        kernel = cp.RawKernel(_SPIN, "blobpipe_spin")
        kernel((1,), (1,), (np.int64(seconds * rate_khz * 1000),))
        fn()


def unowned(backend: blobpipe.Backend, array: Any) -> Any:
    """An alias of device array ``array``'s memory that references nothing, as a
    queued CUDA kernel holds a raw pointer and no Python object: work that reads it
    late keeps neither the array nor what the array keeps alive (a batch's lease)."""
    import ctypes

    if isinstance(backend, EmulatedBackend):
        nbytes = int(array.nbytes)
        raw = (ctypes.c_char * nbytes).from_address(int(array.ctypes.data))
        alias = np.frombuffer(raw, dtype=array.dtype).reshape(array.shape)
        out = alias.view(type(array))
        out.device_id = array.device_id
        out.backend = array.backend
        return out
    cp = backend.xp  # pragma: no cover - GPU machines
    mem = cp.cuda.UnownedMemory(int(array.data.ptr), int(array.nbytes), None)  # pragma: no cover
    return cp.ndarray(  # pragma: no cover
        array.shape, array.dtype, memptr=cp.cuda.MemoryPointer(mem, 0), strides=array.strides
    )
