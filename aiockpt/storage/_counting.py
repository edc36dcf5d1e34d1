"""Counting a root's storage operations, per kind and per save.

The daemon wraps whatever storage it opens in a :class:`CountingStorage`. Each operation a
thread makes is counted in the scope that thread opened last (the writer opens one per save),
and in the totals; operations made outside any scope (the lease keeper's renewals, loads)
count in the totals only. A call counts once: a multipart upload is one ``write_file``, however
many parts a backend sends for it; a poll of ``list_dir`` counts each listing.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ._base import Storage

#: The operations of the Storage protocol, and the optional ones a backend may offer.
OPERATIONS = (
    "write_file",
    "put_atomic",
    "put_if_absent",
    "read_range",
    "readinto",
    "size",
    "exists",
    "list_dir",
    "makedirs",
    "delete",
)


class CountingStorage:
    """A :class:`~aiockpt.storage.Storage` that counts the operations made through it."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.url = inner.url
        self.totals: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._local = threading.local()

    @contextlib.contextmanager
    def scope(self) -> Iterator[Counter[str]]:
        """Count this thread's operations in a new counter until the block ends (scopes
        nest: an inner one counts in the outer ones too)."""
        counts: Counter[str] = Counter()
        stack = self._stack()
        stack.append(counts)
        try:
            yield counts
        finally:
            stack.remove(counts)

    def _stack(self) -> list[Counter[str]]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _count(self, op: str) -> None:
        for counts in self._stack():
            counts[op] += 1
        with self._lock:
            self.totals[op] += 1

    def write_file(self, path: str, buffers: Sequence[memoryview]) -> None:
        self._count("write_file")
        self.inner.write_file(path, buffers)

    def put_atomic(self, path: str, data: bytes) -> None:
        self._count("put_atomic")
        self.inner.put_atomic(path, data)

    def read_range(self, path: str, start: int, end: int) -> bytes:
        self._count("read_range")
        return self.inner.read_range(path, start, end)

    def readinto(self, path: str, offset: int, out: memoryview) -> None:
        self._count("readinto")
        self.inner.readinto(path, offset, out)

    def size(self, path: str) -> int:
        self._count("size")
        return self.inner.size(path)

    def exists(self, path: str) -> bool:
        self._count("exists")
        return self.inner.exists(path)

    def list_dir(self, path: str) -> list[str]:
        self._count("list_dir")
        return self.inner.list_dir(path)

    def makedirs(self, path: str) -> None:
        self._count("makedirs")
        self.inner.makedirs(path)

    def delete(self, path: str, *, recursive: bool = False) -> None:
        self._count("delete")
        self.inner.delete(path, recursive=recursive)

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        # The optional operations (put_if_absent) exactly when the backend has them, counted;
        # anything else of the backend's as it is.
        attr = getattr(self.inner, name)
        if name in OPERATIONS and callable(attr):
            return self._counted(name, attr)
        return attr

    def _counted(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self._count(name)
            return fn(*args, **kwargs)

        return call
