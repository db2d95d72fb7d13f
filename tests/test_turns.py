"""gpipe.turns: the chunks of one worker run its actions in order, one at a time; every wait is bounded."""

from __future__ import annotations

import threading

import pytest

from gpipe.turns import TurnAborted, Turns


def test_threads_run_in_the_workers_order_whatever_order_they_start_in():
    turns, ran = Turns(), []

    def chunk(positions: list[int]) -> None:
        for n in positions:
            with turns.turn(n, 6, 5.0, f"action {n}"):
                ran.append(n)

    threads = [threading.Thread(target=chunk, args=(p,)) for p in ([1, 2, 5], [0, 3, 4])]
    for t in reversed(threads):
        t.start()
    for t in threads:
        t.join(10)
    assert ran == [0, 1, 2, 3, 4, 5]


def test_a_turn_that_never_comes_names_what_waited_and_what_it_waited_behind():
    turns = Turns()
    with pytest.raises(TimeoutError, match=r"action 2 \(F0.1 of model chunk 3\): its action 0 on another chunk"):
        with turns.turn(2, 4, 0.05, "F0.1 of model chunk 3"):
            pass


def test_a_failed_chunk_ends_the_others_waits_at_once():
    turns = Turns()
    caught: list[BaseException] = []

    def waiter() -> None:
        try:
            with turns.turn(1, 2, 30.0, "B0"):
                pass
        except TurnAborted as e:
            caught.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    turns.fail()
    t.join(5)
    assert not t.is_alive() and caught
    turns.reset()  # the next step starts afresh
    with turns.turn(0, 2, 1.0, "F0"):
        pass


def test_after_the_last_action_the_turn_goes_to_the_next_steps_first():
    """The service drives each chunk step by step, with no reset between steps: the order starts over."""
    turns, ran = Turns(), []

    def chunk(positions: list[int]) -> None:
        for step in range(3):
            for n in positions:
                with turns.turn(n, 3, 5.0, f"action {n}"):
                    ran.append((step, n))

    threads = [threading.Thread(target=chunk, args=(p,)) for p in ([0, 2], [1])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert ran == [(s, n) for s in range(3) for n in range(3)]
