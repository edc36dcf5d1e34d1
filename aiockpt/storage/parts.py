"""Public helpers for storage plugins whose ``write_file`` takes pieces from an iterator
(``writes_in_order``) and sends them as the parts of a multipart upload: cut the pieces into
parts as they come (:func:`cut_parts`), and keep a bounded number of part uploads in flight on
the storage's event loop (:class:`InFlight`). See "An object store's plumbing" in the storage
docs."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine, Iterable, Iterator
from typing import Any, TypeVar

__all__ = ["InFlight", "cut_parts"]

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
    """Coroutines run on ``loop`` from a plain thread, at most ``limit`` at once.

    Once one has failed, no more are taken (``submit`` says so): a write stops at its first
    failed part rather than cutting and sending the rest, each of which would spend its own
    retries first when the server is gone.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int) -> None:
        self.loop = loop
        self.limit = max(1, limit)
        self.futures: list[concurrent.futures.Future[Any]] = []
        self._changed = threading.Condition()  # a future ended: the two below changed
        self._running = 0
        self._failed = False

    def submit(self, coro: Coroutine[Any, Any, Any]) -> bool:
        """Start ``coro`` once fewer than ``limit`` are running, and say True; False, with
        ``coro`` closed and not started, once one submitted before has failed (``results``
        raises its error)."""
        with self._changed:
            while not self._failed and self._running >= self.limit:
                self._changed.wait()
            if self._failed:
                coro.close()
                return False
            self._running += 1
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        self.futures.append(future)
        future.add_done_callback(self._ended)
        return True

    def _ended(self, future: concurrent.futures.Future[Any]) -> None:
        with self._changed:
            self._running -= 1
            if not future.cancelled() and future.exception() is not None:
                self._failed = True
            self._changed.notify_all()

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
