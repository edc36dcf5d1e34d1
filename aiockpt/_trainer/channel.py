"""The trainer's end of the pipe to the daemon: thread-safe ``send``, awaitable ``recv``."""

from __future__ import annotations

import anyio

from .._core.gc import gc_paused
from .._core.pipe import PipeEnd


class Channel:
    """The trainer's end of the pipe: :class:`PipeEnd`'s ``send`` and ``close``, and a ``recv``
    that awaits the pipe instead of blocking the event loop (asyncio and trio)."""

    def __init__(self, end: PipeEnd) -> None:
        self.end = end
        self.send = end.send
        self.close = end.close

    async def recv(self) -> object:
        """The next message. Raises EOFError once the other end is gone."""
        conn = self.end.conn
        while not conn.poll():
            await anyio.wait_readable(conn.fileno())
        with gc_paused():  # a GC pass over a large reply costs more than unpickling it
            return conn.recv()
