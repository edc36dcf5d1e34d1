"""The peer network grants no right the root does not: a real PeerServer on 127.0.0.1,
approached as an adversary would (a port scan found it, the wire format is documented).

Without the root's peer key nothing is read or written; with it, a rank may only put a copy
of its own shard to a partner of its own, never a manifest; a refused put leaves nothing;
connections are bounded and idle ones closed."""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time
from pathlib import Path

import crc32c
import pytest
import torch.distributed as dist
from test_peers import saved

from aiockpt._core.format import step_dirname
from aiockpt._core.identity import KEY_BYTES, claim_root, read_peer_key, read_root_id
from aiockpt._daemon import peers as peers_mod
from aiockpt._daemon import peerwire
from aiockpt._daemon.peers import ADDR_ENV, Peers
from aiockpt._daemon.peerview import PeerView
from aiockpt._trainer.storeproxy import TorchStoreOps
from aiockpt.errors import StorageError
from aiockpt.storage import LocalStorage

pytestmark = pytest.mark.anyio

_LEN = struct.Struct(">I")
SHARD0 = "shard_r00000.0123456789abcdef.safetensors"


class Host:
    """Host a's daemon of rank 1 (the partner of rank 0), serving its tier, and the root's
    credentials."""

    def __init__(self, tmp_path: Path) -> None:
        root = LocalStorage(str(tmp_path / "root"))
        os.makedirs(root.root)
        claim_root(root)
        rid = read_root_id(root)
        assert rid is not None
        self.key, self.root_id = read_peer_key(root), rid
        self.tier = LocalStorage(str(tmp_path / "a"))
        os.makedirs(self.tier.root, exist_ok=True)
        self.said: list = []
        self.ops = TorchStoreOps(dist.HashStore())
        self.peers = Peers(
            self.tier,
            self.ops,
            1,
            [],
            30.0,
            lambda *s: self.said.append(s),
            lambda: (self.key, self.root_id),
            [0],
        )
        host, port = self.peers.server.address().rsplit(":", 1)
        self.addr = (host, int(port))

    def raw(self) -> socket.socket:
        return socket.create_connection(self.addr, timeout=10)

    def channel(self, rank: int, key: bytes | None = None) -> peerwire.Channel:
        return peerwire.connect(self.raw(), key or self.key, self.root_id, rank)

    def close(self) -> None:
        self.peers.close()


@pytest.fixture
def host(tmp_path, monkeypatch):
    monkeypatch.setenv(ADDR_ENV, "127.0.0.1")
    h = Host(tmp_path)
    yield h
    h.close()


def send_plain(sock: socket.socket, header: dict) -> None:
    data = json.dumps(header).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_plain(sock: socket.socket) -> dict | None:
    """One frame as the documented wire has it; None where the server hung up."""
    head = sock.recv(4, socket.MSG_WAITALL)
    if len(head) < 4:
        return None
    (n,) = _LEN.unpack(head)
    return json.loads(sock.recv(n, socket.MSG_WAITALL))


def everything_under(path: str) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs + _
    )


async def test_a_read_without_the_key_is_refused(tmp_path, monkeypatch):
    await saved(tmp_path / "a")
    monkeypatch.setenv(ADDR_ENV, "127.0.0.1")
    h = Host(tmp_path)
    try:
        sock = h.raw()
        challenge = recv_plain(sock)
        assert challenge is not None
        assert challenge["op"] == "challenge"
        # The wire as it was: a request straight away.
        send_plain(sock, {"op": "read", "step": 3, "file": "manifest.json", "start": 0, "end": 64})
        answer = recv_plain(sock)
        assert answer is not None
        assert "authentication failed" in answer["error"]
        assert sock.recv(1) == b""  # and it hung up
        sock.close()
        sock = h.raw()
        recv_plain(sock)
        send_plain(sock, {"op": "list", "rank": 0})
        assert "error" in (recv_plain(sock) or {"error": "hung up"})
        sock.close()
    finally:
        h.close()


