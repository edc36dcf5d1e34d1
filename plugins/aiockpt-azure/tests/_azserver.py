"""A real Azure Blob server for tests: azurite (Node.js, installed by scripts/_venv.sh into
.venv/azurite) on 127.0.0.1, as a child process.

Its blobs live in a folder, so the server can be stopped mid-request and started again on the
same port with what it had stored. The tests put
``aiockpt.storage.testing.Relay`` in front of it to reset connections, or to stop the server
once a request has sent some bytes: the moment of a stop.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
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


def _die_with_parent() -> None:
    """In the child, before azurite starts: the kernel kills it if the test process dies
    first (killed, say), since in a session of its own nothing else would."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


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
    """azurite's blob service at ``endpoint``, storing its blobs under ``folder``.

    azurite keeps its blob index in memory and saves it to ``folder`` every 5 seconds, and when
    it closes: a SIGKILL loses what changed since the last save (a container just made, say).
    ``stop`` closes it cleanly, so what it held comes back on ``start``.
    """

    CLOSED = b"Azurite Blob service successfully closed"

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen[bytes] | None = None
        self._closed = threading.Event()
        self._watcher: threading.Thread | None = None
        self.start()

    def start(self) -> None:
        """Start the server (again) on its port, with what its folder holds."""
        self._closed = threading.Event()
        self._proc = subprocess.Popen(
            [
                str(AZURITE),
                *("--blobHost", "127.0.0.1", "--blobPort", str(self.port)),
                *("--location", str(self.folder), "--silent", "--skipApiVersionCheck"),
                "--disableTelemetry",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its own process group, killed whole
            preexec_fn=_die_with_parent,
        )
        self._watcher = threading.Thread(
            target=self._watch, args=(self._proc, self._closed), daemon=True
        )
        self._watcher.start()
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

    @classmethod
    def _watch(cls, proc: subprocess.Popen[bytes], closed: threading.Event) -> None:
        """Read what the server prints (so it never blocks on a full pipe); ``closed`` is set
        once it says it has closed, its index saved."""
        assert proc.stdout is not None
        for line in proc.stdout:
            if cls.CLOSED in line:
                closed.set()
        proc.stdout.close()

    def kill(self) -> None:
        """Stop the server at once (SIGKILL to its process group), as a crash would."""
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def stop(self) -> bool:
        """Stop the server cleanly: SIGTERM, after which azurite closes its connections and
        saves its index, then says so (the process itself may linger: it is killed then).
        Whether it closed cleanly: a server stopped before it could (one that has just
        started, say) may have lost its last changes."""
        proc = self._proc
        if proc is None:
            return True
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        while not self._closed.wait(0.05):
            if proc.poll() is not None:
                if self._watcher is not None:
                    self._watcher.join(10)  # what it printed before it ended, read to the end
                break
            if time.monotonic() > deadline:
                break
        clean = self._closed.is_set()
        self.kill()
        return clean

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
