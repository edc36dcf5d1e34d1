"""Peer replicas, daemon to daemon, in one process: two hosts' tiers served by real
PeerServers on 127.0.0.1, their addresses in a real c10d store. A rank's view of its
partner's replicas lists the steps holding its shard, reads any byte range of their manifests
and shards, concurrently, each byte once on the serving host, and fails with a StorageError,
never a hang, when the partner goes away or answers nothing."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from aiockpt import AsyncCheckpointManager
from aiockpt._core.format import step_dirname
from aiockpt._core.identity import claim_root, read_peer_key, read_root_id
from aiockpt._daemon import peerview
from aiockpt._daemon.peers import ADDR_ENV, Credentials, Peers
from aiockpt._daemon.peerview import PeerView
from aiockpt._trainer.storeproxy import TorchStoreOps
from aiockpt.errors import StorageError
from aiockpt.storage import LocalStorage

pytestmark = pytest.mark.anyio


class CountingLocal(LocalStorage):
    """A tier whose reads are counted, by file."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.read: dict[str, int] = {}

    def readinto(self, path: str, offset: int, out: memoryview) -> None:
        super().readinto(path, offset, out)
        self.read[path] = self.read.get(path, 0) + len(out)


async def saved(tier: Path) -> str:
    """Step 3 saved into ``tier`` by one process: rank 0's shard, whose name is returned."""
    async with AsyncCheckpointManager(tier) as mgr:
        state = {"w": torch.arange(3 << 20, dtype=torch.float32), "step": 3}
        await (await mgr.save(3, state))
    (shard,) = [n for n in os.listdir(tier / step_dirname(3)) if n.startswith("shard_r00000.")]
    return shard


def credentials(root: Path) -> Credentials:
    """The peer key and id of a root made at ``root`` (as its first writable open makes them)."""
    storage = LocalStorage(str(root))
    os.makedirs(storage.root, exist_ok=True)
    claim_root(storage)

    def get() -> tuple[bytes, str]:
        rid = read_root_id(storage)
        assert rid is not None
        return read_peer_key(storage), rid

    return get


def serving(
    a: LocalStorage, ops: TorchStoreOps, said: list, creds: Credentials, timeout: float = 30.0
) -> Peers:
    """Host a's rank 1, serving its tier; the partner of rank 0, whose copies it takes."""
    return Peers(a, ops, 1, [], timeout, lambda *s: said.append(s), creds, [0])


def pair(
    a: LocalStorage, b: LocalStorage, said: list, timeout: float = 30.0
) -> tuple[Peers, Peers]:
    """Host a's rank 1 serving its tier; host b's rank 0, whose partner it is."""
    store = dist.HashStore()
    ops = TorchStoreOps(store)

    def say(name: str, step: int | None, detail: str) -> None:
        said.append((name, step, detail))

    creds = credentials(Path(a.root).parent / "root")
    server = Peers(a, ops, 1, [], timeout, say, creds, [0])
    client = Peers(b, ops, 0, [1], timeout, say, creds, [1])
    return server, client


def view_of(client: Peers, said: list) -> PeerView:
    return PeerView(client, lambda name, step, detail: said.append((name, step, detail)))


async def test_the_view_reads_what_the_partner_holds_of_this_rank(tmp_path, monkeypatch):
    shard = await saved(tmp_path / "a")
    monkeypatch.setenv(ADDR_ENV, "127.0.0.1")
    monkeypatch.setattr(peerview, "PIECE", 1 << 20)  # a shard's read in 12 pieces
    a, b = CountingLocal(str(tmp_path / "a")), LocalStorage(str(tmp_path / "b"))
    os.makedirs(b.root)
    said: list = []
    server, client = pair(a, b, said)
    view = view_of(client, said)
    path, manifest = f"{step_dirname(3)}/{shard}", f"{step_dirname(3)}/manifest.json"
    data = (tmp_path / "a" / path).read_bytes()
    try:
        assert view.list_dir("") == [step_dirname(3)]
        assert view.list_dir(step_dirname(3)) == sorted(["manifest.json", shard])
        assert view.exists(path)
        assert view.exists(manifest)
        assert not view.exists(f"{step_dirname(3)}/shard_r00001.x")
        assert not view.exists("x")
        assert view.size(path) == len(data)
        assert (
            view.read_range(manifest, 0, view.size(manifest))
            == (tmp_path / "a" / manifest).read_bytes()
        )
        assert view.read_range(path, 4097, 123457) == data[4097:123457]
        a.read.clear()
        outs = [bytearray(len(data)) for _ in range(3)]
        readers = [
            threading.Thread(target=view.readinto, args=(path, 0, memoryview(out))) for out in outs
        ]
        for t in readers:
            t.start()
        for t in readers:
            t.join()
        assert all(out == data for out in outs)
        assert a.read[path] == 3 * len(data)  # each byte once a read, no more
        with pytest.raises(StorageError, match="not a range"):
            view.read_range(path, len(data) - 1, len(data) + 1)
        with pytest.raises(StorageError, match="no partner holds"):
            view.read_range(f"{step_dirname(4)}/manifest.json", 0, 1)
        assert view.read_range(path, 0, 16) == data[:16]  # the pool survives an answered error
    finally:
        view.close()
        client.close()
        server.close()
    assert said == []
    assert os.listdir(tmp_path / "b") == []  # nothing written on the reading host