def test_a_client_with_a_wrong_key_is_refused_and_learns_nothing(host):
    with pytest.raises(peerwire.AuthError, match="refused"):
        host.channel(0, key=os.urandom(KEY_BYTES))
    # Nor can one replay the proof of another connection: each challenge is new.
    sock = host.raw()
    first = recv_plain(sock)
    sock2 = host.raw()
    second = recv_plain(sock2)
    assert first is not None
    assert second is not None
    assert first["nonce"] != second["nonce"]
    sock.close()
    sock2.close()


def test_a_server_without_the_key_is_not_believed(host, tmp_path):
    """Mutual: a client checks the server's proof too (a rogue server cannot feed a load)."""
    rogue = socket.create_server(("127.0.0.1", 0))
    addr = rogue.getsockname()[:2]

    def serve() -> None:
        conn, _ = rogue.accept()
        send_plain(conn, {"op": "challenge", "root": host.root_id, "nonce": os.urandom(32).hex()})
        recv_plain(conn)
        send_plain(conn, {"ok": True, "proof": os.urandom(32).hex()})
        conn.close()

    t = threading.Thread(target=serve)
    t.start()
    try:
        with pytest.raises(peerwire.AuthError, match="did not prove"):
            peerwire.connect(socket.create_connection(addr, timeout=10), host.key, host.root_id, 0)
    finally:
        t.join()
        rogue.close()


def test_another_roots_key_is_refused(host, tmp_path):
    other = LocalStorage(str(tmp_path / "other"))
    os.makedirs(other.root)
    claim_root(other)
    other_id = read_root_id(other)
    assert other_id is not None
    with pytest.raises(peerwire.AuthError, match="serves root"):
        peerwire.connect(host.raw(), read_peer_key(other), other_id, 0)


def put(
    chan: peerwire.Channel, step: int, name: str, data: bytes, *, body: bool = True, **over: object
) -> dict:
    """A put and its answer. ``body=False``: the header alone, for one the server refuses
    on its header (it answers before it reads a body, and hangs up)."""
    crc = crc32c.crc32c(data)
    head = {"op": "put", "step": step, "file": name, "size": len(data), "crc32c": crc, **over}
    try:
        chan.send(head, [data] if body else None)
        return chan.recv()
    finally:
        chan.close()


def test_a_partner_puts_its_own_shard(host):
    answer = put(host.channel(0), 7, SHARD0, b"x" * 1000)
    assert answer == {"ok": True, "fresh": True}
    assert (Path(host.tier.root) / step_dirname(7) / SHARD0).read_bytes() == b"x" * 1000


@pytest.mark.parametrize(
    ("rank", "name", "why"),
    [
        (0, "manifest.json", "never copied"),  # a forged step's commit
        (0, "shard_r00001.0123456789abcdef.safetensors", "not a file of rank 0"),
        (2, "shard_r00002.0123456789abcdef.safetensors", "does not replicate"),  # no partner
        (0, "../../escape", "not a file of rank 0"),
    ],
)
def test_a_put_that_is_not_a_partners_own_shard_is_refused_and_leaves_nothing(
    host, rank, name, why
):
    answer = put(host.channel(rank), 9, name, b'{"format": "aiockpt"}', body=False)
    assert why in answer["error"]
    assert everything_under(host.tier.root) == []  # not even a step directory


def test_a_put_of_a_bad_size_or_body_leaves_nothing(host):
    answer = put(host.channel(0), 9, SHARD0, b"abc", body=False, size=-1)
    assert "not a non-negative int" in answer["error"]
    assert put(host.channel(0), 9, SHARD0, b"abc", crc32c=1)["error"]  # crc32c mismatch
    assert everything_under(host.tier.root) == []
    # A body altered on the way (its MAC wrong): never linked into place.
    chan = host.channel(0)
    data = b"y" * 5000
    head = {
        "op": "put",
        "step": 9,
        "file": SHARD0,
        "size": len(data),
        "crc32c": crc32c.crc32c(data),
    }
    chan.send(head)  # the header alone, then a body with a forged MAC
    chan.sock.sendall(data + os.urandom(32))
    assert "MAC is wrong" in chan.recv()["error"]  # answered once the file was cleared
    chan.close()
    assert everything_under(host.tier.root) == []


