"""Test storages: one that counts the bytes read through it, for tests of what a load reads;
one that fails (an outage), and one whose opening finds no credentials.

Served under ``counted://`` (register it with ``register_storage("counted", open_counted)``);
every read appends one line, ``kind path offset nbytes`` (kind ``data`` for ``readinto``,
``head`` for ``read_range``), to the file named by ``$AIOCKPT_TEST_READ_LOG``, which each
process (a rank, and the daemon it starts) inherits."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

from aiockpt.errors import StorageError
from aiockpt.storage import LocalStorage

ENV = "AIOCKPT_TEST_READ_LOG"


class CountedStorage(LocalStorage):
    #: Inside read_range, which reads through readinto: counted once, as a head read.
    _in_range = False

    def _log(self, kind: str, path: str, offset: int, n: int) -> None:
        with open(os.environ[ENV], "a") as f:
            f.write(f"{kind} {path} {offset} {n}\n")

    def readinto(self, path: str, offset: int, out: memoryview) -> None:
        super().readinto(path, offset, out)
        if not self._in_range:
            self._log("data", path, offset, len(out))

    def read_range(self, path: str, start: int, end: int) -> bytes:
        self._in_range = True
        try:
            data = super().read_range(path, start, end)
        finally:
            self._in_range = False
        self._log("head", path, start, len(data))
        return data


def open_counted(url: str, storage_options: dict[str, Any]) -> CountedStorage:
    return CountedStorage(url.partition("://")[2])


def read_totals(log: Path) -> dict[str, int]:
    """Bytes read by kind (``data``, ``head``) from a log of CountedStorage."""
    totals = {"data": 0, "head": 0}
    if log.exists():
        for line in log.read_text().splitlines():
            kind, _, _, n = line.split()
            totals[kind] += int(n)
    return totals


class BrokenStorage(LocalStorage):
    """A root whose storage fails every listing and read, as an outage does."""

    def _fail(self, path: str) -> StorageError:
        return StorageError(f"{path}: connection reset by peer", path=path, errno=errno.ECONNRESET)

    def list_dir(self, path: str) -> list[str]:
        raise self._fail(path)

    def exists(self, path: str) -> bool:
        raise self._fail(path)

    def readinto(self, path: str, offset: int, out: memoryview) -> None:
        raise self._fail(path)


def open_broken(url: str, storage_options: dict[str, Any]) -> BrokenStorage:
    return BrokenStorage(url.partition("://")[2])


def open_without_credentials(url: str, storage_options: dict[str, Any]) -> LocalStorage:
    """A storage plugin that finds no credentials when it opens, as a cloud plugin does."""
    raise StorageError(
        f"{url}: no credentials found (set them in the environment or pass them as options)",
        errno=errno.EACCES,
    )
