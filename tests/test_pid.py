"""This process's id without a system call (``blobpipe._io._pid``), and the loader's
per-batch path making no ``getpid`` call: a system call made with the GIL held is a
point where the kernel may deschedule the thread holding it."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

import blobpipe
from blobpipe._io._pid import pid
from tests._helpers import in_forked_child, raw_db


def test_pid_is_this_process() -> None:
    assert pid() == os.getpid()


def test_a_forked_child_sees_its_own_id() -> None:
    parent = pid()
    assert in_forked_child(lambda: pid() == os.getpid() != parent) == 0
    assert pid() == parent == os.getpid()


def _report(queue: multiprocessing.Queue[tuple[int, int]]) -> None:
    queue.put((pid(), os.getpid()))


def test_a_multiprocessing_fork_child_sees_its_own_id() -> None:
    ctx = multiprocessing.get_context("fork")
    queue: multiprocessing.Queue[tuple[int, int]] = ctx.Queue()
    proc = ctx.Process(target=_report, args=(queue,))
    proc.start()
    got, real = queue.get(timeout=30)
    proc.join(30)
    assert got == real == proc.pid != os.getpid()


@pytest.mark.parametrize("workers", [1, 2])
def test_no_getpid_call_per_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    db = raw_db(tmp_path / "db", 64, (1, 4, 4))
    calls = []
    real = os.getpid

    def counted() -> int:
        calls.append(1)
        return real()

    with blobpipe.Loader(db, batch_size=2, workers=workers, device="cpu", mode="epoch") as loader:
        next(iter(loader))
        monkeypatch.setattr(os, "getpid", counted)
        batches = [b.valid for b in loader]  # every lease ends in the loop
    assert sum(batches) == 62
    assert calls == []  # none for 31 batches, their leases and the consumer's checks