def test_a_message_replayed_on_another_connection_is_refused(host):
    """A recorded authenticated request, sent again on a new connection, fails its MAC."""
    chan = host.channel(0)
    sent: list[bytes] = []
    chan.sock = _Tap(chan.sock, sent)  # type: ignore[assignment]
    chan.send({"op": "list", "rank": 0})
    assert chan.recv()["ok"]
    chan.close()
    other = host.channel(0)
    other.sock.sendall(b"".join(sent))
    other.sock.settimeout(10)
    data = b""
    while chunk := other.sock.recv(1 << 16):
        data += chunk
    assert b'"steps"' not in data  # no answer: hung up
    other.close()


class _Tap:
    """A socket whose sent bytes are kept (a recording adversary)."""

    def __init__(self, sock: socket.socket, sent: list[bytes]) -> None:
        self._sock = sock
        self._sent = sent

    def sendall(self, data: bytes) -> None:
        self._sent.append(bytes(data))
        self._sock.sendall(data)

    def __getattr__(self, name: str) -> object:
        return getattr(self._sock, name)


def test_reads_serve_the_connected_ranks_files_alone(host, tmp_path):
    d = Path(host.tier.root) / step_dirname(5)
    d.mkdir()
    (d / "shard_r00003.0123456789abcdef.safetensors").write_bytes(b"z" * 10)
    chan = host.channel(0)
    chan.send(
        {
            "op": "read",
            "step": 5,
            "file": "shard_r00003.0123456789abcdef.safetensors",
            "start": 0,
            "end": 10,
        }
    )
    assert "not a file of rank 0" in chan.recv()["error"]
    chan.close()


def test_connections_are_bounded_and_idle_ones_closed(tmp_path, monkeypatch):
    monkeypatch.setenv(ADDR_ENV, "127.0.0.1")
    monkeypatch.setattr(peers_mod, "MAX_CONNECTIONS", 2)
    monkeypatch.setattr(peers_mod, "HANDSHAKE_TIMEOUT", 0.5)
    h = Host(tmp_path)
    try:
        held = [h.raw(), h.raw()]
        for s in held:
            assert recv_plain(s) is not None  # challenged
        extra = h.raw()
        assert recv_plain(extra) is None  # over the bound: closed as it came
        extra.close()
        t0 = time.monotonic()
        for s in held:  # they never answered the challenge: closed
            assert s.recv(1) == b""
            s.close()
        assert time.monotonic() - t0 < 10
        again = h.raw()  # their slots are free again
        assert recv_plain(again) is not None
        again.close()
    finally:
        h.close()


def test_the_view_of_a_partner_needs_the_same_root(tmp_path, monkeypatch, host):
    """A rank of another root (another key and id) lists nothing from this host."""
    other = LocalStorage(str(tmp_path / "other"))
    os.makedirs(other.root)
    claim_root(other)
    oid = read_root_id(other)
    assert oid is not None
    b = LocalStorage(str(tmp_path / "b"))
    os.makedirs(b.root)
    said: list = []
    client = Peers(
        b,
        host.ops,
        0,
        [1],
        5.0,
        lambda *s: said.append(s),
        lambda: (read_peer_key(other), oid),
        [1],
    )
    view = PeerView(client, lambda *s: said.append(s))
    try:
        view.refresh()
        assert view.list_dir("") == []
        assert any("serves root" in str(s) for s in said)
        with pytest.raises(StorageError):
            view.read_range(f"{step_dirname(3)}/manifest.json", 0, 1)
    finally:
        view.close()
        client.close()
