"""gpipe.turns: the chunks of one worker run their actions in its order, one at a time, on one thread; every
wait is bounded, and a failure reaches every chunk."""

from __future__ import annotations

import threading
import time

import pytest

from gpipe.turns import TurnAborted, Turns


def chunks(turns: Turns, parts: list[list[int]], ran: list, step: int = 0, fail_at: int | None = None,
           timeout: float = 5.0, pause: float = 0.0):
    """A thread per chunk, each handing in its actions (places in the worker's order), the last chunk's once
    all others' are in; each action takes `pause` seconds. What each raised."""
    raised: dict[int, BaseException] = {}

    def act(n: int) -> None:
        time.sleep(pause)
        if n == fail_at:
            raise ValueError(f"boom at {n}")
        ran.append((step, n, threading.get_ident()))

    def chunk(i: int) -> None:
        if i == len(parts) - 1:
            deadline = time.monotonic() + 5
            while len(turns._parts) < i and time.monotonic() < deadline:
                time.sleep(0.001)
        try:
            turns.run([(n, lambda n=n: act(n)) for n in parts[i]], timeout, f"chunk {i}")
        except BaseException as e:
            raised[i] = e

    threads = [threading.Thread(target=chunk, args=(i,)) for i in range(len(parts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return raised


def test_one_thread_runs_every_chunks_actions_in_the_workers_order_step_after_step():
    turns, ran = Turns(), []
    turns.join()
    turns.join()
    for step in range(3):  # no reset between steps (the service's stages are driven step by step)
        assert chunks(turns, [[1, 2, 5], [0, 3, 4]], ran, step) == {}
    assert [(s, n) for s, n, _ in ran] == [(s, n) for s in range(3) for n in range(6)]
    assert all(len({t for s2, _, t in ran if s2 == s}) == 1 for s in range(3))  # one thread a step


def test_the_chunk_whose_action_failed_raises_its_error_and_the_others_give_up():
    turns, ran = Turns(), []
    turns.join()
    turns.join()
    raised = chunks(turns, [[0, 2], [1, 3]], ran, fail_at=2)
    assert [n for _, n, _ in ran] == [0, 1]  # nothing after the failed action runs
    assert isinstance(raised[0], ValueError) and isinstance(raised[1], TurnAborted)
    assert "another chunk of the worker failed (ValueError: boom at 2)" in str(raised[1])


def test_a_chunk_that_never_comes_is_named_after_the_deadline():
    turns = Turns()
    turns.join()
    turns.join()
    with pytest.raises(TimeoutError, match=r"the worker's other chunks to start the step \(chunk 3\)"):
        turns.run([(0, lambda: None)], 0.05, "chunk 3")


def test_a_failed_chunk_ends_the_others_waits_at_once():
    turns = Turns()
    turns.join()
    turns.join()
    caught: list[BaseException] = []

    def waiter() -> None:
        try:
            turns.run([(1, lambda: None)], 30.0, "B0")
        except TurnAborted as e:
            caught.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    turns.fail()
    t.join(5)
    assert not t.is_alive() and caught
    turns.reset()  # the next step starts afresh
    assert chunks(turns, [[0], [1]], []) == {}


def test_the_same_chunk_s_thread_runs_every_step_whichever_comes_last():
    # Each chunk's thread lives across steps, as a worker's stage threads do; the one holding the worker's first
    # action runs them all, whichever hands in last (on the CPU a thread allocates from its own arena: one
    # thread, one arena, step after step).
    turns, ran, idents = Turns(), [], {}
    turns.join()
    turns.join()
    late = [0, 1, 1, 0, 1, 0]  # which chunk hands in last at each step

    def chunk(i: int, parts: list[int]) -> None:
        idents[i] = threading.get_ident()
        for step, last in enumerate(late):
            if last == i:  # wait until the other chunk's part is in, waiting
                deadline = time.monotonic() + 5
                while len(turns._parts) != 1 and time.monotonic() < deadline:
                    time.sleep(0.001)
            turns.run([(n, lambda step=step, n=n: ran.append((step, n, threading.get_ident()))) for n in parts],
                      5.0, f"chunk {i}")

    threads = [threading.Thread(target=chunk, args=(i, p)) for i, p in enumerate([[1, 2, 5], [0, 3, 4]])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert [(s, n) for s, n, _ in ran] == [(s, n) for s in range(len(late)) for n in range(6)]
    assert {t for _, _, t in ran} == {idents[1]}  # chunk 1 holds action 0: its thread, every step


def test_a_chunk_in_before_the_runner_waits_for_the_round_s_actions_not_only_its_start():
    # The runner comes last and takes the round at once: the chunk already waiting has `timeout` a pending
    # action (and one more) for them to run, not `timeout` from its arrival for the round to start.
    turns = Turns()
    turns.join()
    turns.join()
    raised = chunks(turns, [[3], [0, 1, 2]], [], timeout=0.5, pause=0.3)  # chunk 1 last: 0.9 s of actions
    assert raised == {}
