"""A local storage that counts the bytes read through it, for tests of what a load reads.

Served under ``counted://`` (register it with ``register_storage("counted", open_counted)``);
every read appends one line, ``kind path offset nbytes`` (kind ``data`` for ``readinto``,
``head`` for ``read_range``), to the file named by ``$AIOCKPT_TEST_READ_LOG``, which each
process (a rank, and the daemon it starts) inherits."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

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
