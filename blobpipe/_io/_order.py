"""The order of records in each epoch, and which of them a shard reads.

The database's keys are numbered ``0..n-1`` in key (byte) order: a record's
*global index*. Each epoch has a global order — key order (``order="key"``,
Caffe), a permutation seeded by ``(seed, epoch)`` (``order="shuffle"``), a
shuffle buffer of ``buffer_size`` records run over key order with the same seed
(``order="buffer"``), or the quasi-random order (``order="quasi"``,
:func:`quasi_order`: runs of consecutive records shuffled within windows of
``buffer_size``, for databases larger than memory) — which is then sharded:
``shard_mode="strided"`` gives rank ``r`` the positions ``r, r + world, ...``
(PyTorch's DistributedSampler), ``"contiguous"`` splits it into ``world`` runs
whose lengths differ by at most one. Every rank computes the same global order,
so shards are disjoint and together cover every record (``pad_shards``: every
rank reads ``ceil(n / world)``, the order wrapping around, as DistributedSampler
pads).

``shard_mode="node"`` (:func:`node_parts`, :func:`node_shard`) keeps each node's
part of the records the same in every epoch, so a node's page cache holds only
its part: the records are split once (seeded by ``seed`` alone) between the
``world / ranks_per_node`` nodes, and each epoch orders a node's part (the
epoch's order kind over the part, seeded by ``(seed, epoch, node)``) and splits
it between the node's ranks, strided. Rank ``r`` is local rank
``r % ranks_per_node`` of node ``r // ranks_per_node`` (torchrun numbers ranks
so). Padding as above: with ``pad_shards`` every rank of every node reads
``ceil(n / world)`` records (``"drop"``: ``floor(n / world)``), its node's order
wrapping around; with ``pad_shards=True`` and more nodes than records, node ``k``
past the records (its part empty) reads node ``k % n``'s part, as a strided rank
past the records wraps around to the epoch's start. Only a rank's own node's part
is ever made: the work is bounded by the records, whatever the node count.

A rank and a world size are integers (``operator.index``: Python's and NumPy's,
not bool) with ``0 <= rank < world <= MAX_WORLD``, checked before anything is
sized by them.
"""

from __future__ import annotations

import operator
import os
import sys
from typing import Any, Literal, cast

import numpy as np
import numpy.typing as npt

from .._errors import ArgumentError, ArgumentTypeError
from ._kernels import draw_words

__all__ = [
    "MAX_WORLD",
    "EpochOrder",
    "Order",
    "ShardMode",
    "buffer_order",
    "node_part",
    "node_parts",
    "node_shard",
    "quasi_order",
    "ranks_per_node_from",
    "shard_from",
]

Order = Literal["key", "shuffle", "buffer", "quasi"]
ShardMode = Literal["strided", "contiguous", "node"]

# The quasi-random order's window holds this many runs of consecutive records.
QUASI_RUNS = 32
# Node parts are made of blocks of this many consecutive records (near in the file).
NODE_BLOCK = 64
# The largest world size: torch.distributed numbers ranks with a C int.
MAX_WORLD = 2**31 - 1


