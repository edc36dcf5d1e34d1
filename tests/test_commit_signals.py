"""A multi-rank commit's signals: through the job's c10d store, storage sees only the checkpoint.

Simulated ranks are threads running the daemon's own commit code (Coordinator and its
rendezvous) against one counting storage, each talking to a real TCPStore served by another
process, through the trainer's own store operations (storeproxy.TorchStoreOps).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from multiprocessing import Pipe

import pytest

from aiockpt._core import format as fmt
from aiockpt._core.storeops import PipeStoreOps, StoreTimeout, StoreUnreachable, serve
from aiockpt._daemon.coord import Coordinator, Part
from aiockpt._daemon.rendezvous import StorageRendezvous, StoreRendezvous
from aiockpt._trainer.storeproxy import TorchStoreOps
from aiockpt.errors import DistributedSaveError
from aiockpt.storage import CountingStorage, LocalStorage

SERVER = (
    "import sys, torch.distributed as d; "
    "s = d.TCPStore('127.0.0.1', 0, None, True, wait_for_workers=False); "
    "print(s.port, flush=True); sys.stdin.read()"
)


@contextlib.contextmanager
def store_server() -> Iterator[tuple[subprocess.Popen, object]]:
    """A TCPStore served by another process (as torchrun's agent serves it), and a client."""
    import torch.distributed as dist

    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        port = int(proc.stdout.readline())
        client = dist.TCPStore(
            "127.0.0.1", port, None, False, timedelta(seconds=60), wait_for_workers=False
        )
        yield proc, dist.PrefixStore("job/", client)
    finally:
        proc.kill()
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()


@pytest.fixture(autouse=True, scope="module")
def _enough_file_descriptors():
    # 1,024 simulated ranks hold a store connection each.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def shard_file(rank: int) -> str:
    """Rank ``rank``'s shard file, as one attempt (tag) of every rank names it."""
    return fmt.shard_filename(rank, "0123456789abcdef")


def make_part(rank: int, nbytes: int) -> Part:
    spec = fmt.TensorSpec("w", "U8", (nbytes,), 0, nbytes)
    tensors = fmt.tensors_json([spec], 0, [rank])
    tree = json.dumps({"D": [["w", {"T": "w"}]]}, separators=(",", ":"))
    shard = {"file": shard_file(rank), "rank": rank, "nbytes": nbytes, "crc32c": rank}
    return Part(rank, shard, tensors, tree)


class Ranks:
    """N simulated ranks saving one step together."""

    def __init__(self, storage: CountingStorage, world: int, via, timeout: float = 60.0):
        self.storage, self.world = storage, world
        self.results: dict[int, object] = {}
        self.requests: dict[int, dict[str, int]] = {}
        self.ended: dict[int, float] = {}
        # One per rank for the whole run, as each daemon keeps its own, made (and connected
        # to the store) one after another, as the daemons start.
        self.coords = {
            r: Coordinator(storage, r, world, timeout, via=via(r, timeout)) for r in range(world)
        }

    def rank(self, rank: int, step: int, uuid: str, delay: float, fail: bool) -> None:
        coord = self.coords[rank]
        with self.storage.scope() as counts:
            try:
                time.sleep(delay)
                if fail:
                    coord.publish_failure(step, uuid, "OSError: disk full")
                    raise DistributedSaveError("this rank failed", ranks=[rank])
                step_dir = fmt.step_dirname(step)
                self.storage.makedirs(step_dir)
                payload = bytes([rank % 256]) * 64
                self.storage.write_file(f"{step_dir}/{shard_file(rank)}", [payload])
                coord.commit(
                    step=step, uuid=uuid, part=make_part(rank, 64), metrics={}, metadata={}
                )
                if rank == 0:
                    coord.finished(step, uuid)
                self.results[rank] = "ok"
            except DistributedSaveError as e:
                self.results[rank] = e
            finally:
                self.ended[rank] = time.monotonic()
        self.requests[rank] = dict(counts)

    def save(
        self,
        step: int,
        uuid: str,
        *,
        late: dict[int, float] | None = None,
        failing: tuple[int, ...] = (),
        silent: tuple[int, ...] = (),
        during=None,
    ) -> None:
        late = late or {}
        threads = [
            threading.Thread(target=self.rank, args=(r, step, uuid, late.get(r, 0.0), r in failing))
            for r in range(self.world)
            if r not in silent
        ]
        for t in threads:
            t.start()
        if during is not None:
            during()
        for t in threads:
            t.join(timeout=180)
        assert not any(t.is_alive() for t in threads)


def store_via(store, storage, world):
    def via(rank: int, timeout: float) -> StoreRendezvous:
        return StoreRendezvous(TorchStoreOps(store).connect(), storage, rank, world, timeout)

    return via


def storage_via(storage, world):
    def via(rank: int, timeout: float) -> StorageRendezvous:
        return StorageRendezvous(storage, rank, world, timeout)

    return via


def signals_via(kind: str, store, storage, world: int):
    return store_via(store, storage, world) if kind == "store" else storage_via(storage, world)


@contextlib.contextmanager
def hash_store() -> Iterator[tuple[None, object]]:
    """An in-process c10d store: the many ranks of one process wait on it without sockets
    (a TCPStore here now and then takes 0.5 to 5 s to accept one more client)."""
    import torch.distributed as dist

    yield None, dist.HashStore()


@pytest.mark.parametrize(
    ("world", "server"),
    [(2, hash_store), (16, hash_store), (256, hash_store), (1024, hash_store), (16, store_server)],
)
def test_a_commit_asks_storage_for_the_shards_and_the_manifest_only(tmp_path, world, server):
    storage = CountingStorage(LocalStorage(str(tmp_path)))
    with server() as (_, store):
        ranks = Ranks(storage, world, store_via(store, storage, world))
        # The last rank's shard lands 5 s after the others': a poll would show.
        ranks.save(1, "u1", late={world - 1: 5.0})
        assert all(r == "ok" for r in ranks.results.values()), ranks.results
        assert len(ranks.results) == world
        for rank, requests in ranks.requests.items():
            expected = {"makedirs": 1, "write_file": 1}  # the shard
            if rank == 0:
                expected["put_if_absent"] = 1  # the manifest
            assert requests == expected, (rank, requests)
        manifest = json.loads((tmp_path / "step_000000000001" / fmt.MANIFEST).read_text())
        assert manifest["world_size"] == world
        assert [s["rank"] for s in manifest["shards"]] == list(range(world))
        # Only the outcome stays in the store, until the next save's parts are in.
        slots = [StoreRendezvous.key("u1", f"r{r}") for r in range(1, world)]
        assert not any(TorchStoreOps(store).check(slots))
        ranks.save(2, "u2")
        assert TorchStoreOps(store).check([StoreRendezvous.key("u1", "outcome")]) == [False]


def test_without_a_store_the_ranks_poll_storage_and_still_commit(tmp_path):
    storage = CountingStorage(LocalStorage(str(tmp_path)))
    world = 4
    ranks = Ranks(storage, world, storage_via(storage, world))
    ranks.save(1, "u1", late={world - 1: 1.0})
    assert all(r == "ok" for r in ranks.results.values()), ranks.results
    # What the store saves: rank 0 lists the directory and the others check for its marker.
    assert ranks.requests[0]["list_dir"] > 1
    assert ranks.requests[1]["exists"] > 1
    names = os.listdir(tmp_path / "step_000000000001")
    assert [n for n in names if n.startswith(".")] == [".u1.done"]


@pytest.mark.parametrize("signals", ["store", "storage"])
def test_a_failing_rank_fails_every_rank_at_once(tmp_path, signals):
    storage = CountingStorage(LocalStorage(str(tmp_path)))
    world = 16
    with store_server() as (_, store):
        via = signals_via(signals, store, storage, world)
        ranks = Ranks(storage, world, via)
        t0 = time.monotonic()
        ranks.save(1, "u1", failing=(5,), late={9: 1.0})
        assert max(ranks.ended.values()) - t0 < 30  # not the 60 s deadline
    for rank, result in ranks.results.items():
        assert isinstance(result, DistributedSaveError), (rank, result)
        if rank != 5:
            assert result.ranks == [5]
            assert "rank 5: OSError: disk full" in str(result)
    assert not (tmp_path / "step_000000000001" / "manifest.json").exists()


@pytest.mark.parametrize("signals", ["store", "storage"])
def test_a_rank_that_never_comes_is_named_on_every_rank(tmp_path, signals):
    storage = CountingStorage(LocalStorage(str(tmp_path)))
    world = 8
    with store_server() as (_, store):
        via = signals_via(signals, store, storage, world)
        ranks = Ranks(storage, world, via, timeout=3.0)
        ranks.save(1, "u1", silent=(7,))
    assert sorted(ranks.results) == list(range(7))
    for result in ranks.results.values():
        assert isinstance(result, DistributedSaveError)
        assert result.ranks == [7]
        assert "rank(s) [7] did not finish their shard within 3.0 s" in str(result)
    assert not (tmp_path / "step_000000000001" / "manifest.json").exists()


def test_a_store_that_goes_away_fails_every_rank(tmp_path):
    storage = CountingStorage(LocalStorage(str(tmp_path)))
    world = 8
    with store_server() as (proc, store):
        ranks = Ranks(storage, world, store_via(store, storage, world))

        def kill_the_store() -> None:
            time.sleep(2.0)  # every rank but the late one is waiting by now
            proc.kill()

        t0 = time.monotonic()
        ranks.save(1, "u1", late={7: 8.0}, during=kill_the_store)
        assert max(ranks.ended.values()) - t0 < 45  # not the 60 s deadline
    for rank, result in ranks.results.items():
        assert isinstance(result, DistributedSaveError), (rank, result)
        assert "the job's store" in str(result)
    assert not (tmp_path / "step_000000000001" / "manifest.json").exists()


def test_the_relay_answers_over_its_pipe_and_fails_clearly(tmp_path):
    with store_server() as (proc, store):
        daemon_end, trainer_end = Pipe(duplex=True)
        relay = threading.Thread(target=serve, args=(trainer_end, TorchStoreOps(store)))
        relay.start()
        ops = PipeStoreOps(daemon_end)
        assert ops.set_if_absent(["a", "b"], b"1") == [b"1", b"1"]
        assert ops.set_if_absent(["a", "c"], b"2") == [b"1", b"2"]  # never overwrites
        assert ops.get(["a", "c"]) == [b"1", b"2"]
        assert ops.check(["a", "x"]) == [True, False]
        with pytest.raises(StoreTimeout):
            ops.wait(["a", "x"], 0.5)
        ops.wait(["a", "b"], 5.0)  # the connection that timed out was replaced
        ops.delete(["a", "x"])
        assert ops.check(["a", "b"]) == [False, True]
        proc.kill()
        proc.wait()
        with pytest.raises(StoreUnreachable, match="the job's store failed"):
            ops.check(["b"])
        ops.close()
        relay.join(timeout=10)
        assert not relay.is_alive()  # the relay ends with the daemon's end of the pipe
    with pytest.raises(StoreUnreachable, match="relaying the job's store is gone"):
        ops.check(["b"])
