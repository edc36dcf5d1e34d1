"""The trainer's end of the pipe to the daemon: thread-safe ``send``, awaitable ``recv``."""

from __future__ import annotations

import threading
from multiprocessing.connection import Connection

import anyio


class Channel:
    """One end of the pipe: thread-safe ``send``, awaitable ``recv`` (asyncio and trio)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._send_lock = threading.Lock()

    def send(self, msg: object) -> None:
        """Pickle ``msg`` into the pipe; safe from any thread."""
        with self._send_lock:
            self.conn.send(msg)

    async def recv(self) -> object:
        """The next message. Raises EOFError once the other end is gone."""
        while not self.conn.poll():
            await anyio.wait_readable(self.conn.fileno())
        return self.conn.recv()

    def close(self) -> None:
        """Close this end: the other sees EOF once it has read what was sent."""
        self.conn.close()
