"""The numbered hand-off between the fillers and the consumer."""

from __future__ import annotations

import threading

from blobpipe._loader._handoff import End, Failure, Handoff


def test_items_are_taken_by_number_whatever_order_they_are_posted_in() -> None:
    h: Handoff[str] = Handoff()
    h.post(1, "b")
    assert h.take() is None  # 0 is due first
    h.post(0, "a")
    assert [h.take(), h.take(), h.take()] == ["a", "b", None]


def test_post_many_wakes_the_waiting_consumer_once() -> None:
    """A chunk's batches posted together wake the consumer once, and it finds them all."""
    h: Handoff[str] = Handoff()
    wakes: list[int] = []
    assert h.take(lambda: wakes.append(0)) is None  # waits for number 0
    h.post_many([(0, "a"), (1, "b"), (2, "c")])
    assert wakes == [0]
    assert [h.take(), h.take(), h.take()] == ["a", "b", "c"]

    # a consumer waiting for a number the items do not hold is not woken
    assert h.take(lambda: wakes.append(3)) is None  # waits for 3
    h.post_many([(4, "e"), (5, "f")])
    assert wakes == [0]
    end, failure = End(), Failure(ValueError("bad record"))
    h.post_many([(3, "d"), (6, end), (7, failure)])
    assert wakes == [0, 3]
    assert [h.take() for _ in range(5)] == ["d", "e", "f", end, failure]


def test_post_many_to_a_closed_event_loop_does_not_raise() -> None:
    def gone() -> None:
        raise RuntimeError("Event loop is closed")

    h: Handoff[str] = Handoff()
    assert h.take(gone) is None
    h.post_many([(0, "a")])
    assert h.take() == "a"


def test_wait_returns_when_the_next_item_is_posted_and_not_for_a_later_one() -> None:
    h: Handoff[str] = Handoff()
    assert h.wait(0.01) is False  # nothing posted: the timeout passes
    poster = threading.Timer(0.05, h.post_many, [[(1, "b"), (0, "a")]])
    h.post(2, "c")  # a later number does not end the wait
    poster.start()
    assert h.wait(30) is True
    poster.join()
    assert [h.take(), h.take(), h.take()] == ["a", "b", "c"]
    assert h.wait(0) is False  # number 3 is not there
    h.post(3, "d")
    assert h.wait(0) is True  # already there: no waiting
    assert h.take() == "d"


def test_a_timed_out_wait_leaves_no_waiter_behind() -> None:
    """A post after a wait gave up wakes nobody (a stale wake would end a later wait early)."""
    h: Handoff[str] = Handoff()
    assert h.wait(0.001) is False
    wakes: list[int] = []
    h.post(0, "a")
    assert h.take(lambda: wakes.append(0)) == "a"
    assert wakes == []


def test_a_closed_handoff_wakes_at_once() -> None:
    """A consumer that starts waiting after the close (another thread closed the
    loader meanwhile) is woken at once instead of waiting forever."""
    h: Handoff[str] = Handoff()
    h.post(0, "a")
    h.close()
    assert h.take() is None  # the posted items went with the close
    wakes: list[int] = []
    assert h.take(lambda: wakes.append(0)) is None
    assert wakes == [0]
    assert h.wait() is True


def test_close_ends_a_wait_in_another_thread() -> None:
    h: Handoff[str] = Handoff()
    closer = threading.Timer(0.05, h.close)
    closer.start()
    assert h.wait() is True
    closer.join()
    assert h.take() is None
