"""The catalog of a root, on real roots written by a real manager: what it lists and reads,
how it deletes, and how it verifies a shard."""

from __future__ import annotations

import json
import os
import random

import crc32c
import pytest
import torch
from _support.roots import make_partial, shard_name, shard_path

from aiockpt import AsyncCheckpointManager
from aiockpt._core import catalog as catalog_module
from aiockpt._core import format as fmt
from aiockpt._core.catalog import Catalog, ShardCrcs
from aiockpt.errors import CorruptCheckpointError, StorageError
from aiockpt.storage import LocalStorage

pytestmark = pytest.mark.anyio


def state(step: int) -> dict:
    # Tensors of several sizes, so small verify chunks cut through some of them.
    return {
        "w": torch.arange(300, dtype=torch.float32) + step,
        "b": torch.full((7,), step, dtype=torch.int64),
        "empty": torch.zeros(0),
        "step": step,
    }


async def save_steps(root: str, *steps: int) -> None:
    async with AsyncCheckpointManager(root) as mgr:
        for step in steps:
            await (await mgr.save(step, state(step), metrics={"loss": 1.0 / (step + 1)}))


class Recording(LocalStorage):
    """The local storage, noting reads and deletes, and failing recursive deletes on demand."""

    def __init__(self, root: str, *, fail_recursive: bool = False) -> None:
        super().__init__(root)
        self.reads: list[str] = []
        self.deletes: list[tuple[str, bool]] = []
        self.log: list[str] = []
        self.fail_recursive = fail_recursive

    def list_dir(self, path: str) -> list[str]:
        self.log.append("list")
        return super().list_dir(path)

    def read_range(self, path: str, start: int, end: int) -> bytes:
        self.reads.append(path)
        return super().read_range(path, start, end)

    def delete(self, path: str, *, recursive: bool = False) -> None:
        self.deletes.append((path, recursive))
        if recursive and self.fail_recursive:
            raise StorageError(f"delete {path} interrupted")
        super().delete(path, recursive=recursive)


# --------------------------------------------------------------------------- listing and reading


async def test_a_lazily_read_manifest_is_parsed_once_until_its_bytes_change(root):
    """Loads read a step's manifest every time, and parse it again only when its bytes are
    not those parsed last (a step rewritten behind the run's back); at most a few are kept."""
    await save_steps(root, 1, 2, 3)
    catalog = Catalog(LocalStorage(root))
    first = catalog.read_manifest(1, lazy=True)
    assert catalog.read_manifest(1, lazy=True) is first
    assert catalog.read_manifest(1) is not first  # a full check always parses
    path = os.path.join(root, fmt.step_dirname(1), fmt.MANIFEST)
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    doc["metrics"] = {"loss": 0.25}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    changed = catalog.read_manifest(1, lazy=True)
    assert changed is not first
    assert changed.metrics == {"loss": 0.25}
    for step in (2, 3):
        catalog.read_manifest(step, lazy=True)
    assert len(catalog._parsed) == catalog_module.PARSED_KEPT
    assert catalog.read_manifest(1, lazy=True) is not changed  # let go for newer ones


async def test_lists_committed_steps_and_partial_step_dirs(root):
    await save_steps(root, 1, 3)
    make_partial(root, 2)
    make_partial(root, 5)
    os.makedirs(os.path.join(root, "not_a_step"))
    catalog = Catalog(LocalStorage(root))
    assert catalog.listed_steps() == [1, 2, 3, 5]
    assert catalog.step_dirs() == {1: True, 2: False, 3: True, 5: False}
    assert catalog.committed_steps() == [1, 3]
    assert catalog.is_committed(3)
    assert not catalog.is_committed(2)
    assert catalog.where() == LocalStorage(root).url.rstrip("/")
    assert catalog.where("x/y").endswith("/x/y")


async def test_an_empty_or_missing_root_lists_nothing(root):
    catalog = Catalog(LocalStorage(root))
    assert catalog.listed_steps() == []
    assert catalog.committed_steps() == []
    assert catalog.records() == []
    assert catalog.collect_partials() == []


async def test_manifest_and_record_say_what_was_saved(root):
    await save_steps(root, 4)
    catalog = Catalog(LocalStorage(root))
    m = catalog.read_manifest(4)
    assert m.step == 4
    assert m.world_size == 1
    assert m.metrics == {"loss": 0.2}
    assert set(m.tensors[m.shard_of(0).file]) == {"w", "b", "empty"}
    record = catalog.read_record(4)
    assert (record.step, record.time, record.metrics) == (4, m.created_at, {"loss": 0.2})
    data, where = catalog.manifest_bytes(4)
    assert where == catalog.where(f"{fmt.step_dirname(4)}/{fmt.MANIFEST}")
    with open(os.path.join(root, fmt.step_dirname(4), fmt.MANIFEST), "rb") as f:
        assert data == f.read()


async def test_records_leave_out_a_corrupt_manifest(root):
    await save_steps(root, 1, 2)
    with open(os.path.join(root, fmt.step_dirname(1), fmt.MANIFEST), "w") as f:
        f.write("{not json")
    catalog = Catalog(LocalStorage(root))
    assert [r.step for r in catalog.records()] == [2]
    assert [r.step for r in catalog.records([2])] == [2]
    with pytest.raises(CorruptCheckpointError, match=fmt.MANIFEST):
        catalog.read_manifest(1)


async def test_a_manifest_too_large_is_refused_unread(root, monkeypatch):
    await save_steps(root, 1)
    storage = Recording(root)
    monkeypatch.setattr(catalog_module, "MAX_MANIFEST_BYTES", 16)
    catalog = Catalog(storage)
    with pytest.raises(CorruptCheckpointError, match="too large"):
        catalog.read_manifest(1)
    with pytest.raises(CorruptCheckpointError, match="too large"):
        catalog.read_record(1)
    assert storage.reads == []


