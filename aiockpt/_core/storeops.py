"""The job's key-value store, as a multi-rank commit uses it, and the pipe that reaches it.

A torch.distributed job has a store every rank reaches: the c10d store the process group was
made with (torchrun's TCPStore, a FileStore for ``init_method="file://…"``). The commit signals
through it (see aiockpt/_daemon/rendezvous.py), but the daemon never imports torch: the trainer
process holds the store, and a thread there (aiockpt/_trainer/storeproxy.py) answers the
daemon's calls on a second pipe of their own, so the answers never wait for the trainer's
event loop.

This module names the five operations the commit needs (:class:`StoreOps`), the messages that
carry them, both ends of that pipe, and their errors. It imports nothing outside the standard
library.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Protocol


class StoreTimeout(Exception):
    """A wait on the store reached its timeout."""


class StoreUnreachable(Exception):
    """The store, or the trainer process that relays it, is gone; the message says which."""


class StoreOps(Protocol):
    """What a commit asks of the store. Values are bytes; a missing key reads as absent."""

    def set_if_absent(self, keys: Sequence[str], value: bytes) -> list[bytes]:
        """Set each key to ``value`` unless it is set already; every key's value after."""
        ...

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        """Return once every key is set; StoreTimeout after ``timeout`` seconds."""
        ...

    def get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of keys that are set."""
        ...

    def check(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is set, without waiting."""
        ...

    def delete(self, keys: Sequence[str]) -> None:
        """Remove the keys (those not set are ignored)."""
        ...


@dataclass(frozen=True, slots=True)
class StoreCall:
    """One :class:`StoreOps` call, from the daemon to the trainer's relay."""

    op: str
    args: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class StoreAnswer:
    """Its answer: the value, or that it timed out, or why it failed."""

    value: Any = None
    timeout: bool = False
    error: str | None = None


OPS = ("set_if_absent", "wait", "get", "check", "delete")


class PipeStoreOps:
    """The daemon's end: each call goes over the pipe and waits for its answer. Calls from
    several threads take turns."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def _call(self, op: str, *args: Any) -> Any:
        with self._lock:
            try:
                self._conn.send(StoreCall(op, args))
                answer = self._conn.recv()
            except (EOFError, OSError) as e:
                raise StoreUnreachable(
                    f"the trainer process relaying the job's store is gone ({e or 'EOF'})"
                ) from None
        if answer.timeout:
            raise StoreTimeout(answer.error)
        if answer.error is not None:
            raise StoreUnreachable(answer.error)
        return answer.value

    def set_if_absent(self, keys: Sequence[str], value: bytes) -> list[bytes]:
        return self._call("set_if_absent", list(keys), value)

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        self._call("wait", list(keys), timeout)

    def get(self, keys: Sequence[str]) -> list[bytes]:
        return self._call("get", list(keys))

    def check(self, keys: Sequence[str]) -> list[bool]:
        return self._call("check", list(keys))

    def delete(self, keys: Sequence[str]) -> None:
        self._call("delete", list(keys))

    def close(self) -> None:
        """Close the pipe: the relay's thread sees EOF and ends."""
        self._conn.close()


def serve(conn: Connection, ops: StoreOps) -> None:
    """The relay's loop: answer each call on ``conn`` with ``ops`` until the daemon's end
    closes. Returns then (or when the answer cannot be sent)."""
    while True:
        try:
            call = conn.recv()
        except (EOFError, OSError):
            return
        if not isinstance(call, StoreCall) or call.op not in OPS:
            answer = StoreAnswer(error=f"not a store call: {call!r}")
        else:
            try:
                answer = StoreAnswer(getattr(ops, call.op)(*call.args))
            except StoreTimeout as e:
                answer = StoreAnswer(timeout=True, error=str(e))
            except StoreUnreachable as e:
                answer = StoreAnswer(error=str(e))
            except Exception as e:
                answer = StoreAnswer(error=f"the job's store failed: {type(e).__name__}: {e}")
        try:
            conn.send(answer)
        except (OSError, ValueError):
            return
