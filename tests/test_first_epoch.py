"""What a Loader's first epoch pays besides its batches (``bench/bench_first.py``
measures it): here, what it no longer pays, checked by counting, never by timing."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import anyio
import pytest

from blobpipe import Batches, Loader
from blobpipe._loader import _pipeline
from blobpipe._loader._pipeline import Pipeline
from tests._helpers import raw_db, wait_until


def test_a_batch_planned_while_the_loader_closes_is_not_filled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The close waits for every filler: a filler that was planning a batch when the close
    began returns without filling it (nobody takes it), so the close does not wait for
    that fill. At the end of a first epoch the fillers are planning the next one."""
    db = raw_db(tmp_path / "db", 40)
    closing = threading.Event()
    fills: list[int] = []
    plans: list[str] = []
    real_plan, real_fill, real_close = Batches.next_plans, Batches.fill, Pipeline.begin_close

    def next_plans(self: Batches, count: int) -> Any:
        me = threading.current_thread().name
        if me.startswith("blobpipe-filler"):
            assert count == 1  # a batch filled on its own is planned on its own
            plans.append(me)
            if len(plans) == 3:  # planned while the consumer closes the loader
                assert closing.wait(10)
        return real_plan(self, count)

    def fill(self: Batches, plan: Any, *args: Any, **kwargs: Any) -> None:
        fills.append(int(plan.positions[0]))
        real_fill(self, plan, *args, **kwargs)

    def begin_close(self: Pipeline) -> bool:
        try:
            return real_close(self)
        finally:
            closing.set()

    monkeypatch.setattr(Batches, "next_plans", next_plans)
    monkeypatch.setattr(Batches, "fill", fill)
    monkeypatch.setattr(Pipeline, "begin_close", begin_close)
    # every batch filled on its own (not in chunks): the path that takes its slot before
    # it plans
    monkeypatch.setattr(_pipeline, "SMALL_FILL", 0.0)
    with Loader(db, 4, device="cpu", prefetch=4, workers=1) as loader:
        it = iter(loader)
        next(it)
        # the third plan waits for the close
        anyio.run(wait_until, lambda: len(plans) == 3, "the third plan")
    assert len(plans) == 3
    assert fills == [0, 4]  # the batches planned before the close, not the third


def test_the_fillers_start_together(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No filler plans a batch before every filler thread was started: one that ran at
    once would hold the GIL while the opening thread waits to start the next (up to the
    switch interval each), the others not yet filling."""
    db = raw_db(tmp_path / "db", 40)
    started: list[str] = []
    at_first_plan: list[list[str]] = []
    real_start, real_plan = threading.Thread.start, Batches.next_plans

    def start(self: threading.Thread) -> None:
        if self.name.startswith("blobpipe-filler"):
            if started:  # a slow start of every filler but the first
                threading.Event().wait(0.05)
            started.append(self.name)
        real_start(self)

    def next_plans(self: Batches, count: int) -> Any:
        if threading.current_thread().name.startswith("blobpipe-filler") and not at_first_plan:
            at_first_plan.append(list(started))
        return real_plan(self, count)

    monkeypatch.setattr(threading.Thread, "start", start)
    monkeypatch.setattr(Batches, "next_plans", next_plans)
    with Loader(db, 4, device="cpu", prefetch=4, workers=3, mode="epoch") as loader:
        got = [len(batch) for batch in loader]
    assert got == [4] * 10
    assert at_first_plan == [["blobpipe-filler-0", "blobpipe-filler-1", "blobpipe-filler-2"]]
