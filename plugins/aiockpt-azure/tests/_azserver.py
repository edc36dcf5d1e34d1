"""A real Azure Blob server for tests: azurite (Node.js, installed by scripts/_venv.sh into
.venv/azurite) on 127.0.0.1, as a child process.

Its blobs live in a folder, so the server can be killed mid-request and started again on the
same port with what it had stored. ``Relay`` is a TCP relay in front of it that can reset
connections, or kill the server once a request has sent some bytes: the moment of a stop.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import struct
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
AZURITE = Path(__file__).resolve().parents[3] / ".venv/azurite/node_modules/.bin/azurite-blob"


def why_not() -> str | None:
    """Why azurite cannot run here, or None when it can."""
    if shutil.which("node") is None:
        return (
            "Node.js is not installed (azurite needs it): install node and npm, "
            "then run ./scripts/test"
        )
    if not AZURITE.exists():
        return (
            "azurite is not installed: run ./scripts/test "
            "(or npm install --prefix .venv/azurite azurite)"
        )
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def connection_string(endpoint: str) -> str:
    return (
        f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};"
        f"BlobEndpoint={endpoint}/{ACCOUNT};"
    )


class AzuriteServer:
    """azurite's blob service at ``endpoint``, storing its blobs under ``folder``."""

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
                str(AZURITE),
                *("--blobHost", "127.0.0.1", "--blobPort", str(self.port)),
                *("--location", str(self.folder), "--silent", "--skipApiVersionCheck"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError("azurite did not start") from None
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

    def client(self) -> Any:
        """A plain (synchronous) blob service client, to look behind the storage's back."""
        from azure.storage.blob import BlobServiceClient

        return BlobServiceClient.from_connection_string(connection_string(self.endpoint))

    def new_container(self) -> str:
        name = f"c-{uuid.uuid4().hex[:16]}"
        with self.client() as c:
            c.create_container(name)
        return name

    def names(self, container: str) -> list[str]:
        with self.client() as c:
            return sorted(b.name for b in c.get_container_client(container).list_blobs())

    def options(self, endpoint: str | None = None, **extra: Any) -> dict[str, Any]:
        """storage_options pointing adlfs at this server."""
        return {"connection_string": connection_string(endpoint or self.endpoint), **extra}


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
