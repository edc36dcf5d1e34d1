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

Every connection is authenticated both ways with the root's peer key, and every message
after that carries a MAC (``peerwire.py``): only a holder of the key, which whoever can read
the root holds, can connect, and a connection grants no right the root does not. Requests:
``put`` (a copy of the sending rank's own shard, to a partner of that rank by the partner
map: never a manifest, never another rank's file), ``list`` (the steps whose shard of the
connected rank this tier holds), ``read`` (a byte range of a step's manifest or of the
connected rank's shard, and the file's size). Answers: ``{"ok": true, ...}`` or
``{"error"}``, after which the server hangs up. The server serves a bounded number of
connections at once and closes one idle for :data:`IDLE_TIMEOUT` seconds.
"""

from __future__ import annotations

import contextlib
import os
import socket
import socketserver
import struct
import threading
from collections.abc import Callable, Collection, Iterator
from typing import Any

from .._core import format as fmt
from .._core.catalog import Catalog
from .._core.storeops import StoreOps
from ..errors import CheckpointError, StorageError
from ..storage._local import LocalStorage
from . import peerwire
from .peerwire import Channel

__all__ = ["PeerServer", "Peers", "partners"]

#: The environment variable naming the address this host's daemons serve replicas on.
ADDR_ENV = "AIOCKPT_TIER_ADDR"

#: How many bytes a copy moves at a time: its memory, whatever the shard's size.
CHUNK = 8 << 20

#: Seconds a connection may take to authenticate, and may then stay idle, before the server
#: closes it.
HANDSHAKE_TIMEOUT = 10.0
IDLE_TIMEOUT = 120.0

#: How many connections the server serves at once; one more is closed as it comes.
MAX_CONNECTIONS = 64

#: The store key of a rank's daemon's address.
_KEY = "aiockpt/tier-peer/{rank}"

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


#: What gives a daemon its root's peer key and id, read from the root when first needed.
Credentials = Callable[[], tuple[bytes, str]]


def file_pieces(storage: LocalStorage, path: str, start: int, end: int) -> Iterator[memoryview]:
    """The bytes ``[start, end)`` of ``path``, ``CHUNK`` at a time through one buffer (each
    piece is valid until the next is asked for)."""
    buf = memoryview(bytearray(min(CHUNK, end - start)))
    at = start
    while at < end:
        piece = buf[: min(end - at, CHUNK)]
        storage.readinto(path, at, piece)
        yield piece
        at += len(piece)


def step_file(step: Any, name: Any, rank: int) -> str:
    """``step``'s file ``name`` where it is its manifest or a shard of ``rank``: nothing
    else is served or taken."""
    if type(step) is not int or step < 0 or not isinstance(name, str):
        raise StorageError(f"not a step's file: {step!r}, {name!r}")
    if name != fmt.MANIFEST:
        parsed = fmt.parse_shard_filename(name)
        if parsed is None or parsed[0] != rank:
            raise StorageError(f"not a file of rank {rank}: {name!r}")
    return f"{fmt.step_dirname(step)}/{name}"


def _count(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise StorageError(f"{what} {value!r} is not a non-negative int")
    return value


# ----------------------------------------------------------------------------- the server


class _Handler(socketserver.BaseRequestHandler):
    server: PeerServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(HANDSHAKE_TIMEOUT)
        try:
            key, root_id = self.server.credentials()
            chan = peerwire.accept(sock, key, root_id)
        except Exception:  # no proof, no key here yet, a silent client: hang up
            return
        sock.settimeout(self.server.idle_timeout)
        while True:
            try:
                req = chan.recv()
            except (ConnectionError, OSError, struct.error, ValueError):
                return
            try:
                self.server.answer(req, chan)
            except Exception as e:  # the stream may be mid-message: answer, then hang up
                with contextlib.suppress(OSError):
                    chan.send({"error": f"{type(e).__name__}: {e}"})
                return


class PeerServer(socketserver.ThreadingTCPServer):
    """Serves this host's tier to the daemons of other hosts that prove the root's key:
    copies in from the ranks this host's rank is a partner of, reads out of what the
    connected rank may load."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        address: str,
        storage: LocalStorage,
        credentials: Credentials,
        senders: Collection[int],
        *,
        idle_timeout: float = 0.0,
    ) -> None:
        super().__init__((address, 0), _Handler)
        self.storage = storage
        self.catalog = Catalog(storage)
        self.credentials = credentials
        #: The ranks whose shards this rank keeps copies of (its partners by the map).
        self.senders = frozenset(senders)
        self.idle_timeout = idle_timeout or IDLE_TIMEOUT
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._lock = threading.Lock()
        self._putting: dict[int, int] = {}  # step: puts under way into its directory
        self.thread = threading.Thread(
            target=self.serve_forever, name="aiockpt-tier-peers", daemon=True
        )

    def address(self) -> str:
        host, port = self.server_address[:2]
        name = host.decode() if isinstance(host, bytes) else host
        return f"{name}:{port}"

    def process_request(self, request: Any, client_address: Any) -> None:
        # At most MAX_CONNECTIONS at once: one more is closed as it comes.
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def answer(self, req: dict[str, Any], chan: Channel) -> None:
        op = req.get("op")
        if op == "put":
            self.put(req, chan)
        elif op == "list":
            chan.send({"ok": True, "steps": self.holding(chan.rank)})
        elif op == "read":
            path = step_file(req.get("step"), req.get("file"), chan.rank)
            start, end = req.get("start"), req.get("end")
            size = self.storage.size(path)
            if type(start) is not int or type(end) is not int or not 0 <= start <= end <= size:
                raise StorageError(f"{path}: {start!r}..{end!r} is not a range of its {size} bytes")
            chan.send(
                {"ok": True, "size": size, "length": end - start},
                file_pieces(self.storage, path, start, end),
            )
        else:
            chan.send({"error": f"not a peer request: {op!r}"})

    def put(self, req: dict[str, Any], chan: Channel) -> None:
        """A partner's copy of its own shard: taken only from a rank this one is a partner
        of, checked whole (its MAC and crc32c) before it is linked into place; a refused or
        failed one leaves nothing, not even the step directory it would have made."""
        if chan.rank not in self.senders:
            raise StorageError(f"rank {chan.rank} does not replicate its shards to this host")
        step = _count(req.get("step"), "step")
        path = step_file(step, req.get("file"), chan.rank)
        if path.endswith("/" + fmt.MANIFEST):
            raise StorageError("a manifest is never copied: each host commits its own")
        size, crc = _count(req.get("size"), "size"), _count(req.get("crc32c"), "crc32c")
        head = fmt.step_dirname(step)
        with self._lock:
            made = not self.storage.exists(head)
            self.storage.makedirs(head)
            self._putting[step] = self._putting.get(step, 0) + 1
        ok = False
        try:
            fresh = self.storage.receive(path, chan.pieces(size), crc)
            ok = True
        finally:
            with self._lock:
                self._putting[step] -= 1
                if not self._putting[step]:
                    del self._putting[step]
                    if made and not ok:  # rmdir(2): never anything in it, nor a link
                        with contextlib.suppress(OSError):
                            os.rmdir(os.path.join(self.storage.root, head))
        chan.send({"ok": True, "fresh": fresh})

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
        credentials: Credentials,
        senders: Collection[int],
    ) -> None:
        self.storage = storage
        self.ops = ops
        self.rank = rank
        self.targets = targets
        self.timeout = timeout
        self.say = say
        self.credentials = _cached(credentials)
        self.server = PeerServer(bind_address(), storage, self.credentials, senders)
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

    def connect(self, rank: int) -> Channel:
        """A new connection to ``rank``'s daemon, authenticated both ways, whose operations
        time out after the job's ``dist_timeout``."""
        key, root_id = self.credentials()
        sock = socket.create_connection(self._addr(rank), timeout=self.timeout)
        return peerwire.connect(sock, key, root_id, self.rank)

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
                chan = self.connect(target)
                try:
                    head = {"op": "put", "step": step, "file": name, "size": size}
                    chan.send({**head, "crc32c": crc}, file_pieces(self.storage, path, 0, size))
                    answer = chan.recv()
                finally:
                    chan.close()
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


def _cached(credentials: Credentials) -> Credentials:
    """``credentials``, asked until they are had once, then kept (a daemon may start before
    the root's writer has made its key; no connection is made or taken before then)."""
    kept: list[tuple[bytes, str]] = []
    lock = threading.Lock()

    def get() -> tuple[bytes, str]:
        with lock:
            if not kept:
                kept.append(credentials())
            return kept[0]

    return get


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
