"""Replacing a committed step on purpose (``save(step, state, overwrite=True)``) and deleting
one step (``delete(step)``): the old step stays readable until the new manifest commits, and
neither ever breaks a kept step that reads bytes from the files they let go."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from _support.roots import manifest_of, shard_path

from aiockpt import AsyncCheckpointManager, CheckpointManager, LatestN
from aiockpt._core import format as fmt
from aiockpt.errors import (
    CheckpointNotFoundError,
    InvalidStepError,
    ReadOnlyError,
    StepExistsError,
    StorageError,
)

pytestmark = pytest.mark.anyio

MiB = 1 << 20


def state(value: float, big: float | None = None) -> dict[str, torch.Tensor]:
    """A small tensor of ``value`` and a 1 MiB one (a block of its own, so a later save that
    keeps it reads it from this save's file)."""
    return {
        "small": torch.full((8,), value),
        "big": torch.full((MiB // 4,), value if big is None else big),
    }


def files_of(root: str, step: int) -> set[str]:
    return set(os.listdir(os.path.join(root, fmt.step_dirname(step))))


async def test_a_committed_step_is_refused_unless_overwrite_is_asked(root: str) -> None:
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(5, state(1.0)))
        old = shard_path(root, 5)
        with pytest.raises(StepExistsError):
            await mgr.save(5, state(2.0))
        info = await (await mgr.save(5, state(2.0), overwrite=True))
        assert info.step == 5
        assert await mgr.steps() == [5]
        loaded = await mgr.load(5)
        assert torch.equal(loaded["small"], torch.full((8,), 2.0))
        assert torch.equal(loaded["big"], torch.full((MiB // 4,), 2.0))
    # The replaced attempt's file is gone; the step holds its manifest and the new shard.
    assert not os.path.exists(old)
    assert files_of(root, 5) == {fmt.MANIFEST, os.path.basename(shard_path(root, 5))}


async def test_overwrite_of_a_step_never_saved_is_a_plain_save(root: str) -> None:
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(3, state(3.0), overwrite=True))
        assert await mgr.steps() == [3]


async def test_the_old_step_stays_readable_until_the_replacement_commits(
    tmp_path: Path, test_storages: None
) -> None:
    root = str(tmp_path / "run")
    gate, reached = tmp_path / "gate", tmp_path / "reached"
    options = {"gate": str(gate), "reached": str(reached)}
    gate.touch()  # the first save writes straight through
    async with AsyncCheckpointManager(f"gated://{root}", storage_options=options) as mgr:
        await (await mgr.save(5, state(1.0)))
        gate.unlink()
        handle = await mgr.save(5, state(2.0), overwrite=True)
        while not reached.exists():  # the replacement's shard is half written
            await _tick()
        during = await mgr.load(5)
        assert torch.equal(during["small"], torch.full((8,), 1.0))
        assert torch.equal(during["big"], torch.full((MiB // 4,), 1.0))
        assert await mgr.steps() == [5]
        gate.touch()
        await handle
        after = await mgr.load(5)
        assert torch.equal(after["small"], torch.full((8,), 2.0))


async def _tick() -> None:
    import anyio

    await anyio.sleep(0.02)


async def test_a_failed_replacement_leaves_the_old_step(
    tmp_path: Path, test_storages: None
) -> None:
    root = str(tmp_path / "run")
    full = tmp_path / "full"
    url = f"fulldisk://{root}"
    async with AsyncCheckpointManager(url, storage_options={"write_flag": str(full)}) as mgr:
        await (await mgr.save(5, state(1.0)))
        full.touch()  # the replacement's shard finds the disk full
        with pytest.raises(StorageError, match="no space"):
            await (await mgr.save(5, state(2.0), overwrite=True))
        full.unlink()
        loaded = await mgr.load(5)
        assert torch.equal(loaded["small"], torch.full((8,), 1.0))
        assert await mgr.steps() == [5]
    assert len(files_of(root, 5)) == 2  # the manifest and the first attempt's shard


async def test_replacing_a_step_keeps_the_bytes_a_later_step_reads_from_it(root: str) -> None:
    """The Hugging Face rewind: steps 1-3 saved, the run resumes from step 1, and its step 2
    replaces the abandoned one, whose big tensor step 3 still reads."""
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, state(1.0, big=0.0)))
        await (await mgr.save(2, state(2.0, big=7.0)))
        await (await mgr.save(3, state(3.0, big=7.0)))  # reads big from step 2's file
        assert manifest_of(root, 3)["shards"][0]["stored"] < MiB
        await (await mgr.save(2, state(20.0, big=9.0), overwrite=True))
        three = await mgr.load(3)
        assert torch.equal(three["big"], torch.full((MiB // 4,), 7.0))
        two = await mgr.load(2)
        assert torch.equal(two["big"], torch.full((MiB // 4,), 9.0))
        assert torch.equal(two["small"], torch.full((8,), 20.0))
        # The abandoned step 2's file stays, as step 3 reads it; the new one beside it.
        assert len(files_of(root, 2)) == 3
        await mgr.delete(3, allow_latest=True)
        assert await mgr.steps() == [1, 2]
        assert len(files_of(root, 2)) == 2  # nothing reads the abandoned file any more
        two = await mgr.load(2)
        assert torch.equal(two["big"], torch.full((MiB // 4,), 9.0))


async def test_overwrite_refuses_a_step_being_saved(root: str) -> None:
    async with AsyncCheckpointManager(root) as mgr:
        handle = await mgr.save(5, state(1.0))
        with pytest.raises(StepExistsError, match="being saved"):
            await mgr.save(5, state(2.0), overwrite=True)
        await handle


# ------------------------------------------------------------------------- delete


async def test_delete_one_step_as_orbax_does(root: str) -> None:
    """orbax's test_delete, in aiockpt's terms: five steps saved, one deleted from the
    middle; the others stay, listed and loadable, and the deleted one is gone from disk."""
    async with AsyncCheckpointManager(root) as mgr:
        for step in range(5):
            await mgr.save(step, {"x": torch.full((4,), float(step))})
        await mgr.wait()
        await mgr.delete(3)
        assert await mgr.steps() == [0, 1, 2, 4]
        for step in (0, 1, 2, 4):
            assert torch.equal((await mgr.load(step))["x"], torch.full((4,), float(step)))
        with pytest.raises(CheckpointNotFoundError):
            await mgr.load(3)
        with pytest.raises(CheckpointNotFoundError):
            await mgr.delete(3)  # already gone
        # The step number is free again.
        await (await mgr.save(3, {"x": torch.full((4,), 33.0)}))
        assert await mgr.steps() == [0, 1, 2, 3, 4]
    assert not os.path.exists(os.path.join(root, fmt.step_dirname(7)))


async def test_delete_refuses_the_newest_step_unless_asked(root: str) -> None:
    async with AsyncCheckpointManager(root) as mgr:
        for step in (1, 2):
            await (await mgr.save(step, {"x": torch.full((4,), float(step))}))
        with pytest.raises(InvalidStepError, match="allow_latest=True"):
            await mgr.delete(2)
        assert await mgr.steps() == [1, 2]
        await mgr.delete(2, allow_latest=True)
        assert await mgr.steps() == [1]
        assert not os.path.exists(os.path.join(root, fmt.step_dirname(2)))
        # The only step is the newest too.
        with pytest.raises(InvalidStepError):
            await mgr.delete(1)
        await mgr.delete(1, allow_latest=True)
        assert await mgr.steps() == []
        assert await mgr.latest_step() is None


async def test_delete_keeps_the_bytes_a_kept_step_reads(root: str) -> None:
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, state(1.0, big=5.0)))
        await (await mgr.save(2, state(2.0, big=5.0)))  # reads big from step 1
        assert manifest_of(root, 2)["shards"][0]["stored"] < MiB
        await mgr.delete(1)
        assert await mgr.steps() == [2]
        loaded = await mgr.load(2)
        assert torch.equal(loaded["big"], torch.full((MiB // 4,), 5.0))
        # Step 1 is retired: its manifest gone, the file step 2 reads kept.
        assert files_of(root, 1)
        assert fmt.MANIFEST not in files_of(root, 1)
        # A later save refers to what step 2 holds; it never reads the deleted step's state.
        await (await mgr.save(3, state(3.0, big=5.0)))
        await mgr.delete(2)
        loaded = await mgr.load(3)
        assert torch.equal(loaded["big"], torch.full((MiB // 4,), 5.0))


async def test_delete_waits_for_the_saves_before_it_and_retention_agrees(root: str) -> None:
    async with AsyncCheckpointManager(root, retention=LatestN(2)) as mgr:
        for step in (1, 2, 3):
            await mgr.save(step, {"x": torch.full((4,), float(step))})
        await mgr.delete(2)  # queued behind the saves: by now step 2 is committed
        assert await mgr.steps() == [3]  # step 1 went to retention, 2 to the delete
        await (await mgr.save(4, {"x": torch.full((4,), 4.0)}))
        assert await mgr.steps() == [3, 4]


async def test_delete_and_overwrite_refused_read_only(root: str) -> None:
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, {"x": torch.zeros(2)}))
        await (await mgr.save(2, {"x": torch.zeros(2)}))
    async with AsyncCheckpointManager(root, read_only=True) as mgr:
        with pytest.raises(ReadOnlyError):
            await mgr.delete(1)
        with pytest.raises(ReadOnlyError):
            await mgr.save(1, {"x": torch.ones(2)}, overwrite=True)


async def test_delete_of_a_step_still_being_written_deletes_it_once_committed(
    root: str,
) -> None:
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, {"x": torch.zeros(2)}))
        handle = await mgr.save(2, {"x": torch.zeros(2)})
        await mgr.delete(2, allow_latest=True)  # after the save sent before it
        assert (await handle).step == 2
        assert await mgr.steps() == [1]
        await (await mgr.save(2, {"x": torch.ones(2)}))  # the number is free again


@pytest.mark.parametrize("bad", [-1, True, "3"])
async def test_delete_checks_its_step(root: str, bad: object) -> None:
    async with AsyncCheckpointManager(root) as mgr:
        with pytest.raises(InvalidStepError):
            await mgr.delete(bad)  # type: ignore[arg-type]


def test_the_sync_manager_replaces_and_deletes(root: str) -> None:
    with CheckpointManager(root) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"x": torch.full((2,), float(step))}).result()
        mgr.save(2, {"x": torch.full((2,), 22.0)}, overwrite=True).result()
        assert torch.equal(mgr.load(2)["x"], torch.full((2,), 22.0))
        mgr.delete(1)
        with pytest.raises(InvalidStepError):
            mgr.delete(3)
        assert mgr.steps() == [2, 3]
        mgr.delete(3, allow_latest=True)
        assert mgr.steps() == [2]
