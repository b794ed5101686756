"""A Loader used the ways users write it: never entered, in an epoch loop, dropped,
wrapped in an async generator, carried into a forked child; its state through JSON."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import blobpipe
from blobpipe import Batches, Loader, StateError, get_pool
from blobpipe._backends import Backend, HostBackend
from tests._helpers import raw_db, write_lmdb
from tests.conftest import CAFFE


@pytest.fixture
def db30(tmp_path: Path) -> Path:
    """30 raw 3x10x12 records; record i has label i."""
    return raw_db(tmp_path / "db30", 30)


def fillers() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("blobpipe-filler")]


def used(backend: Backend) -> int:
    return get_pool(backend, "host").statistics().used_bytes


def labels(batches: Any) -> list[int]:
    return [int(v) for b in batches for v in b.label.cpu_data()]


def test_a_plain_for_opens_on_first_use_and_runs_every_epoch(db30: Path) -> None:
    backend = HostBackend()
    before = used(backend)
    loader = Loader(db30, 8, device=backend, mode="epoch")
    epochs = [labels(loader) for _ in range(3)]
    assert epochs == [list(range(30))] * 3
    assert fillers()  # it stays open between epochs
    loader.close()
    assert fillers() == []
    assert used(backend) == before
    with pytest.raises(StateError, match="this Loader is closed"):
        next(iter(loader))


def test_next_on_a_loader_never_entered(db30: Path) -> None:
    loader = Loader(db30, 8, device="cpu")
    assert [int(v) for v in next(loader).label.cpu_data()] == list(range(8))
    loader.close()


def test_garbage_collection_releases_an_open_loader(db30: Path) -> None:
    backend = HostBackend()
    before = used(backend)
    loader = Loader(db30, 8, device=backend, mode="wrap", workers=2)
    for _, _batch in zip(range(5), loader, strict=False):
        pass
    assert fillers()
    del loader, _batch
    gc.collect()
    deadline = time.monotonic() + 10
    while fillers() and time.monotonic() < deadline:  # they finish their batch first
        time.sleep(0.005)
    assert fillers() == []
    assert used(backend) == before


def test_from_prototxt_iterates_without_with(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(CAFFE)
    loader = Loader.from_prototxt("ref/raw_color_b8/net.prototxt", "TEST", device="cpu")
    batch = next(iter(loader))
    assert batch.data.shape == (8, 3, 32, 40)
    loader.close()


@pytest.mark.anyio
async def test_async_for_without_async_with(db30: Path) -> None:
    backend = HostBackend()
    before = used(backend)
    loader = Loader(db30, 8, device=backend, mode="epoch")
    for _ in range(2):
        got = [int(v) async for b in loader for v in b.label.cpu_data()]
        assert got == list(range(30))
    await loader.aclose()
    assert fillers() == []
    assert used(backend) == before


@pytest.mark.anyio
async def test_an_async_generator_left_with_break_is_clean(
    db30: Path, anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The usual wrapper: ``async with Loader`` inside an async generator, the consumer
    leaves with ``break``. Closed with ``aclosing`` (the README's form) or left to the
    event loop's finalizer (asyncio: a task; trio: its system nursery, with trio's own
    warning asking for ``aclosing``): no cancel-scope error, nothing left running."""
    backend = HostBackend()
    before = used(backend)
    unraisable: list[str] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(repr(u.exc_value)))

    async def stream() -> AsyncIterator[Any]:
        async with Loader(db30, 8, device=backend, mode="wrap") as loader:
            async for batch in loader:
                yield batch

    for _ in range(3):  # the form the README recommends
        async with contextlib.aclosing(stream()) as batches:
            async for batch in batches:
                assert batch.data.shape == (8, 3, 10, 12)
                break
        assert fillers() == []
    for _ in range(3):  # left to the finalizer
        async for batch in stream():
            assert batch.data.shape == (8, 3, 10, 12)
            break
    del batch  # the batch kept its memory while referenced
    await wait_until_async(lambda: not fillers() and used(backend) == before)
    if anyio_backend == "trio":  # trio's advice, nothing else
        assert unraisable and all("aclosing" in u for u in unraisable), unraisable
    else:
        assert unraisable == []


