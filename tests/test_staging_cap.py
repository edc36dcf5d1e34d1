"""staging_memory: a shard larger than the cap is staged in windows, written as they come, and
is the same file a save staged whole writes; staging never holds more than the cap."""

from __future__ import annotations

import itertools
import os
import uuid

import anyio
import pytest
import torch
from _support.roots import manifest_of, shard_path, step_numbers
from _support.storages import open_unordered
from hypothesis import given, settings
from hypothesis import strategies as st

from aiockpt import AsyncCheckpointManager
from aiockpt._core.blocks import BLOCK_BYTES, cut_blocks
from aiockpt._core.windows import cut_windows, least_capacity, parts
from aiockpt._trainer import saving
from aiockpt.errors import StagingMemoryError, StorageError
from aiockpt.storage import register_storage
from aiockpt.storage._registry import ENV_VAR

MiB = 1 << 20


def mixed_state() -> dict:
    """About 100 MiB: large tensors cut by windows mid-tensor (one of them a transposed,
    non-contiguous view), many small tensors of several dtypes, an empty and a 0-d one."""
    g = torch.Generator().manual_seed(0)
    big = {f"w{i}": torch.randn(1000 + 7 * i, 9000, generator=g) for i in range(3)}
    big["t"] = torch.randn(3000, 2500, generator=g).t()  # 28.6 MiB, not contiguous
    small = {
        f"s{i}": torch.randint(-100, 100, (i % 17 + 1, 33), generator=g).to(dtype)
        for i, dtype in zip(
            range(600),
            [torch.float32, torch.bfloat16, torch.int8, torch.bool, torch.float64, torch.int64]
            * 100,
            strict=True,
        )
    }
    return {
        "model": big,
        "small": small,
        "empty": torch.empty(0, 5),
        "scalar": torch.tensor(3.5),
        "step": 7,
    }


def assert_equal(got: object, want: object) -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict)
        assert set(got) == set(want)
        for k in want:
            assert_equal(got[k], want[k])
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor)
        assert (got.dtype, got.shape) == (want.dtype, want.shape)
        assert torch.equal(got, want)
    else:
        assert got == want


def shard_bytes(root: str, step: int) -> bytes:
    with open(shard_path(root, step), "rb") as f:
        return f.read()


@pytest.mark.parametrize("dedup", [False, True])
def test_a_capped_save_writes_the_same_shard_and_stays_under_the_cap(tmp_path, dedup) -> None:
    state = mixed_state()
    whole, capped = str(tmp_path / "whole"), str(tmp_path / "capped")

    async def main() -> None:
        async with AsyncCheckpointManager(whole, dedup=dedup) as mgr:
            await (await mgr.save(1, state))
        async with AsyncCheckpointManager(capped, dedup=dedup, staging_memory=0.25) as mgr:
            await (await mgr.save(1, state))
            pool = mgr._pool
            size = manifest_of(capped, 1)["shards"][0]["nbytes"]
            assert pool.peak <= 0.25 * size + 1  # its own accounting: never over the cap
            assert pool.held <= 0.25 * size + 1
            assert pool.busy == 0
            assert_equal(await mgr.load(1), state)
            into = mixed_state()
            into["model"] = {k: torch.zeros_like(v) for k, v in state["model"].items()}
            await mgr.load(1, into=into)
            assert_equal(into, state)

    anyio.run(main)
    assert shard_bytes(capped, 1) == shard_bytes(whole, 1)
    got, want = manifest_of(capped, 1), manifest_of(whole, 1)
    assert got["shards"][0]["crc32c"] == want["shards"][0]["crc32c"]
    assert got["shards"][0].get("blocks") == want["shards"][0].get("blocks")


def test_capped_saves_refer_to_unchanged_blocks(tmp_path) -> None:
    """Deduplication works window by window: a second save of a state with one block changed
    writes about that block, and every step loads."""
    state = mixed_state()
    root = str(tmp_path / "r")

    async def main() -> None:
        async with AsyncCheckpointManager(root, staging_memory=40 * MiB) as mgr:
            await (await mgr.save(1, state))
            state["model"]["w1"][500].add_(1.0)
            await (await mgr.save(2, state))
            assert mgr._pool.peak <= 40 * MiB
            assert_equal(await mgr.load(2), state)

    anyio.run(main)
    m = manifest_of(root, 2)["shards"][0]
    assert m["stored"] < m["nbytes"] // 4  # the changed block and the small tensors' blocks
    assert sum(b[0] for b in m["blocks"] if b[2]) > m["nbytes"] // 2


