"""Helpers for storages whose ``write_file`` takes pieces from an iterator (``writes_in_order``)
and sends them as the parts of a multipart upload: cut the pieces into parts as they come, and
keep a bounded number of part uploads in flight on the storage's event loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Coroutine, Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


def cut_parts(pieces: Iterable[memoryview], size: int, *, double_every: int = 0) -> Iterator[bytes]:
    """The concatenation of ``pieces`` as parts of ``size`` bytes, the last one shorter (none
    for no bytes). Each piece is copied before the next is asked for, so its memory may be
    reused once the caller moves on. With ``double_every``, parts double in size after every
    that many, for stores that cap the number of parts of an object of unknown size."""
    buf = bytearray()
    made = 0
    for piece in pieces:
        with memoryview(piece).cast("B") as view:
            buf += view
        while len(buf) >= size:
            yield bytes(buf[:size])
            del buf[:size]
            made += 1
            if double_every and made % double_every == 0:
                size *= 2
    if buf:
        yield bytes(buf)


class InFlight:
    """Coroutines run on ``loop`` from a plain thread, at most ``limit`` at once."""

    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int) -> None:
        self.loop = loop
        self.limit = max(1, limit)
        self.futures: list[concurrent.futures.Future[Any]] = []

    def submit(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Start ``coro`` once fewer than ``limit`` are running."""
        while sum(not f.done() for f in self.futures) >= self.limit:
            concurrent.futures.wait(self.futures, return_when=concurrent.futures.FIRST_COMPLETED)
        self.futures.append(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def results(self) -> list[Any]:
        """Every result, in the order submitted; raises the first failure."""
        return [f.result() for f in self.futures]

    def wait(self) -> None:
        """Wait for every coroutine submitted to end, whatever its outcome."""
        concurrent.futures.wait(self.futures)

    def cancel(self) -> None:
        """Cancel what still runs and wait for all to end."""
        for f in self.futures:
            f.cancel()
        concurrent.futures.wait(self.futures)
