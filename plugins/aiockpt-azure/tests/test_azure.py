"""The Azure plugin against a real Azure Blob server (azurite on 127.0.0.1)."""

from __future__ import annotations

import errno
import gc
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from _azserver import AzuriteServer, why_not

import aiockpt_azure
from aiockpt import AsyncCheckpointManager
from aiockpt.errors import LeaseLostError, RootLockedError, StorageError
from aiockpt.retention import LatestN
from aiockpt.storage import open_storage
from aiockpt.storage.testing import Relay, StorageContract

_SKIP = why_not()
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")

MiB = 1024 * 1024
# Small blocks so a few MiB are staged in blocks; fast retries so failures are quick.
FAST = {
    "block_size": 2 * MiB,
    "single_put_threshold": 4 * MiB,
    "backoff": 0.02,
    "retries": 2,
}


@pytest.fixture(scope="module")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AzuriteServer]:
    server = AzuriteServer(tmp_path_factory.mktemp("azurite"))
    yield server
    server.stop()


@pytest.fixture
def container(azurite: AzuriteServer) -> str:
    return azurite.new_container()


class TestAzureContract(StorageContract):
    """A root under a prefix of the container."""

    large_size = 9 * MiB + 123  # five blocks of 2 MiB
    writes_in_order = True

    @pytest.fixture
    def storage_factory(self, azurite: AzuriteServer, container: str):
        return lambda: open_storage(f"az://{container}/run", azurite.options(**FAST))


class TestAzureContainerRoot(StorageContract):
    """A root at the container itself, through the abfs:// protocol name."""

    large_size = 5 * MiB
    writes_in_order = True

    @pytest.fixture
    def storage_factory(self, azurite: AzuriteServer, container: str):
        return lambda: open_storage(f"abfs://{container}", azurite.options(**FAST))


def test_az_opens_the_plugin(azurite: AzuriteServer, container: str) -> None:
    storage = open_storage(f"az://{container}/a/b", azurite.options())
    try:
        assert isinstance(storage, aiockpt_azure.AzureStorage)
        assert (storage.container, storage.prefix) == (container, "a/b")
        assert storage.options == aiockpt_azure.AzureOptions()
    finally:
        storage.close()


def test_bad_options_are_refused(azurite: AzuriteServer) -> None:
    with pytest.raises(ValueError, match="block_size"):
        open_storage("az://c/x", azurite.options(block_size=10))
    with pytest.raises(ValueError, match="concurrency"):
        open_storage("az://c/x", azurite.options(concurrency=0))
    with pytest.raises(ValueError, match="no container"):
        open_storage("az:///x", azurite.options())


def test_missing_container_is_named(azurite: AzuriteServer) -> None:
    storage = open_storage("az://no-such-container/run", azurite.options(**FAST))
    try:
        for call in (
            lambda: storage.list_dir(""),
            lambda: storage.exists("step/manifest.json"),
            lambda: storage.write_file("x", [memoryview(b"x")]),
            lambda: storage.put_if_absent("x", b"x"),
        ):
            with pytest.raises(StorageError) as info:
                call()
            assert "the container 'no-such-container' does not exist" in str(info.value)
            assert info.value.errno == errno.ENOENT
    finally:
        storage.close()


def test_connection_resets_are_retried(azurite: AzuriteServer, container: str) -> None:
    relay = Relay(azurite.port)
    options = azurite.options(relay.endpoint, **{**FAST, "retries": 4})
    storage = open_storage(f"az://{container}/run", options)
    try:
        data = bytes(range(256)) * (24 * 1024)  # 6 MiB: three staged blocks
        relay.reset_next(3)
        storage.write_file("retried.bin", [memoryview(data)])
        relay.reset_next(3)
        assert storage.read_range("retried.bin", 0, len(data)) == data
        relay.reset_next(3)
        assert storage.list_dir("") == ["retried.bin"]
    finally:
        storage.close()
        relay.close()


