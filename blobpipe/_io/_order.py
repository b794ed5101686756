"""The order of records in each epoch, and which of them a shard reads.

The database's keys are numbered ``0..n-1`` in key (byte) order: a record's
*global index*. Each epoch has a global order — key order (``order="key"``,
Caffe), a permutation seeded by ``(seed, epoch)`` (``order="shuffle"``), or a
shuffle buffer of ``buffer_size`` records run over key order with the same seed
(``order="buffer"``) — which is then sharded: ``shard_mode="strided"`` gives
rank ``r`` the positions ``r, r + world, ...`` (PyTorch's DistributedSampler),
``"contiguous"`` splits it into ``world`` runs whose lengths differ by at most
one. Every rank computes the same global order, so shards are disjoint and
together cover every record (``pad_shards``: every rank reads ``ceil(n /
world)``, the order wrapping around, as DistributedSampler pads).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Literal, cast

import numpy as np
import numpy.typing as npt

from .._errors import ArgumentError, ArgumentTypeError
from ._kernels import draw_words

__all__ = ["EpochOrder", "Order", "ShardMode", "buffer_order", "shard_from"]

Order = Literal["key", "shuffle", "buffer"]
ShardMode = Literal["strided", "contiguous"]


def shard_from(shard: tuple[int, int] | Literal["auto"] | None) -> tuple[int, int]:
    """``(rank, world_size)`` of a ``shard`` argument.

    "auto": an initialised ``torch.distributed`` process group's (``mp.spawn`` with
    ``init_process_group``, or torchrun), else torchrun's ``RANK``/``WORLD_SIZE``
    environment variables, else no sharding.

    Raises:
        ValueError: a rank outside ``[0, world_size)``, or only one of ``RANK`` and
            ``WORLD_SIZE`` set (or not integers).
        TypeError: ``shard`` of another type.
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
    rank_i, world_i = int(shard[0]), int(shard[1])
    if world_i < 1 or not 0 <= rank_i < world_i:
        raise ArgumentError(
            f"shard (rank, world_size) must have 0 <= rank < world_size, got {shard}"
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
    ) -> None:
        self._n = n
        self._order: Order = order
        self._buffer_size = buffer_size
        self._seed = seed
        self._rank, self._world = shard
        self._shard_mode: ShardMode = shard_mode
        self._pad_shards = pad_shards
        self._orders: dict[int, npt.NDArray[np.int64]] = {}
        self._words: dict[int, npt.NDArray[np.uint64]] = {}
        self.records_per_epoch = len(self._shard_positions(n))

    def settings(self) -> dict[str, Any]:
        """What makes the order, as a resume state records it."""
        return {
            "seed": self._seed,
            "order": self._order,
            "buffer_size": self._buffer_size,
            "shard_mode": self._shard_mode,
            # without shards the choice changes nothing (and resumes either way)
            "pad_shards": self._pad_shards if self._world > 1 else False,
        }

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
        if self._order == "key":
            glob = np.arange(n, dtype=np.int64)
        else:
            rng = np.random.Generator(np.random.Philox(np.random.SeedSequence([self._seed, epoch])))
            if self._order == "shuffle":
                glob = rng.permutation(n).astype(np.int64)
            else:
                glob = buffer_order(n, cast(int, self._buffer_size), rng)
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