def quasi_order(n: int, window: int, rng: np.random.Generator) -> npt.NDArray[np.int64]:
    """A permutation of ``0..n-1`` that reads at most ``window`` records' worth of the
    file at a time: key order cut into runs of ``max(1, window // QUASI_RUNS)``
    consecutive records, the runs permuted, and each ``QUASI_RUNS`` runs in a row of
    that permutation (a window) shuffled together. (FFCV's quasi-random order does
    the same with pages of its file.)"""
    run = max(1, window // QUASI_RUNS)
    runs = -(-n // run)
    perm = rng.permutation(runs).astype(np.int64)
    starts = perm * run
    sizes = np.minimum(starts + run, n) - starts
    # the records of the permuted runs, in that order
    owner = np.repeat(np.arange(runs, dtype=np.int64), sizes)
    first = np.cumsum(sizes) - sizes
    records = starts[owner] + (np.arange(n, dtype=np.int64) - first[owner])
    block = owner // QUASI_RUNS  # the window of each record
    noise = rng.random(n)
    out: npt.NDArray[np.int64] = records[np.lexsort((noise, block))]
    return out


def node_parts(n: int, nodes: int, seed: int) -> list[npt.NDArray[np.int64]]:
    """Each node's records (global indices, sorted), the same in every epoch: blocks
    of :data:`NODE_BLOCK` consecutive records permuted (seeded by ``seed``), their
    records cut into ``nodes`` stretches whose lengths differ by at most one. (All
    ``nodes`` of them: for tests and tools; a rank makes only its own, :func:`node_part`.)"""
    return [node_part(n, nodes, seed, k) for k in range(nodes)]


def node_part(n: int, nodes: int, seed: int, node: int) -> npt.NDArray[np.int64]:
    """Node ``node``'s records of :func:`node_parts`, made alone (work bounded by ``n``)."""
    rng = _rng([seed, 0x6E6F6465])
    blocks = -(-n // NODE_BLOCK)
    starts = rng.permutation(blocks).astype(np.int64) * NODE_BLOCK
    sizes = np.minimum(starts + NODE_BLOCK, n) - starts
    owner = np.repeat(np.arange(blocks, dtype=np.int64), sizes)
    first = np.cumsum(sizes) - sizes
    records = starts[owner] + (np.arange(n, dtype=np.int64) - first[owner])
    base, extra = divmod(n, nodes)
    at = node * base + min(node, extra)
    return np.sort(records[at : at + base + (1 if node < extra else 0)])


def node_shard(
    n: int, order: Order, buffer_size: int | None, seed: int, epoch: int, rank: int,
    world: int, ranks_per_node: int, pad_shards: bool | Literal["drop"],
) -> npt.NDArray[np.int64]:  # fmt: skip
    """The global indices rank ``rank`` reads in ``epoch`` with ``shard_mode="node"``
    (see the module docstring), in order."""
    nodes = world // ranks_per_node
    node, local = divmod(rank, ranks_per_node)
    padded = bool(pad_shards) and world > 1
    # a node past the records has an empty part; padded (not dropped), it reads another's
    source = node % n if padded and pad_shards is True and node >= n else node
    part = node_part(n, nodes, seed, source)
    m = len(part)
    ordered = part[_global_order(m, order, buffer_size, [seed, epoch, node])]
    if padded:
        per = n // world if pad_shards == "drop" else -(-n // world)
        if m == 0 or per == 0:
            return np.zeros(0, np.int64)
        positions = (local + ranks_per_node * np.arange(per, dtype=np.int64)) % m
        return ordered[positions]
    return ordered[local::ranks_per_node]


def _integer(value: object, what: str) -> int:
    """``value`` as an int (Python's or NumPy's integers; not bool, not a float that
    happens to be whole).

    Raises:
        TypeError: ``value`` is of another type.
    """
    if isinstance(value, bool):
        raise ArgumentTypeError(f"{what} must be an integer, got {value!r} (a bool)")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ArgumentTypeError(
            f"{what} must be an integer, got {value!r} ({type(value).__name__})"
        ) from None


def ranks_per_node_from(ranks_per_node: int | None, world: int) -> int:
    """The ranks of one node: ``ranks_per_node``, else torchrun's ``LOCAL_WORLD_SIZE``.

    Raises:
        ValueError: neither given, not a positive divisor of ``world``.
        TypeError: ``ranks_per_node`` is not an integer.
    """
    if ranks_per_node is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if env is None:
            raise ArgumentError(
                "shard_mode='node' needs the ranks per node: pass ranks_per_node=..., or "
                "run under torchrun (which sets LOCAL_WORLD_SIZE)"
            )
        try:
            ranks_per_node = int(env)
        except ValueError:
            raise ArgumentError(
                f"LOCAL_WORLD_SIZE must be an integer, got {env!r}; torchrun sets it to "
                "the ranks of this node, or pass ranks_per_node=..."
            ) from None
    per_node = _integer(ranks_per_node, "ranks_per_node")
    if not 1 <= per_node <= world or world % per_node:
        raise ArgumentError(
            f"ranks_per_node must divide the world size {world} (every node runs as "
            f"many ranks), got {per_node}"
        )
    return per_node


def _rng(entropy: list[int]) -> np.random.Generator:
    return np.random.Generator(np.random.Philox(np.random.SeedSequence(entropy)))


def _global_order(
    n: int, order: Order, buffer_size: int | None, entropy: list[int]
) -> npt.NDArray[np.int64]:
    """One epoch's order of ``0..n-1`` of kind ``order``, drawn from the generator
    seeded by ``entropy`` (made only for an order that draws: ``numpy.random``,
    some milliseconds to import, is not needed for key order)."""
    if order == "key":
        return np.arange(n, dtype=np.int64)
    rng = _rng(entropy)
    if order == "shuffle":
        return rng.permutation(n).astype(np.int64)
    if order == "quasi":
        return quasi_order(n, cast(int, buffer_size), rng)
    return buffer_order(n, cast(int, buffer_size), rng)


def shard_from(shard: tuple[int, int] | Literal["auto"] | None) -> tuple[int, int]:
    """``(rank, world_size)`` of a ``shard`` argument.

    "auto": an initialised ``torch.distributed`` process group's (``mp.spawn`` with
    ``init_process_group``, or torchrun), else torchrun's ``RANK``/``WORLD_SIZE``
    environment variables, else no sharding.

    Raises:
        ValueError: a world size outside ``[1, MAX_WORLD]``, a rank outside
            ``[0, world_size)``, or only one of ``RANK`` and ``WORLD_SIZE`` set (or
            not integers).
        TypeError: ``shard`` of another type, or a rank or world size that is not
            an integer.
    """
    if shard is None:
        return (0, 1)
    if shard == "auto":
        group = _torch_process_group()
        if group is not None:
            shard = group
        else:
            rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
            if rank is None and world is None:
                return (0, 1)
            try:
                shard = (int(rank), int(world))  # type: ignore[arg-type]
            except (TypeError, ValueError):
                raise ArgumentError(
                    f"shard='auto' needs both RANK and WORLD_SIZE as integers (torchrun sets "
                    f"them), got RANK={rank!r} WORLD_SIZE={world!r}; set both, or pass "
                    "shard=(rank, world_size)"
                ) from None
    if not (isinstance(shard, tuple) and len(shard) == 2):
        raise ArgumentTypeError(f"shard must be None, 'auto' or (rank, world_size), got {shard!r}")
    rank_i = _integer(shard[0], "shard's rank")
    world_i = _integer(shard[1], "shard's world_size")
    if not 1 <= world_i <= MAX_WORLD:
        raise ArgumentError(
            f"shard's world_size must be between 1 and 2**31 - 1 (torch.distributed's "
            f"ranks are C ints), got {world_i}"
        )
    if not 0 <= rank_i < world_i:
        raise ArgumentError(
            f"shard (rank, world_size) must have 0 <= rank < world_size, got {(rank_i, world_i)}"
        )
    return (rank_i, world_i)


def _torch_process_group() -> tuple[int, int] | None:
    """The default process group's ``(rank, world_size)`` if the program initialised one
    (torch is never imported here: only a program that uses it has it loaded)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    try:
        if dist.is_available() and dist.is_initialized():
            return (int(dist.get_rank()), int(dist.get_world_size()))
    except Exception:  # a torch build without distributed support, say
        return None
    return None


def buffer_order(n: int, size: int, rng: np.random.Generator) -> npt.NDArray[np.int64]:
    """Key order passed through a shuffle buffer of ``size`` records."""
    picks = rng.integers(0, 1 << 62, size=n).tolist()
    buf = list(range(min(size, n)))
    nxt = len(buf)
    out = np.empty(n, dtype=np.int64)
    for i in range(n):
        j = picks[i] % len(buf)
        out[i] = buf[j]
        if nxt < n:
            buf[j] = nxt
            nxt += 1
        else:
            buf[j] = buf[-1]
            buf.pop()
    return out


class EpochOrder:
    """Each epoch's order of global indices for one shard (the last two cached)."""

    def __init__(
        self,
        n: int,
        order: Order,
        buffer_size: int | None,
        seed: int,
        shard: tuple[int, int],
        shard_mode: ShardMode,
        pad_shards: bool | Literal["drop"],
        ranks_per_node: int = 1,
    ) -> None:
        self._n = n
        self._ranks_per_node = ranks_per_node
        self._order: Order = order
        self._buffer_size = buffer_size
        self._seed = seed
        self._rank, self._world = shard
        self._shard_mode: ShardMode = shard_mode
        self._pad_shards = pad_shards
        self._orders: dict[int, npt.NDArray[np.int64]] = {}
        self._words: dict[int, npt.NDArray[np.uint64]] = {}
        if shard_mode == "node":
            self.records_per_epoch = len(self.order(0))
        else:
            self.records_per_epoch = len(self._shard_positions(n))

    def settings(self) -> dict[str, Any]:
        """What makes the order, as a resume state records it."""
        settings: dict[str, Any] = {
            "seed": self._seed,
            "order": self._order,
            "buffer_size": self._buffer_size,
            "shard_mode": self._shard_mode,
            # without shards the choice changes nothing (and resumes either way)
            "pad_shards": self._pad_shards if self._world > 1 else False,
        }
        if self._shard_mode == "node":
            settings["ranks_per_node"] = self._ranks_per_node
        return settings

    def _shard_positions(self, n: int) -> npt.NDArray[np.int64]:
        """Positions of the epoch's global order that this shard visits, in order."""
        rank, world = self._rank, self._world
        if self._pad_shards and world > 1:
            # torch's DistributedSampler: every rank gets ceil(n / world) positions,
            # the order wrapping around to its start to fill the last ones; with
            # "drop", floor(n / world), the epoch's last n % world positions unread
            # (DistributedSampler's drop_last=True).
            per = n // world if self._pad_shards == "drop" else -(-n // world)
            if self._shard_mode == "strided":
                return np.arange(rank, per * world, world, dtype=np.int64) % n
            return (rank * per + np.arange(per, dtype=np.int64)) % n
        if self._shard_mode == "strided":
            return np.arange(rank, n, world, dtype=np.int64)
        base, extra = divmod(n, world)
        start = rank * base + min(rank, extra)
        return np.arange(start, start + base + (1 if rank < extra else 0), dtype=np.int64)

    def order(self, epoch: int) -> npt.NDArray[np.int64]:
        """The global indices this shard visits in ``epoch``, in order (read-only)."""
        cached = self._orders.get(epoch)
        if cached is not None:
            return cached
        n = self._n
        if self._shard_mode == "node":
            order = node_shard(
                n, self._order, self._buffer_size, self._seed, epoch, self._rank, self._world,
                self._ranks_per_node, self._pad_shards,
            )  # fmt: skip
        else:
            glob = _global_order(n, self._order, self._buffer_size, [self._seed, epoch])
            order = np.ascontiguousarray(glob[self._shard_positions(n)])
        order.setflags(write=False)
        if len(self._orders) >= 2:
            self._orders.pop(min(self._orders))
        self._orders[epoch] = order
        return order

    def words(self, epoch: int) -> npt.NDArray[np.uint64]:
        """The random word of each record of :meth:`order` in ``epoch``
        (``draw_words(seed, epoch, index)``), drawn for the whole epoch at once."""
        cached = self._words.get(epoch)
        if cached is not None:
            return cached
        words = draw_words(self._seed, epoch, self.order(epoch))
        words.setflags(write=False)
        if len(self._words) >= 2:
            self._words.pop(min(self._words))
        self._words[epoch] = words
        return words
