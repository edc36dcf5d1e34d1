"""One end of the pipe between a trainer and its daemon, as both processes use it."""

from __future__ import annotations

import threading
from multiprocessing.connection import Connection


class PipeEnd:
    """``send`` from any thread (each message goes whole), blocking ``recv``, ``close``."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, msg: object) -> None:
        """Pickle ``msg`` into the pipe, whole, even with other threads sending too."""
        with self._lock:
            self.conn.send(msg)

    def recv(self) -> object:
        """The next message; blocks. Raises EOFError once the other end is gone."""
        return self.conn.recv()

    def close(self) -> None:
        """Close this end: the other sees EOF once it has read what was sent."""
        self.conn.close()
