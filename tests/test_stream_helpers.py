"""aiockpt.storage.parts: parts cut from pieces as they come, and coroutines kept in flight
on a storage's loop from a plain thread (what the plugins' streamed writes are made of)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiockpt.storage.parts import InFlight, cut_parts


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop

    async def drain() -> None:  # no task left pending when the loop stops
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run_coroutine_threadsafe(drain(), loop).result()
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.binary(max_size=50), max_size=12),
    st.integers(1, 20),
    st.sampled_from([0, 1, 3]),
)
def test_parts_are_the_pieces_cut_anew(pieces: list[bytes], size: int, double_every: int) -> None:
    buf = bytearray(64)

    def reused() -> Iterator[memoryview]:  # one buffer, overwritten piece by piece
        for p in pieces:
            buf[: len(p)] = p
            yield memoryview(buf)[: len(p)]

    parts = list(cut_parts(reused(), size, double_every=double_every))
    assert b"".join(parts) == b"".join(pieces)
    want = size
    for i, part in enumerate(parts[:-1]):
        assert len(part) == want
        if double_every and (i + 1) % double_every == 0:
            want *= 2
    if parts:
        assert 0 < len(parts[-1]) <= want


def test_in_flight_runs_at_most_its_limit_and_gives_results_in_order(loop) -> None:
    running = [0]
    most = [0]

    async def job(i: int) -> int:
        running[0] += 1
        most[0] = max(most[0], running[0])
        await asyncio.sleep(0.01 * (i % 3))
        running[0] -= 1
        return i * i

    flight = InFlight(loop, 3)
    for i in range(10):
        flight.submit(job(i))
    assert flight.results() == [i * i for i in range(10)]
    assert most[0] == 3


def test_in_flight_raises_the_first_failure_in_submitted_order(loop) -> None:
    async def job(i: int) -> int:
        if i in (2, 4):
            raise ValueError(f"job {i}")
        return i

    flight = InFlight(loop, 8)
    for i in range(6):
        flight.submit(job(i))
    with pytest.raises(ValueError, match="job 2"):
        flight.results()
    flight.wait()


@pytest.mark.parametrize("how", ["cancel", "wait"])
def test_in_flight_returns_only_once_every_coroutine_has_ended(loop, how: str) -> None:
    """cancel() and wait() return once what was submitted has ended, its clean-up done, not
    merely once it was asked to stop: a storage deletes or aborts what it sent after them."""
    ended: list[int] = []

    async def job(i: int) -> None:
        try:
            await asyncio.sleep(0.2 if how == "wait" else 60)
        finally:
            await asyncio.sleep(0.05)  # clean-up that itself takes a turn of the loop
            ended.append(i)

    flight = InFlight(loop, 4)
    for i in range(4):
        flight.submit(job(i))
    getattr(flight, how)()
    assert sorted(ended) == [0, 1, 2, 3]


def test_in_flight_takes_nothing_more_once_one_has_failed(loop) -> None:
    """A write stops at its first failed part rather than cutting and sending the rest (with
    a server gone, each would spend its retries first): submit says no, and closes what it
    was given."""
    started: list[int] = []

    async def job(i: int) -> None:
        started.append(i)
        if i == 1:
            raise ValueError("part 1")
        await asyncio.sleep(0.05)

    flight = InFlight(loop, 2)
    taken = [flight.submit(job(i)) for i in range(10)]
    assert taken[:2] == [True, True]
    assert taken.count(True) <= 3  # the third may go in before the failure is known
    assert not any(taken[taken.index(False) :])
    assert sorted(started) == list(range(taken.count(True)))
    with pytest.raises(ValueError, match="part 1"):
        flight.results()
    flight.wait()
