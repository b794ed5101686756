"""The numbered hand-off between the fillers and the consumer."""

from __future__ import annotations

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
