"""The Loader's options (Batches' defined once) and its one lifecycle state."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from blobpipe import Batches, Loader, StateError
from blobpipe._loader._lifecycle import Lifecycle, State
from blobpipe._loader._options import BatchesOptions
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
    """A keyword added to Batches must be added to BatchesOptions (and only there)."""
    batches = inspect.signature(Batches).parameters
    keywords = {name for name, p in batches.items() if p.kind is p.KEYWORD_ONLY}
    # order and split_transform are the Loader's own (it splits its transform itself)
    assert set(BatchesOptions.__annotations__) == keywords - {"order", "split_transform"}


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
