"""The Loader's options (Batches' declared once, in one record) and its one lifecycle
state."""

from __future__ import annotations

import dataclasses
import inspect
import pydoc
import typing
from pathlib import Path

import pytest

from blobpipe import Batches, Loader, StateError
from blobpipe._io._options import BatchesKeywords, BatchesOptions, PassThroughKeywords
from blobpipe._loader._lifecycle import Lifecycle, State
from blobpipe._loader._options import LOADER_DECIDES
from tests._helpers import raw_db

# The Loader's keywords and defaults (pad_shards: equal shards by default, since
# unequal ones leave distributed training waiting on the longer shards).
LOADER_SIGNATURE = {
    "source": inspect.Parameter.empty,
    "batch_size": 64,
    "device": "auto",
    "prefetch": 4,
    "transform": None,
    "phase": "train",
    "order": None,
    "shuffle": False,
    "buffer_size": None,
    "seed": 0,
    "shard": None,
    "shard_mode": "strided",
    "pad_shards": True,
    "mode": "wrap",
    "last": "keep",
    "workers": None,
    "device_transform": None,
    "stream": None,
    "state": None,
    "readahead": False,
    "label_dtype": "float32",
    "record": "auto",
    "blob_dtype": "float32",
    "share_random": False,
    "max_batch_bytes": 4 << 30,
    "ranks_per_node": None,
}


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return raw_db(tmp_path / "db", 8)


def test_signature_is_unchanged() -> None:
    params = inspect.signature(Loader).parameters
    assert {name: p.default for name, p in params.items()} == LOADER_SIGNATURE


def test_every_batches_option_is_a_loader_option() -> None:
    """An option added to the record is a keyword of Batches and of the Loader (but
    what the Loader decides itself), typed alike for static checkers."""
    record = {f.name for f in dataclasses.fields(BatchesOptions)} - {"batch_size"}
    batches = inspect.signature(Batches).parameters
    assert {n for n, p in batches.items() if p.kind is p.KEYWORD_ONLY} == record
    loader = inspect.signature(Loader).parameters
    assert record - LOADER_DECIDES <= set(loader)
    assert set(PassThroughKeywords.__annotations__) == record - LOADER_DECIDES
    hints = typing.get_type_hints(BatchesOptions)
    for typed in (BatchesKeywords, PassThroughKeywords):
        for name, hint in typing.get_type_hints(typed).items():
            assert hint == hints[name], name
    assert set(typing.get_type_hints(BatchesKeywords)) == record
    for name in record - LOADER_DECIDES:
        field = BatchesOptions.__dataclass_fields__[name]
        assert loader[name].default == batches[name].default == field.default, name


def _text(doc: str) -> str:
    """``doc``'s words, one space apart (without the bars pydoc draws in a class)."""
    lines = (line.strip().removeprefix("|") for line in doc.splitlines())
    return " ".join(" ".join(lines).split())


@pytest.mark.parametrize(("owner", "own"), [(Loader, LOADER_DECIDES), (Batches, frozenset())])
def test_help_describes_every_option_in_the_records_words(owner: type, own: frozenset[str]) -> None:
    """help() shows each keyword option with the record's own description, and names
    every other parameter in its Args."""
    shown = _text(pydoc.render_doc(owner, renderer=pydoc.plaintext))
    for field in dataclasses.fields(BatchesOptions):
        if field.name in own or field.name == "batch_size":
            continue
        assert f"{field.name}: {_text(field.metadata['doc'])}" in shown, field.name
    for name in inspect.signature(owner).parameters:
        assert f"{name}: " in shown, name


def test_the_options_record_is_frozen_and_checks_every_value() -> None:
    options = BatchesOptions(batch_size=4, phase="TEST", shard=None)
    assert options.phase == "test" and options.rank_world == (0, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.seed = 3  # type: ignore[misc]
    with pytest.raises(ValueError, match="seed must be a non-negative integer, got -1"):
        dataclasses.replace(options, seed=-1)
    with pytest.raises(ValueError, match="mode must be 'wrap' or 'epoch', got 'loop'"):
        BatchesOptions(batch_size=4, mode="loop")  # type: ignore[arg-type]


def test_an_unknown_keyword_is_a_type_error(db: Path) -> None:
    with pytest.raises(
        TypeError, match=r"Loader.__init__\(\) got an unexpected keyword argument 'sed'"
    ):
        Loader(db, 4, device="cpu", sed=1)  # type: ignore[call-arg]


def test_options_reach_batches(db: Path) -> None:
    loader = Loader(db, 3, device="cpu", mode="epoch", last="drop")
    assert len(loader) == 2  # 8 records, last partial batch dropped
    loader.close()


@pytest.mark.anyio
async def test_repr_shows_the_state(db: Path) -> None:
    loader = Loader(db, 4, device="cpu")
    assert repr(loader).endswith(" unopened>")
    async with loader:
        assert repr(loader).endswith(" open>")
    assert repr(loader).endswith(" closed>")


@pytest.mark.parametrize(
    ("path", "refused"),
    [
        ([State.OPEN, State.FAILING, State.FAILED, State.CLOSED], State.OPEN),
        ([State.OPEN, State.CLOSED], State.FAILING),  # a filler failing after close
        ([State.CLOSED], State.OPEN),
        ([State.OPEN, State.FAILING], State.UNOPENED),
    ],
)
def test_the_state_only_moves_forward(path: list[State], refused: State) -> None:
    life = Lifecycle()
    for state in path:
        assert life.move(state) is not None
    assert life.move(refused) is None
    assert life.state is path[-1]


def test_open_twice_and_iterating_in_each_state() -> None:
    life = Lifecycle()
    with pytest.raises(StateError, match="this Loader is not open"):
        life.check_next()  # the Loader opens the pipeline before it asks for a batch
    life.open()
    life.check_next()
    with pytest.raises(StateError, match="this Loader is open; a Loader can be opened once"):
        life.open()
    with pytest.raises(StateError, match="this Loader is open; create a new one"):
        life.check_enter()
    life.move(State.FAILING)
    life.check_next()  # the batches before the failure are still delivered
    error = RuntimeError("boom")
    life.fail(error)
    with pytest.raises(StateError, match=r"stopped after an error: RuntimeError\('boom'\)") as info:
        life.check_next()
    assert info.value.__cause__ is error
    life.move(State.CLOSED)
    with pytest.raises(StateError, match="this Loader is closed; create a new one to iterate"):
        life.check_next()


def test_the_transform_split_is_a_value_batches_keep(db: Path) -> None:
    """``split_transform=True``: the Batches fill with the host half (crop and mirror
    into uint8) and keep the whole transform; the options, split included, pickle
    with the Batches and reopen alike."""
    import pickle

    import numpy as np

    from blobpipe import Transform

    whole = Transform(mean_value=(1, 2, 3), scale=0.5, crop_size=4, mirror=True)
    with Batches(db, 2, transform=whole, split_transform=True) as batches:
        assert batches.split_from is whole
        assert batches.transform.dtype == np.uint8
        assert (batches.transform.crop_size, batches.transform.mirror) == (4, True)
        again = pickle.loads(pickle.dumps(batches))
        with again:
            assert again.split_from is not None and again.transform.dtype == np.uint8
            assert np.array_equal(next(iter(again)).data, next(iter(batches)).data)
    # uint8 output: nothing for a device to finish
    with Batches(db, 2, transform=Transform(dtype="uint8"), split_transform=True) as batches:
        assert batches.split_from is None