async def wait_until_async(condition: Any) -> None:
    with anyio.fail_after(10):
        while not condition():
            gc.collect()
            await anyio.sleep(0.01)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_an_open_loader_in_a_forked_child_says_what_to_do(db30: Path) -> None:
    loader = Loader(db30, 8, device="cpu", workers=2)
    next(iter(loader))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        message = b"no error"
        try:
            next(loader)
        except StateError as exc:
            message = str(exc).encode()
        except BaseException as exc:
            message = repr(exc).encode()
        loader.close()  # a no-op here, never a hang
        os.write(write, message)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        message = f.read().decode()
    _, status = os.waitpid(pid, 0)
    assert status == 0
    assert "forked child" in message and "Create and open the Loader in the child" in message
    assert int(next(loader).label.cpu_data()[0]) == 8  # the parent's loader carries on
    loader.close()


# -- resume state through JSON -----------------------------------------------------------------


@pytest.mark.parametrize("shard", [None, (1, 2)])
def test_state_dict_is_plain_json(db30: Path, shard: tuple[int, int] | None) -> None:
    with Loader(db30, 4, device="cpu", shuffle=True, seed=5, shard=shard) as loader:
        it = iter(loader)
        next(it)
        next(it)
        state = loader.state_dict()
        want = labels([next(it)])
    restored = json.loads(json.dumps(state))
    assert restored == state
    with Loader(db30, 4, device="cpu", shuffle=True, seed=5, shard=shard, state=restored) as again:
        assert labels([next(iter(again))]) == want


def test_states_with_bytes_keys_are_still_accepted(db30: Path) -> None:
    with Batches(db30, 4, order="shuffle", seed=2) as batches:
        it = iter(batches)
        next(it)
        state = batches.state_dict()
        want = next(it).label.tolist()
    old = {**state, "key": state["key"].encode(), "shard": tuple(state["shard"])}
    with Batches(db30, 4, order="shuffle", seed=2, state=old) as again:
        assert next(iter(again)).label.tolist() == want


def test_a_key_that_is_not_utf8_round_trips_through_json(tmp_path: Path) -> None:
    image = np.zeros((1, 2, 2), np.uint8)
    records = [(b"caf\xe9-%d" % i, blobpipe.encode_raw_datum(image, i)) for i in range(6)]
    db = write_lmdb(tmp_path / "db", records)
    with Batches(db, 2) as batches:
        next(iter(batches))
        state = json.loads(json.dumps(batches.state_dict()))
    with Batches(db, 2, state=state) as again:
        assert next(iter(again)).keys[0] == b"caf\xe9-2"


# -- every bad argument is a BlobpipeError (and the stdlib type) -----------------------------

BAD_ARGUMENTS: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    # (constructor, keywords, the stdlib type, the message)
    ("Loader", {"batch_size": 0}, ValueError, "batch_size must be a positive integer"),
    ("Batches", {"batch_size": 0}, ValueError, "batch_size must be a positive integer"),
    ("Loader", {"phase": "val"}, ValueError, "phase must be 'train' or 'test'"),
    ("Batches", {"phase": "val"}, ValueError, "phase must be 'train' or 'test'"),
    ("Loader", {"mode": "once"}, ValueError, "mode must be 'wrap' or 'epoch'"),
    ("Batches", {"last": "all"}, ValueError, "last must be"),
    ("Loader", {"shuffle": True, "order": "key"}, ValueError, "Loader: shuffle=True contradicts"),
    ("Loader", {"prefetch": 0}, ValueError, "Loader: prefetch must be"),
    ("Loader", {"workers": 0}, ValueError, "Loader: workers must be"),
    ("Loader", {"order": "random"}, ValueError, "order must be"),
    ("Batches", {"order": "buffer"}, ValueError, "needs buffer_size"),
    ("Batches", {"seed": -1}, ValueError, "seed must be"),
    ("Loader", {"shard": (2, 2)}, ValueError, "0 <= rank < world_size"),
    ("Loader", {"shard": "everyone"}, TypeError, "shard must be"),
    ("Loader", {"label_dtype": "int8"}, ValueError, "label_dtype must be"),
    ("Loader", {"device": "tpu"}, ValueError, "unknown device 'tpu'"),
    ("Loader", {"device": 3}, TypeError, "device must be a str or a Backend"),
    ("Loader", {"state": {"epoch": 0}}, ValueError, "malformed resume state"),
    ("Loader", {"shuffle": True, "seed": 9, "state": "SAVED"}, ValueError, "seed=1, but seed=9"),
    ("Loader", {"bogus": 1}, TypeError, "unexpected keyword argument 'bogus'"),
    ("Loader", {"record": "image"}, ValueError, "record must be"),
    ("Transform", {"crop_size": -1}, ValueError, "crop_size must be"),
    ("Transform", {"layout": "CHWN"}, ValueError, "layout must be"),
    ("Transform", {"mean_file": "MISSING"}, FileNotFoundError, "does not exist"),
    ("read_data_layer", {"path": "MISSING"}, FileNotFoundError, "prototxt does not exist"),
    ("read_data_layer", {"phase": "val"}, ValueError, "phase must be"),
    ("from_prototxt", {"path": "MISSING"}, FileNotFoundError, "prototxt does not exist"),
    ("get_backend", {"device": "cuda:x"}, ValueError, "bad device"),
]