class FailingLocal(LocalStorage):
    """A tier whose disk fails after the first MiB of a shard: its server hangs up mid-file."""

    def readinto(self, path: str, offset: int, out: memoryview) -> None:
        if "shard_" in path and offset + len(out) > 1 << 20:
            raise OSError("the partner's disk is gone")
        super().readinto(path, offset, out)


async def test_a_partner_lost_mid_read_is_a_storage_error(tmp_path, monkeypatch):
    shard = await saved(tmp_path / "a")
    monkeypatch.setenv(ADDR_ENV, "127.0.0.1")
    a, b = FailingLocal(str(tmp_path / "a")), LocalStorage(str(tmp_path / "b"))
    os.makedirs(b.root)
    said: list = []
    server, client = pair(a, b, said)
    view = view_of(client, said)
    path = f"{step_dirname(3)}/{shard}"
    try:
        size = view.size(path)
        with pytest.raises(StorageError, match="rank 1"):
            view.read_range(path, 0, size)  # the header came, then the partner hung up
        server.server.shutdown()  # the partner's daemon gone: its idle connections with it
        server.server.server_close()
        for chan in [c for chans in view._idle.values() for c in chans]:
            chan.sock.shutdown(socket.SHUT_RDWR)
        with pytest.raises(StorageError, match="rank 1"):
            view.read_range(path, 0, 16)
        with pytest.raises(StorageError, match="rank 1"):
            view.read_range(path, 0, 16)  # a new connection, refused
    finally:
        view.close()
        client.close()


async def test_a_partner_that_answers_nothing_times_out(tmp_path, monkeypatch):
    await saved(tmp_path / "a")
    monkeypatch.setenv(ADDR_ENV, "127.0.0.1")
    a, b = LocalStorage(str(tmp_path / "a")), LocalStorage(str(tmp_path / "b"))
    os.makedirs(b.root)
    said: list = []
    server, client = pair(a, b, said, timeout=0.5)
    view = view_of(client, said)
    mute = socket.create_server(("127.0.0.1", 0))  # takes connections, answers nothing
    try:
        view.refresh()  # the real partner's holdings, then it is replaced by a mute one
        client._addrs[1] = mute.getsockname()[:2]
        view.close()
        with pytest.raises(StorageError, match="timed out"):
            view.read_range(f"{step_dirname(3)}/manifest.json", 0, 16)
        client._addrs[1] = mute.getsockname()[:2]  # forgotten after the failure: again
        view.refresh()  # a listing without the partner: it holds nothing for now
        assert view.list_dir("") == []
        assert [name for name, _, _ in said] == ["tier.failed"]
    finally:
        mute.close()
        view.close()
        client.close()
        server.close()


async def test_a_partner_restarted_is_read_on_a_new_connection(tmp_path, monkeypatch):
    await saved(tmp_path / "a")
    monkeypatch.setenv(ADDR_ENV, "127.0.0.1")
    a, b = LocalStorage(str(tmp_path / "a")), LocalStorage(str(tmp_path / "b"))
    os.makedirs(b.root)
    said: list = []
    ops = TorchStoreOps(dist.HashStore())
    creds = credentials(tmp_path / "root")
    server = serving(a, ops, said, creds)
    client = Peers(b, ops, 0, [1], 30.0, lambda *s: said.append(s), creds, [1])
    view = view_of(client, said)
    manifest = f"{step_dirname(3)}/manifest.json"
    want = (tmp_path / "a" / manifest).read_bytes()[:64]
    try:
        assert view.read_range(manifest, 0, 64) == want
        server.close()  # host a's daemon restarts: its connections end, its address changes
        for chan in [c for chans in view._idle.values() for c in chans]:
            chan.sock.shutdown(socket.SHUT_RDWR)
        server = serving(a, ops, said, creds)
        assert view.read_range(manifest, 0, 64) == want
    finally:
        view.close()
        client.close()
        server.close()
    assert said == []
