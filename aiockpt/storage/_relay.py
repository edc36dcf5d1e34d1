"""A TCP relay that fails a storage's connections at will, the server behind it untouched:
:class:`Relay`, public as :class:`aiockpt.storage.testing.Relay`."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Callable

__all__ = ["Relay"]


class Relay:
    """A TCP relay from ``endpoint`` (127.0.0.1, a port of its own) to a server listening on
    127.0.0.1 at ``target_port``: point the storage at ``endpoint`` and fail its connections
    at will, the server itself untouched.

    - ``reset_next(n)``: the next ``n`` connections are reset as they come in (a transient
      failure, for retries to ride out).
    - ``trip(nbytes, action)``: once a connection has sent ``nbytes`` towards the server,
      ``action()`` runs (kill the server, say) and every open connection is reset: the moment
      a request stops half way.
    - ``down()`` / ``up()``: stop listening and reset every open connection, then listen again
      on the same port, which is what a client sees of a server that stops and comes back.
    - ``close()``: down for good.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0  # the first up() takes a free port; later ones take it again
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._resets = 0
        self._trip: tuple[int, Callable[[], None]] | None = None
        self.up()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def reset_next(self, n: int) -> None:
        """Reset the next ``n`` connections as they come in."""
        with self._lock:
            self._resets = n

    def trip(self, nbytes: int, action: Callable[[], None]) -> None:
        """Once a connection has sent ``nbytes`` towards the server, run ``action()`` and
        reset every open connection; once."""
        with self._lock:
            self._trip = (nbytes, action)

    def up(self) -> None:
        """Listen on ``port`` (again) and relay what comes in."""
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", self.port))
            sock.listen(64)
        except OSError:
            sock.close()
            raise
        self.port = sock.getsockname()[1]
        with self._lock:
            self._listener = sock
        threading.Thread(target=self._accept, args=(sock,), daemon=True).start()

    def down(self) -> None:
        """Refuse new connections and reset every open one."""
        with self._lock:
            sock, self._listener = self._listener, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        self.reset_all()

    def close(self) -> None:
        """Down for good (see down)."""
        self.down()

    def reset_all(self) -> None:
        """Reset every connection open through the relay."""
        with self._lock:
            conns, self._conns = self._conns, set()
        for c in conns:
            _reset(c)

    def _accept(self, sock: socket.socket) -> None:
        while True:
            try:
                client, _ = sock.accept()
            except OSError:
                return  # the listener was closed: down()
            with self._lock:
                reset = self._resets > 0
                self._resets -= reset
            if reset:
                _reset(client)
                continue
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                _reset(client)
                continue
            with self._lock:
                if self._listener is not sock:  # down() came in between: not relayed
                    live = False
                else:
                    live = True
                    self._conns |= {client, server}
            if not live:
                _reset(client)
                server.close()
                return
            left = [2]  # directions still open; the last one closes both sockets
            for a, b, up in ((client, server, True), (server, client, False)):
                threading.Thread(target=self._pipe, args=(a, b, up, left), daemon=True).start()

    def _pipe(
        self, src: socket.socket, dst: socket.socket, upstream: bool, left: list[int]
    ) -> None:
        sent = 0
        try:
            while data := src.recv(1 << 20):
                dst.sendall(data)
                sent += len(data)
                if upstream and self._trip is not None and sent >= self._trip[0]:
                    with self._lock:
                        trip, self._trip = self._trip, None
                    if trip is not None:
                        trip[1]()
                        self.reset_all()
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
        with self._lock:
            left[0] -= 1
            last = left[0] == 0
            if last:
                self._conns -= {src, dst}
        if last:
            src.close()
            dst.close()


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` with a reset (linger 0): its peer sees "connection reset"."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