def _construct(what: str, kwargs: dict[str, Any], db: Path, tmp_path: Path) -> None:
    kwargs = dict(kwargs)
    if kwargs.get("mean_file") == "MISSING" or kwargs.get("path") == "MISSING":
        kwargs.update({k: tmp_path / "missing" for k in ("mean_file", "path") if k in kwargs})
    if kwargs.get("state") == "SAVED":
        with Batches(db, 4, order="shuffle", seed=1) as saved:
            kwargs["state"] = saved.state_dict()
    prototxt = CAFFE / "ref/raw_color_b8/net.prototxt"
    if what == "Loader":
        size = kwargs.pop("batch_size", 4)
        kwargs.setdefault("device", "cpu")
        Loader(db, size, **kwargs).close()
    elif what == "Batches":
        Batches(db, kwargs.pop("batch_size", 4), **kwargs).close()
    elif what == "Transform":
        blobpipe.Transform(**kwargs)
    elif what == "read_data_layer":
        blobpipe.read_data_layer(kwargs.get("path", prototxt), kwargs.get("phase", "test"))
    elif what == "from_prototxt":
        Loader.from_prototxt(kwargs["path"], "test", device="cpu").close()
    else:
        blobpipe.get_backend(kwargs["device"])


@pytest.mark.parametrize(
    ("what", "kwargs", "stdlib", "message"),
    BAD_ARGUMENTS,
    ids=[f"{w}-{'-'.join(map(str, k))}" for w, k, _, _ in BAD_ARGUMENTS],
)
def test_every_bad_argument_is_a_blobpipe_error(
    db30: Path,
    tmp_path: Path,
    what: str,
    kwargs: dict[str, Any],
    stdlib: type[Exception],
    message: str,
) -> None:
    with pytest.raises(blobpipe.BlobpipeError, match=re.escape(message)) as info:
        _construct(what, kwargs, db30, tmp_path)
    assert isinstance(info.value, stdlib)
    assert "Batches" not in str(info.value) or what == "Batches"


def test_a_bad_blobpipe_device_variable_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import blobpipe._backends as backends

    monkeypatch.setenv("BLOBPIPE_DEVICE", "bogus")
    monkeypatch.setattr(backends, "_default", None)
    with pytest.raises(blobpipe.ArgumentError, match="BLOBPIPE_DEVICE='bogus'") as info:
        blobpipe.Blob((2, 3))
    assert isinstance(info.value, ValueError)


def test_read_data_layer_takes_caffes_phase_spelling() -> None:
    prototxt = CAFFE / "ref/raw_color_b8/net.prototxt"
    caffe, ours = (
        blobpipe.read_data_layer(prototxt, "TEST"),
        blobpipe.read_data_layer(prototxt, "test"),
    )
    assert (caffe.phase, caffe.source, caffe.batch_size) == ("test", ours.source, ours.batch_size)


# -- NumPy conversion --------------------------------------------------------------------------


def test_numpy_converts_a_host_batch_without_a_copy(db30: Path) -> None:
    with Loader(db30, 4, device="cpu") as loader:
        batch = next(iter(loader))
        view = batch.data.cpu_data()
        array = np.asarray(batch.data)
        assert array.shape == (4, 3, 10, 12) and array.dtype == np.float32
        assert np.shares_memory(array, view) and not array.flags.writeable
        assert np.array_equal(np.asarray(batch.label), [0, 1, 2, 3])
        copied = np.array(batch.data, copy=True)
        assert not np.shares_memory(copied, view) and np.array_equal(copied, view)
        assert np.asarray(batch.data, dtype=np.float64).dtype == np.float64
        with pytest.raises(ValueError, match="a copy is needed"):
            np.asarray(batch.data, dtype=np.float64, copy=False)
        assert np.shares_memory(np.asarray(batch.data, copy=False), view)


def test_numpy_refuses_a_device_blob_and_names_cpu_data() -> None:
    from blobpipe.testing import EmulatedBackend

    blob = blobpipe.Blob((2, 3), backend=EmulatedBackend())
    with pytest.raises(blobpipe.UnsupportedOperationError, match=r"blob\.cpu_data\(\)"):
        np.asarray(blob)
    assert np.asarray(blob.cpu_data()).shape == (2, 3)
    blob.close()
