"""Peer replicas of a local tier (``LocalTier(replicas=k)``, see docs/tiers.md).

Each daemon of a job with a local tier on several hosts runs a small TCP server (a thread of
this module's :class:`PeerServer`) over its host's tier, and publishes its address in the
job's c10d store, which it reaches through the trainer's relay (``_core/storeops.py``): the
daemon stays torch-free. Once a rank's shard of a step is committed in its own host's tier,
its daemon sends a copy to the daemons of its ``k`` partners (:func:`partners`: the same
local rank on each of the next ``k`` hosts, round robin), which write it into their tiers'
step directories: streamed, checked against the shard's crc32c before it is linked into
place, never over a file that is there. A replacement host, its tier empty, reads its ranks'
shards from its partners as it loads them (``peerview.py``), without copying them.

The wire: each message is a 4-byte big-endian length, a JSON header of that length, and,
where the header has ``size``, that many raw bytes; ``crc32c`` in the header is theirs.
Requests: ``put`` (a shard copy), ``list`` (the steps whose shard of a rank this tier holds),
``read`` (a byte range of a step's manifest or shard, and the file's size). Answers:
``{"ok": true, ...}`` or ``{"error"}``, after which the server hangs up.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import socketserver
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from .._core import format as fmt
from .._core.catalog import Catalog
from .._core.storeops import StoreOps
from ..errors import CheckpointError, StorageError
from ..storage._local import LocalStorage

__all__ = ["PeerServer", "Peers", "partners"]

#: The environment variable naming the address this host's daemons serve replicas on.
ADDR_ENV = "AIOCKPT_TIER_ADDR"

#: How many bytes a copy moves at a time: its memory, whatever the shard's size.
CHUNK = 8 << 20

#: The store key of a rank's daemon's address.
_KEY = "aiockpt/tier-peer/{rank}"

_LEN = struct.Struct(">I")


class BinaryIO(Protocol):
    """What the wire reads from: a socket's file."""

    def read(self, n: int, /) -> bytes: ...


#: What the peers' work says: (event name, step, detail).
Say = Callable[[str, int | None, str], None]


def partners(hosts: tuple[str, ...], rank: int, k: int) -> list[int]:
    """The ranks that hold copies of ``rank``'s shards: on each of the next ``k`` hosts (in
    the order of their first ranks, round robin), the rank of the same local index (modulo
    that host's rank count). Fewer where there are not ``k`` other hosts."""
    order: list[str] = []
    for h in hosts:
        if h not in order:
            order.append(h)
    ranks = {h: [r for r, x in enumerate(hosts) if x == h] for h in order}
    mine = order.index(hosts[rank])
    index = ranks[hosts[rank]].index(rank)
    out = []
    for j in range(1, min(k, len(order) - 1) + 1):
        there = ranks[order[(mine + j) % len(order)]]
        out.append(there[index % len(there)])
    return out


# ------------------------------------------------------------------------------- the wire


def send_msg(sock: socket.socket, header: dict[str, Any], body: bytes = b"") -> None:
    data = json.dumps(header).encode()
    sock.sendall(_LEN.pack(len(data)) + data + body)