def test_a_stream_stops_at_its_first_failed_block(azurite: AzuriteServer, container: str) -> None:
    """The server gone: the write fails once a block has spent its retries, without cutting
    and staging the rest of the pieces (each would spend its own retries first)."""
    relay = Relay(azurite.port)
    storage = open_storage(f"az://{container}/run", azurite.options(relay.endpoint, **FAST))
    asked: list[int] = []

    def pieces() -> Iterator[memoryview]:
        buf = memoryview(bytes(2 * MiB))
        for i in range(60):
            asked.append(i)
            yield buf

    try:
        relay.reset_next(10**6)
        with pytest.raises(StorageError, match="after 3 attempts"):
            storage.write_file("step_1/shard.bin", pieces())  # type: ignore[arg-type]
    finally:
        storage.close()
        relay.close()
    # the blocks held to learn the blob needs staging, those in flight, and one taken meanwhile
    assert len(asked) <= 2 + storage.options.concurrency + 1


@pytest.mark.parametrize("size", [1000, 5 * MiB])
def test_a_create_that_meets_its_own_blob_succeeds(
    azurite: AzuriteServer, container: str, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    """A conflict to a create (Put Blob, or Put Block List for a staged blob) whose earlier
    try landed, its answer lost: the blob carries the create's own token, so the write
    succeeded; another writer's blob, without it, is EEXIST and stays as it was."""
    import aiockpt_azure._storage as impl

    tokens = {"now": "0123456789abcdef"}
    monkeypatch.setattr(impl, "write_token", lambda: {impl.TOKEN_KEY: tokens["now"]})
    storage = open_storage(f"az://{container}/run", azurite.options(**FAST))
    data = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    try:
        # the first try, whose answer we pretend was lost; then the same create again
        storage.write_file("mine.bin", [memoryview(data)])
        storage.write_file("mine.bin", [memoryview(data)])
        assert storage.read_range("mine.bin", 0, len(data)) == data
        # another writer's create: another token
        tokens["now"] = "fedcba9876543210"  # another writer's
        storage.write_file("theirs.bin", [memoryview(b"theirs")])
        tokens["now"] = "0123456789abcdef"
        with pytest.raises(StorageError) as info:
            storage.write_file("theirs.bin", [memoryview(data)])
        assert info.value.errno == errno.EEXIST
        assert f"az://{container}/run/theirs.bin" in str(info.value)
        assert storage.read_range("theirs.bin", 0, 6) == b"theirs"
        assert storage.size("theirs.bin") == 6
    finally:
        storage.close()


@pytest.mark.parametrize("failure", ["refused", "reset mid-body"])
def test_retries_are_bounded_and_a_failed_write_leaves_nothing(
    azurite: AzuriteServer, container: str, failure: str
) -> None:
    """After the last retry the write fails naming the blob, leaves no blob, and keeps no view
    of the caller's buffer: not even in a reference cycle, so the garbage collector is off (in
    the daemon, a view alive means a slab that cannot be unmapped)."""
    relay = Relay(azurite.port)
    storage = open_storage(f"az://{container}/run", azurite.options(relay.endpoint, **FAST))
    gc.collect()
    gc.disable()
    try:
        buf = bytearray(6 * MiB)  # three blocks
        view = memoryview(buf)
        if failure == "refused":
            relay.reset_next(1000)
        else:  # the first block is on its way when connections start failing
            relay.trip(MiB, lambda: relay.reset_next(1000))
        with pytest.raises(StorageError) as info:
            storage.write_file("step_1/shard.bin", [view])
        view.release()
        buf.append(0)  # no view of the buffer outlives the failed write
    finally:
        gc.enable()
        storage.close()
        relay.close()
    assert f"az://{container}/run/step_1/shard.bin" in str(info.value)
    assert "after 3 attempts" in str(info.value)
    assert azurite.names(container) == []


def _state(n: int, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "b": torch.arange(7), "step_info": {"lr": 0.1}}


@pytest.mark.anyio
async def test_manager_save_load_retention_on_azure(azurite: AzuriteServer, container: str) -> None:
    async with AsyncCheckpointManager(
        f"az://{container}/run", storage_options=azurite.options(**FAST), retention=LatestN(2)
    ) as mgr:
        for step in (1, 2, 3):
            await (await mgr.save(step, _state(2 * MiB, step)))  # 8 MiB: staged blocks
        assert await mgr.steps() == [2, 3]
        loaded = await mgr.load(3)
        expected = _state(2 * MiB, 3)
        assert torch.equal(loaded["w"], expected["w"])
        assert torch.equal(loaded["b"], expected["b"])
        assert loaded["step_info"] == {"lr": 0.1}
    names = azurite.names(container)
    manifests = [n for n in names if n.endswith("/manifest.json")]
    assert manifests == [
        "run/step_000000000002/manifest.json",
        "run/step_000000000003/manifest.json",
    ]


@pytest.mark.anyio
async def test_a_save_staged_in_windows_on_azure(azurite: AzuriteServer, container: str) -> None:
    """staging_memory below the shard's size: the blob is staged block by block as windows
    come, committed once, and loads back exactly."""
    g = torch.Generator().manual_seed(3)
    state = {f"t{i}": torch.randn(50_000, generator=g) for i in range(120)}  # 23 MiB
    async with AsyncCheckpointManager(
        f"az://{container}/run", storage_options=azurite.options(**FAST), staging_memory=8 << 20
    ) as mgr:
        await (await mgr.save(1, state))
        assert mgr._pool.peak <= 8 << 20
        loaded = await mgr.load(1)
    for k, v in state.items():
        assert torch.equal(loaded[k], v), k


@pytest.mark.anyio
async def test_one_writer_per_azure_root(azurite: AzuriteServer, container: str) -> None:
    url, options = f"az://{container}/run", azurite.options(**FAST)
    async with AsyncCheckpointManager(url, storage_options=options) as first:
        await (await first.save(1, _state(1024, 1)))
        with pytest.raises(RootLockedError, match="is leased by this process"):
            async with AsyncCheckpointManager(url, storage_options=options):
                pass
        async with AsyncCheckpointManager(url, storage_options=options, takeover=True) as second:
            with pytest.raises(LeaseLostError):
                await (await first.save(2, _state(1024, 2)))
            await (await second.save(3, _state(1024, 3)))
            assert await second.steps() == [1, 3]
    names = azurite.names(container)
    assert not [n for n in names if n.startswith("run/step_000000000002")]


@pytest.mark.anyio
async def test_server_stopped_in_the_middle_of_an_upload(tmp_path: Path) -> None:
    """azurite is stopped while a shard's blocks are on their way: the save fails naming the
    shard after bounded retries; back up with what it stored, no blob of the failed save
    exists and the next save commits."""
    server = AzuriteServer(tmp_path / "azurite")
    relay = Relay(server.port)
    stopped = threading.Event()
    clean: list[bool] = []

    def stop_server() -> None:
        # No connection reaches the server from now on, and those open are reset: the server
        # closes at once, saving what it holds (a SIGKILL would lose its last 5 s of changes,
        # and then a blob missing afterwards would prove nothing).
        relay.reset_next(1_000_000)
        relay.reset_all()
        clean.append(server.stop())
        stopped.set()

    try:
        container = server.new_container()
        options = server.options(relay.endpoint, **FAST)
        async with AsyncCheckpointManager(f"az://{container}/run", storage_options=options) as mgr:
            # 1 MiB into the 16 MiB shard (eight blocks of 2 MiB), the server stops
            relay.trip(MiB, stop_server)
            handle = await mgr.save(1, _state(4 * MiB, 1))
            with pytest.raises(StorageError) as info:
                await handle
            # the shard, whatever the save's unique part of its name
            assert "step_000000000001/shard_r00000" in str(info.value)
            assert ".safetensors" in str(info.value)
            assert "after 3 attempts" in str(info.value)
            assert await anyio.to_thread.run_sync(stopped.wait, 120)
            assert clean == [True]
            server.start()
            relay.reset_next(0)
            names = server.names(container)
            assert [n for n in names if n.startswith("run/_lease/")]  # it kept what it had
            assert not [n for n in names if "step_000000000001" in n]
            await (await mgr.save(2, _state(4 * MiB, 2)))
            assert await mgr.steps() == [2]
    finally:
        relay.close()
        server.kill()