# --------------------------------------------------------------------------- deleting


async def test_delete_step_uncommits_first_then_removes(root):
    await save_steps(root, 1, 2)
    storage = Recording(root)
    catalog = Catalog(storage)
    seen: list[tuple[int, bool]] = []
    catalog.delete_step(1, uncommitted=lambda s: seen.append((s, catalog.is_committed(s))))
    assert seen == [(1, False)]  # told once the manifest is gone, before the files go
    assert storage.deletes == [
        (f"{fmt.step_dirname(1)}/{fmt.MANIFEST}", False),
        (fmt.step_dirname(1), True),
    ]
    assert catalog.step_dirs() == {2: True}


async def test_a_deletion_cut_short_leaves_a_partial_that_is_collected(root):
    await save_steps(root, 1, 2)
    catalog = Catalog(Recording(root, fail_recursive=True))
    seen: list[int] = []
    with pytest.raises(StorageError, match="interrupted"):
        catalog.delete_step(1, uncommitted=seen.append)
    assert seen == [1]
    assert catalog.step_dirs() == {1: False, 2: True}  # never a committed step with gaps
    assert Catalog(LocalStorage(root)).collect_partials() == [1]
    assert catalog.step_dirs() == {2: True}


async def test_collect_partials_spares_busy_and_newest_steps(root):
    await save_steps(root, 2, 4)
    for step in (1, 3, 5):
        make_partial(root, step)
    storage = Recording(root)
    catalog = Catalog(storage)

    def busy() -> set[int]:
        storage.log.append("busy")
        return {3}

    assert catalog.collect_partials(busy) == [1]  # 3 is being saved, 5 may be
    # Busy steps are asked after the listing: a save that starts in between is seen as busy,
    # never its (listed, stale) directory as dead.
    assert storage.log == ["list", "busy"]
    assert catalog.step_dirs() == {2: True, 3: False, 4: True, 5: False}
    assert catalog.collect_partials(everything=True) == [3, 5]
    assert catalog.step_dirs() == {2: True, 4: True}


# --------------------------------------------------------------------------- verifying


def verify(catalog: Catalog, step: int, chunk: int) -> tuple[list[str], list[int]]:
    m = catalog.read_manifest(step)
    (shard,) = m.shards
    progress: list[int] = []
    problems = catalog.verify_shard(
        step, shard, m.tensors[shard.file], progress.append, chunk=chunk
    )
    assert sum(progress) == shard.nbytes  # the bar always reaches its end
    return problems, progress


@pytest.mark.parametrize("chunk", [1, 100, 4096, 1 << 20])
async def test_an_intact_shard_verifies_in_chunks_of_any_size(root, chunk):
    await save_steps(root, 1)
    catalog = Catalog(LocalStorage(root))
    problems, progress = verify(catalog, 1, chunk)
    assert problems == []
    assert len(progress) == -(-os.path.getsize(shard_path(root, 1)) // chunk)


async def test_a_flipped_byte_fails_the_file_and_its_tensor(root):
    await save_steps(root, 1)
    catalog = Catalog(LocalStorage(root))
    m = catalog.read_manifest(1)
    r = m.tensors[m.shard_of(0).file]["w"]
    with open(shard_path(root, 1), "r+b") as f:
        f.seek(r.start + 5)
        byte = f.read(1)
        f.seek(r.start + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    problems, _ = verify(catalog, 1, 64)
    path = f"{fmt.step_dirname(1)}/{shard_name(root, 1)}"
    assert problems == [
        f"{path}: whole-file crc32c mismatch",
        f"{path}: tensor 'w' crc32c mismatch",
    ]


async def test_a_short_or_missing_shard_is_reported(root):
    await save_steps(root, 1)
    catalog = Catalog(LocalStorage(root))
    path = f"{fmt.step_dirname(1)}/{shard_name(root, 1)}"
    size = os.path.getsize(shard_path(root, 1))
    os.truncate(shard_path(root, 1), size - 1)
    problems, _ = verify(catalog, 1, 64)
    assert problems == [f"{path}: {size - 1} bytes, the manifest says {size}"]
    os.unlink(shard_path(root, 1))
    m = catalog.read_manifest(1)
    (shard,) = m.shards
    assert catalog.verify_shard(1, shard, m.tensors[shard.file]) == [f"{path}: missing"]


def test_shard_crcs_match_the_crcs_of_the_whole_bytes():
    """Streamed in pieces of any size, each crc is that of its bytes taken at once."""
    rng = random.Random(0)
    data = bytes(rng.getrandbits(8) for _ in range(1000))
    bounds = sorted(rng.sample(range(1, 1000), 9))
    spans = [*zip([0, *bounds], [*bounds, 1000], strict=True), (500, 500)]  # one empty
    records = {
        f"t{i}": fmt.TensorRecord("s", "U8", (b - a,), a, b, crc32c.crc32c(data[a:b]))
        for i, (a, b) in enumerate(spans)
    }
    for piece in (1, 7, 333, 1000):
        crcs = ShardCrcs(records)
        for lo in range(0, len(data), piece):
            crcs.update(lo, memoryview(data)[lo : lo + piece])
        assert crcs.mismatches(crc32c.crc32c(data)) == []
        assert crcs.crcs == {name: r.crc32c for name, r in records.items()}
    assert ShardCrcs(records).mismatches(1) == [  # nothing streamed: every crc still 0
        "whole-file crc32c mismatch",
        *(f"tensor {name!r} crc32c mismatch" for name, r in records.items() if r.crc32c != 0),
    ]
