"""Peer replicas, daemon to daemon, in one process: two hosts' tiers served by real
PeerServers on 127.0.0.1, their addresses in a real c10d store. A fetch reads each byte of a
shard once on the serving host, checks it against the crc32c its manifest names on the
receiving one, and leaves nothing behind when the bytes are not the ones committed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from aiockpt import AsyncCheckpointManager
from aiockpt._core.catalog import Catalog
from aiockpt._core.format import step_dirname
from aiockpt._daemon.peers import ADDR_ENV, Peers
from aiockpt._trainer.storeproxy import TorchStoreOps
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


def pair(a: LocalStorage, b: LocalStorage, said: list) -> tuple[Peers, Peers]:
    """Host a's rank 1 serving its tier; host b's rank 0, whose partner it is."""
    store = dist.HashStore()
    ops = TorchStoreOps(store)

    def say(name: str, step: int | None, detail: str) -> None:
        said.append((name, step, detail))

    server = Peers(a, ops, 1, [], 30.0, say)
    client = Peers(b, ops, 0, [1], 30.0, say)
    return server, client


async def test_a_fetch_reads_the_shard_once_and_lands_it_whole(tmp_path, monkeypatch):
    shard = await saved(tmp_path / "a")
    monkeypatch.setenv(ADDR_ENV, "127.0.0.1")
    a, b = CountingLocal(str(tmp_path / "a")), LocalStorage(str(tmp_path / "b"))
    os.makedirs(b.root)
    said: list = []
    server, client = pair(a, b, said)
    try:
        a.read.clear()
        client.fetch()
    finally:
        client.close()
        server.close()
    path = f"{step_dirname(3)}/{shard}"
    assert [s[0] for s in said] == ["tier.fetched"]
    assert Catalog(b).committed_steps() == [3]
    assert (tmp_path / "b" / path).read_bytes() == (tmp_path / "a" / path).read_bytes()
    assert a.read[path] == os.path.getsize(tmp_path / "a" / path)  # read once, not twice


async def test_a_replica_that_is_not_what_was_committed_is_refused(tmp_path, monkeypatch):
    shard = await saved(tmp_path / "a")
    monkeypatch.setenv(ADDR_ENV, "127.0.0.1")
    path = f"{step_dirname(3)}/{shard}"
    with open(tmp_path / "a" / path, "r+b") as f:  # rotted on host a's disk
        f.seek(4096)
        byte = f.read(1)
        f.seek(4096)
        f.write(bytes([byte[0] ^ 0xFF]))
    a, b = LocalStorage(str(tmp_path / "a")), LocalStorage(str(tmp_path / "b"))
    os.makedirs(b.root)
    said: list = []
    server, client = pair(a, b, said)
    try:
        client.fetch()
    finally:
        client.close()
        server.close()
    ((name, _, detail),) = said
    assert name == "tier.failed"
    assert "crc32c" in detail
    assert not (tmp_path / "b" / path).exists()
    assert [n for n in os.listdir(tmp_path / "b" / step_dirname(3)) if n != "manifest.json"] == []