def _exact(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise ConnectionError("the peer closed the connection mid-message")
    return data


def recv_msg(f: BinaryIO) -> dict[str, Any]:
    (n,) = _LEN.unpack(_exact(f, _LEN.size))
    header = json.loads(_exact(f, n))
    if not isinstance(header, dict):
        raise ConnectionError("a peer's message is not a JSON object")
    return header


def receive_file(f: BinaryIO, storage: LocalStorage, path: str, size: int, crc: int) -> bool:
    """Stream ``size`` bytes from ``f`` into ``path`` of ``storage``
    (:meth:`LocalStorage.receive`: a temporary file, synced, checked against ``crc``, then
    linked into place, never over a file that is there: False then). A crc mismatch is a
    :class:`StorageError`, nothing left behind."""
    if size < 0:
        raise StorageError(f"{path}: a size of {size} bytes")
    return storage.receive(path, _pieces(f, size), crc)


def _pieces(f: BinaryIO, size: int) -> Iterator[bytes]:
    """``size`` bytes of ``f``, ``CHUNK`` at most at a time."""
    left = size
    while left:
        piece = f.read(min(CHUNK, left))
        if not piece:
            raise ConnectionError("the peer closed the connection mid-file")
        yield piece
        left -= len(piece)


def send_file(sock: socket.socket, storage: LocalStorage, path: str, start: int, end: int) -> None:
    """The bytes ``[start, end)`` of ``path`` on ``sock``, ``CHUNK`` at a time, through one
    buffer."""
    buf = memoryview(bytearray(min(CHUNK, end - start)))
    at = start
    while at < end:
        piece = buf[: min(end - at, CHUNK)]
        storage.readinto(path, at, piece)
        sock.sendall(piece)
        at += len(piece)


def checked_path(step: Any, name: Any) -> str:
    """``step``'s file ``name``, where it is a manifest or a shard: nothing else is served."""
    if type(step) is not int or step < 0 or not isinstance(name, str):
        raise StorageError(f"not a step's file: {step!r}, {name!r}")
    if name != fmt.MANIFEST and not (name.startswith("shard_") and "/" not in name):
        raise StorageError(f"not a step's file: {name!r}")
    if ".." in name or "\0" in name:
        raise StorageError(f"not a step's file: {name!r}")
    return f"{fmt.step_dirname(step)}/{name}"


# ----------------------------------------------------------------------------- the server


class _Handler(socketserver.StreamRequestHandler):
    server: PeerServer

    def handle(self) -> None:
        while True:
            try:
                req = recv_msg(self.rfile)
            except (ConnectionError, OSError, struct.error, ValueError):
                return
            try:
                self.server.answer(req, self.rfile, self.connection)
            except Exception as e:  # the stream may be mid-message: answer, then hang up
                with contextlib.suppress(OSError):
                    send_msg(self.connection, {"error": f"{type(e).__name__}: {e}"})
                return


class PeerServer(socketserver.ThreadingTCPServer):
    """Serves this host's tier to the daemons of other hosts: copies in, reads out."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: str, storage: LocalStorage) -> None:
        super().__init__((address, 0), _Handler)
        self.storage = storage
        self.catalog = Catalog(storage)
        self.thread = threading.Thread(
            target=self.serve_forever, name="aiockpt-tier-peers", daemon=True
        )

    def address(self) -> str:
        host, port = self.server_address[:2]
        name = host.decode() if isinstance(host, bytes) else host
        return f"{name}:{port}"

    def answer(self, req: dict[str, Any], rfile: BinaryIO, sock: socket.socket) -> None:
        op = req.get("op")
        if op == "put":
            path = checked_path(req.get("step"), req.get("file"))
            self.storage.makedirs(fmt.step_dirname(req["step"]))
            fresh = receive_file(rfile, self.storage, path, int(req["size"]), int(req["crc32c"]))
            send_msg(sock, {"ok": True, "fresh": fresh})
        elif op == "list":
            send_msg(sock, {"ok": True, "steps": self.holding(int(req["rank"]))})
        elif op == "read":
            path = checked_path(req.get("step"), req.get("file"))
            start, end = req.get("start"), req.get("end")
            size = self.storage.size(path)
            if type(start) is not int or type(end) is not int or not 0 <= start <= end <= size:
                raise StorageError(f"{path}: {start!r}..{end!r} is not a range of its {size} bytes")
            send_msg(sock, {"ok": True, "size": size, "length": end - start})
            send_file(sock, self.storage, path, start, end)
        else:
            send_msg(sock, {"error": f"not a peer request: {op!r}"})

    def holding(self, rank: int) -> list[list[Any]]:
        """The committed steps of this tier that hold ``rank``'s shard: [step, file, crc]."""
        out = []
        for step in self.catalog.committed_steps():
            try:
                shard = self.catalog.read_manifest(step, lazy=True).shard_of(rank)
            except (CheckpointError, KeyError):
                continue
            if self.storage.exists(f"{fmt.step_dirname(step)}/{shard.file}"):
                out.append([step, shard.file, shard.crc32c])
        return out


# ----------------------------------------------------------------------------- the client


class Peers:
    """A daemon's side of the replicas: its server, its partners and the copies it sends
    (what it reads of theirs: ``peerview.py``)."""

    def __init__(
        self,
        storage: LocalStorage,
        ops: StoreOps,
        rank: int,
        targets: list[int],
        timeout: float,
        say: Say,
    ) -> None:
        self.storage = storage
        self.ops = ops
        self.rank = rank
        self.targets = targets
        self.timeout = timeout
        self.say = say
        self.server = PeerServer(bind_address(), storage)
        self.server.thread.start()
        self._addrs: dict[int, tuple[str, int]] = {}
        key = _KEY.format(rank=rank)
        self.ops.delete([key])  # an earlier manager's in this job
        self.ops.set_if_absent([key], self.server.address().encode())

    @staticmethod
    def unreachable(ops: StoreOps, rank: int) -> None:
        """Say, in the store, that ``rank`` serves no replicas: its partners fail at once
        rather than wait for its address."""
        key = _KEY.format(rank=rank)
        with contextlib.suppress(Exception):
            ops.delete([key])
            ops.set_if_absent([key], b"")

    def _addr(self, rank: int) -> tuple[str, int]:
        if rank not in self._addrs:
            key = _KEY.format(rank=rank)
            self.ops.wait([key], self.timeout)
            (raw,) = self.ops.get([key])
            host, _, port = raw.decode().rpartition(":")
            self._addrs[rank] = (host, int(port))
        return self._addrs[rank]

    def connect(self, rank: int) -> socket.socket:
        """A new connection to ``rank``'s daemon, whose operations time out after the job's
        ``dist_timeout``."""
        return socket.create_connection(self._addr(rank), timeout=self.timeout)

    def forget(self, rank: int) -> None:
        """Look ``rank``'s address up again next time: a new daemon there may have another."""
        self._addrs.pop(rank, None)

    def replicate(self, step: int, name: str, crc: int) -> None:
        """Send this rank's shard ``name`` of ``step``, durable in this host's tier, to each
        partner; a ``tier.replicated`` event for each copy in place, ``tier.failed`` for
        each not (a replica never fails a save)."""
        path = f"{fmt.step_dirname(step)}/{name}"
        try:
            size = self.storage.size(path)
        except (OSError, StorageError) as e:
            self.say("tier.failed", step, f"no replica of step {step}: {e}")
            return
        for target in self.targets:
            try:
                with self.connect(target) as sock:
                    head = {"op": "put", "step": step, "file": name, "size": size}
                    send_msg(sock, {**head, "crc32c": crc})
                    send_file(sock, self.storage, path, 0, size)
                    answer = recv_msg(sock.makefile("rb"))
                if "error" in answer:
                    raise StorageError(answer["error"])
                self.say("tier.replicated", step, f"{name} to rank {target}")
            except Exception as e:
                self.forget(target)
                why = f"{type(e).__name__}: {e}"
                self.say("tier.failed", step, f"replica of {name} to rank {target}: {why}")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def bind_address() -> str:
    """The address this daemon serves on: ``$AIOCKPT_TIER_ADDR`` where set, else the
    address the hostname resolves to, else the loopback (one host)."""
    env = os.environ.get(ADDR_ENV)
    if env:
        return env
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
