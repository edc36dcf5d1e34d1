"""What a rank's partners hold of its shards, read over the network as a load needs it (see
docs/tiers.md).

A :class:`PeerView` is a read-only storage of the steps whose shard of this rank a partner's
tier holds: from the partner's ``list`` answer, the step's ``manifest.json`` and that shard.
Its reads are ``read`` requests (a byte range of a file, see ``peers.py``) over a small pool
of persistent connections, one request per connection at a time; a large read is cut into
pieces read over several connections at once. Nothing is written to this host's tier: a
replacement host's load reads its shard from its partner as it would from its own disk, and
its new saves fill its tier again.

Every answer comes over an authenticated connection, its bytes checked against their MAC
before they are handed on (``peerwire.py``); the load then checks every tensor's crc32c (and
the shard's) as it reads. A partner that cannot be reached, or that goes away mid-read, is a
:class:`StorageError` within the job's ``dist_timeout``, never a hang.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from .._core import format as fmt
from ..errors import StorageError
from .peers import Peers, Say
from .peerwire import Channel

__all__ = ["PeerView"]

#: The bytes one ``read`` request moves at most: a larger read is several, in flight at once.
PIECE = 16 << 20

#: How many requests a large read has in flight (each on a connection of its own).
STREAMS = 4


class PeerView:
    """The steps this rank's partners hold its shard of, as a read-only storage: their
    manifests and this rank's shards (see the module's docstring)."""

    def __init__(self, peers: Peers, say: Say) -> None:
        self.peers = peers
        self.say = say
        self.url = "peer://"
        self._held: dict[int, tuple[int, str]] | None = None  # step: (partner, shard file)
        self._sizes: dict[str, int] = {}
        self._idle: dict[int, list[Channel]] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------------- holdings

    def refresh(self) -> None:
        """Ask each partner, again, which committed steps of its tier hold this rank's shard
        (a listing's first step: a partner prunes its tier as it saves). A partner that does
        not answer holds nothing for now: a ``tier.failed`` event."""
        held: dict[int, tuple[int, str]] = {}
        for target in self.peers.targets:
            try:
                answer = self._request(target, {"op": "list", "rank": self.peers.rank})
                for step, name, _crc in answer.get("steps", ()):
                    held.setdefault(int(step), (target, str(name)))
            except (StorageError, TypeError, ValueError) as e:
                self.say("tier.failed", None, f"no replicas listed by rank {target}: {e}")
        with self._lock:
            self._held = held
            self._sizes.clear()

    def _holdings(self) -> dict[int, tuple[int, str]]:
        if self._held is None:
            self.refresh()
        assert self._held is not None
        return self._held

    def _find(self, path: str) -> tuple[int, int, str] | None:
        """The partner holding ``path``, its step and file name; None where none does."""
        head, _, name = path.partition("/")
        step = fmt.parse_step_dirname(head)
        if step is None or not name:
            return None
        there = self._holdings().get(step)
        if there is None or name not in (fmt.MANIFEST, there[1]):
            return None
        return there[0], step, name

    def _located(self, path: str) -> tuple[int, int, str]:
        found = self._find(path)
        if found is None:
            raise StorageError(f"{path}: no partner holds it")
        return found

    def where(self, path: str) -> str:
        """What errors call ``path`` read from here: the partner's, by rank."""
        found = self._find(path)
        return f"peer://rank{found[0] if found else '?'}/{path}"

    def exists(self, path: str) -> bool:
        if fmt.parse_step_dirname(path.rstrip("/")) in self._holdings():
            return True  # a step directory
        return self._find(path) is not None

    def list_dir(self, path: str) -> list[str]:
        held = self._holdings()
        if path in ("", "/"):
            return sorted(fmt.step_dirname(step) for step in held)
        step = fmt.parse_step_dirname(path.rstrip("/"))
        if step is None or step not in held:
            return []
        return sorted([fmt.MANIFEST, held[step][1]])

    # ---------------------------------------------------------------------------- reads

    def size(self, path: str) -> int:
        size = self._sizes.get(path)
        if size is None:
            target, step, name = self._located(path)
            self._read(target, step, name, 0, memoryview(b""))
            size = self._sizes[path]
        return size

    def read_range(self, path: str, start: int, end: int) -> bytes:
        out = bytearray(max(0, end - start))
        self.readinto(path, start, memoryview(out))
        return bytes(out)

    def readinto(self, path: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the file's bytes from ``offset``: one request, or, for more than
        :data:`PIECE` bytes, one a piece with :data:`STREAMS` in flight."""
        target, step, name = self._located(path)
        with memoryview(out).cast("B") as view:
            starts = range(0, len(view), PIECE)
            if len(starts) <= 1:
                self._read(target, step, name, offset, view)
                return

            def piece(at: int) -> None:
                with view[at : at + PIECE] as part:
                    self._read(target, step, name, offset + at, part)

            futures = [self._readers().submit(piece, at) for at in starts]
            wait(futures)
            for f in futures:
                f.result()  # the first failure, once none is still reading

    def _read(self, target: int, step: int, name: str, start: int, out: memoryview) -> None:
        header = {"op": "read", "step": step, "file": name, "start": start}
        answer = self._request(target, {**header, "end": start + len(out)}, out)
        self._sizes[f"{fmt.step_dirname(step)}/{name}"] = int(answer["size"])

    def _readers(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(STREAMS, thread_name_prefix="aiockpt-peer-read")
            return self._pool

    # ---------------------------------------------------------------------- connections

    def _request(
        self, target: int, header: dict[str, Any], out: memoryview | None = None
    ) -> dict[str, Any]:
        """Send ``header`` to ``target`` on an idle connection (or a new one), read its
        answer and, where ``out`` is given, the answer's bytes into it. Any failure closes the
        connection and is a :class:`StorageError`; a connection that served is kept. An idle
        connection the partner closed since (a daemon there restarted) is tried once more on
        a new one, when it failed before any answer."""
        what = f"{header.get('op')} of {header.get('file', 'replicas')} on rank {target}"
        while True:
            chan: Channel | None = None
            reused, answered = False, False
            try:
                chan, reused = self._take(target)
                chan.send(header)
                answer = chan.recv()
                answered = True
                if "error" in answer:
                    raise StorageError(f"{what}: the partner answered {answer['error']}")
                if out is not None:
                    length = answer.get("length")
                    if length != len(out):
                        raise StorageError(f"{what}: {length!r} bytes answered, not {len(out)}")
                    chan.recv_into(out)  # its MAC checked before the load sees the bytes
            except BaseException as e:
                if chan is not None:
                    chan.close()
                if isinstance(e, StorageError) or not isinstance(e, Exception):
                    raise
                self.peers.forget(target)  # a new daemon there may have a new address
                stale = reused and not answered and not isinstance(e, TimeoutError)
                if stale and isinstance(e, OSError):
                    continue
                raise StorageError(f"{what}: {type(e).__name__}: {e}") from None
            with self._lock:
                self._idle.setdefault(target, []).append(chan)
            return answer

    def _take(self, target: int) -> tuple[Channel, bool]:
        """A connection to ``target``: an idle one (True), else a new one (False)."""
        with self._lock:
            idle = self._idle.get(target)
            if idle:
                return idle.pop(), True
        return self.peers.connect(target), False

    def write_file(self, path: str, buffers: Sequence[memoryview]) -> None:
        raise StorageError("the partners' replicas are read-only here")

    def put_atomic(self, path: str, data: bytes) -> None:
        raise StorageError("the partners' replicas are read-only here")

    def makedirs(self, path: str) -> None:
        raise StorageError("the partners' replicas are read-only here")

    def delete(self, path: str, *, recursive: bool = False) -> None:
        raise StorageError("the partners' replicas are read-only here")

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
            pool, self._pool = self._pool, None
        for chans in idle.values():
            for chan in chans:
                with contextlib.suppress(OSError):
                    chan.close()
        if pool is not None:
            pool.shutdown()