def test_a_cap_too_small_is_refused_with_what_would_do(tmp_path) -> None:
    root = str(tmp_path / "r")

    async def main() -> None:
        async with AsyncCheckpointManager(root, staging_memory=8 * MiB) as mgr:
            with pytest.raises(StagingMemoryError, match="give at least") as e:
                await mgr.save(1, {"w": torch.zeros(40 * MiB // 4)})
            assert str(2 * BLOCK_BYTES) in str(e.value)
            await (await mgr.save(2, {"w": torch.ones(1000)}))  # a small state fits whole
            assert await mgr.steps() == [2]

    anyio.run(main)
    assert step_numbers(root) == [2]


def test_a_save_that_fails_while_staging_windows_leaves_nothing(tmp_path, monkeypatch) -> None:
    state = mixed_state()
    root = str(tmp_path / "r")
    real = saving.copy_window
    calls = []

    def failing(slab, job, tensors, flats):
        calls.append(job.lo)
        if len(calls) == 3:
            raise RuntimeError("copy failed")
        real(slab, job, tensors, flats)

    async def main() -> None:
        async with AsyncCheckpointManager(root, staging_memory=0.25) as mgr:
            monkeypatch.setattr(saving, "copy_window", failing)
            with pytest.raises(RuntimeError, match="copy failed"):
                await mgr.save(1, state)
            monkeypatch.setattr(saving, "copy_window", real)
            await (await mgr.save(1, state))  # the step is free again
            assert await mgr.steps() == [1]
            assert mgr._pool.busy == 0
            assert_equal(await mgr.load(1), state)

    anyio.run(main)
    assert len(calls) == 3


def test_staging_memory_is_checked() -> None:
    for bad in (0, -5, 0.0, 1.5, True, "1GB"):
        with pytest.raises((TypeError, ValueError), match="staging_memory"):
            AsyncCheckpointManager("/tmp/unused", staging_memory=bad)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40 * MiB), min_size=1, max_size=12),
    header=st.integers(8, 100_000),
    extra=st.integers(0, 30 * MiB),
)
def test_windows_tile_the_file_at_block_boundaries(sizes, header, extra) -> None:
    spans, pos = [], header
    for n in sizes:
        spans.append((pos, pos + n))
        pos += n
    need = least_capacity(spans, header, pos)
    capacity = need + extra
    windows = cut_windows(spans, header, pos, capacity)
    assert (windows[0][0], windows[-1][1]) == (0, pos)
    cuts = {a for a, _ in cut_blocks(spans, header, pos)} | {pos, header}
    for (_, b), (c, _) in itertools.pairwise(windows):
        assert b == c
        assert b in cuts
    assert all(b - a <= capacity for a, b in windows)
    covered = [0] * len(spans)
    for lo, hi in windows:
        for i, a, b in parts(spans, lo, hi):
            assert spans[i][0] <= a < b <= spans[i][1]
            assert lo <= a < b <= hi
            covered[i] += b - a
    assert covered == [b - a for a, b in spans]
    with pytest.raises(ValueError, match="staging window"):
        cut_windows(spans, header, pos, need - 1)


def test_distributed_tensors_staged_in_windows(tmp_path) -> None:
    """DTensor chunks cut by windows keep their per-64-KiB crcs: the manifest equals the one
    of a save staged whole, and the full tensors load back."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    whole, capped = str(tmp_path / "whole"), str(tmp_path / "capped")
    g = torch.Generator().manual_seed(1)
    full = {f"d{i}": torch.randn(1500 + i, 7001, generator=g) for i in range(2)}

    async def save() -> None:
        mesh = init_device_mesh("cpu", (1,))
        state = {
            "model": {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()},
            "plain": torch.arange(1000),
        }
        async with AsyncCheckpointManager(whole) as mgr:
            await (await mgr.save(1, state))
        async with AsyncCheckpointManager(capped, staging_memory=40 * MiB) as mgr:
            await (await mgr.save(1, state))
            assert 0 < mgr._pool.peak <= 40 * MiB

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        anyio.run(save)
    finally:
        dist.destroy_process_group()
    assert shard_bytes(capped, 1) == shard_bytes(whole, 1)
    got, want = manifest_of(capped, 1), manifest_of(whole, 1)
    named = {got["shards"][0]["file"]: want["shards"][0]["file"]}  # each attempt its own name
    for entry in got["dtensors"].values():
        for chunk in entry["chunks"]:
            chunk["shard"] = named[chunk["shard"]]
    assert got["dtensors"] == want["dtensors"]

    async def load() -> None:
        async with AsyncCheckpointManager(capped, read_only=True) as mgr:
            out = await mgr.load(1)
        assert_equal(out["model"], full)

    anyio.run(load)


def test_window_slabs_with_the_daemon_are_not_lent_to_another_save() -> None:
    """A save's windows still being written stay its own after it stops sending: the next
    save waits for them (it once got a slab the daemon was still writing from)."""
    from aiockpt._trainer.staging import SlabPool

    async def main() -> None:
        pool = SlabPool(1, capacity=64 * 4096)
        a, b = await pool.acquire_windows(16 * 4096)
        pool.close_windows((a, b), unsent=[b])  # a was sent, b was never filled
        assert pool.busy == 1
        with anyio.move_on_after(0.2) as waited:
            await pool.acquire(4096, 1)
        assert waited.cancelled_caught  # the save's place is taken until a comes back
        pool.release(a.name)
        slab = await pool.acquire(4096, 1)
        assert slab in (a, b)
        assert pool.held <= 64 * 4096
        pool.close()

    anyio.run(main)


@pytest.mark.anyio
async def test_a_windowed_save_on_a_storage_that_cannot_take_one_is_refused_clearly(
    tmp_path, monkeypatch
) -> None:
    """A storage that does not declare writes_in_order needs every piece of a file at once:
    a save whose shard is larger than its staging share fails, naming the setting, and
    nothing is committed; a save that fits works on the same manager."""
    monkeypatch.setenv(ENV_VAR, "")  # the registration below is this test's alone
    tests = os.path.dirname(os.path.abspath(__file__))  # where the daemon imports it from
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))
    )
    proto = f"unordered{uuid.uuid4().hex[:8]}"
    register_storage(proto, open_unordered)
    state = {f"t{i}": torch.full((50_000,), float(i)) for i in range(120)}  # 23 MiB
    root = f"{proto}://{tmp_path / 'run'}"
    async with AsyncCheckpointManager(root, staging_memory=8 * MiB) as mgr:
        with pytest.raises(StorageError, match="writes_in_order"):  # from save() or the handle
            await (await mgr.save(1, state))
        assert await mgr.steps() == []
        await (await mgr.save(2, {"small": torch.arange(10)}))
        assert await mgr.steps() == [2]
