"""Damaged checkpoints on disk: flipped bytes, truncated or missing manifests, short shards.
Load refuses them with CorruptCheckpointError naming what is wrong; it never returns bad data."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch
from _support.roots import flip_byte, shard_name

from aiockpt import AsyncCheckpointManager
from aiockpt.errors import CheckpointNotFoundError, CorruptCheckpointError

from ._helpers import step_dir, verify_checkpoint

pytestmark = pytest.mark.anyio


def state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)},
        "ids": torch.arange(300, dtype=torch.int16),
        "mask": torch.ones(17, dtype=torch.bool),
        "step": 1,
    }


def verify_cli(root: str) -> tuple[int, str]:
    """`aiockpt verify ROOT` in its own process: (exit code, stdout)."""
    out = subprocess.run(
        [sys.executable, "-m", "aiockpt.cli", "verify", root],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return out.returncode, out.stdout


@pytest.mark.parametrize("seed", range(6))
async def test_one_flipped_byte_names_file_and_tensor(root, seed):
    """Flip one bit at a random offset inside some tensor's bytes: load refuses with the shard's
    path and that tensor's name; the other checkpoint in the root still loads (saved whole:
    with deduplication step 2 would read these very bytes, see test_incremental)."""
    async with AsyncCheckpointManager(root, dedup=False) as mgr:
        await (await mgr.save(1, state()))
        await (await mgr.save(2, state()))
        manifest = verify_checkpoint(root, 1)
        tensors = manifest["tensors"][shard_name(root, 1)]
        rng = random.Random(seed)
        name = rng.choice(sorted(tensors))
        start, end = tensors[name]["byte_range"]
        shard = os.path.join(step_dir(root, 1), shard_name(root, 1))
        flip_byte(shard, rng.randrange(start, end))
        with pytest.raises(CorruptCheckpointError) as exc:
            await mgr.load(1)
        assert exc.value.key == name
        assert shard_name(root, 1) in exc.value.path
        assert f"tensor {name!r}" in str(exc.value)
        assert "crc32c" in str(exc.value)
        with pytest.raises(CorruptCheckpointError):
            await mgr.load(1, into=state())  # restoring in place refuses too, touching nothing
        assert torch.equal((await mgr.load(2))["model"]["w"], state()["model"]["w"])
    code, out = verify_cli(root)
    assert code == 1
    assert f"step_000000000001/{shard_name(root, 1)}: tensor {name!r} crc32c mismatch" in out
    assert "step 2: ok" in out


async def test_flipped_header_byte_is_caught(root):
    """A flipped byte in the shard's safetensors header: a load refuses it, the header no
    longer saying what the manifest does of the tensors (test_header_agrees.py: what the bytes
    mean is checked), and the whole-shard crc32c in the manifest records that the file differs
    for verify."""
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, state()))
        shard = os.path.join(step_dir(root, 1), shard_name(root, 1))
        flip_byte(shard, 20)
        with pytest.raises(CorruptCheckpointError, match=shard_name(root, 1)):
            await mgr.load(1)
    with pytest.raises(AssertionError, match=shard_name(root, 1)):
        verify_checkpoint(root, 1)
    code, out = verify_cli(root)
    assert code == 1
    assert "whole-file crc32c mismatch" in out


async def test_verify_passes_intact_checkpoints(root):
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, state()))
    assert verify_cli(root)[0] == 0


async def test_missing_manifest_means_not_committed(root):
    """Without its manifest a step does not exist: not listed, not loadable, and load() of the
    latest falls back to the newest step that has one."""
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, {"w": torch.zeros(3)}))
        await (await mgr.save(2, {"w": torch.ones(3)}))
        os.unlink(os.path.join(step_dir(root, 2), "manifest.json"))
        assert await mgr.steps() == [1]
        assert await mgr.latest_step() == 1
        with pytest.raises(CheckpointNotFoundError, match="step 2"):
            await mgr.load(2)
        assert torch.equal((await mgr.load())["w"], torch.zeros(3))


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.5, 0.9, 0.999])
async def test_truncated_manifest_is_refused(root, fraction):
    """A torn manifest is listed (it exists) but refused on load, never half-read; load() of
    the latest refuses too rather than quietly loading an older step."""
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, {"w": torch.zeros(3)}))
        await (await mgr.save(2, {"w": torch.ones(3)}))
        path = os.path.join(step_dir(root, 2), "manifest.json")
        with open(path, "r+b") as f:
            f.truncate(int(os.path.getsize(path) * fraction))
        assert await mgr.steps() == [1, 2]
        for step in (2, None):
            with pytest.raises(CorruptCheckpointError) as exc:
                await mgr.load(step)
            assert exc.value.path.endswith("step_000000000002/manifest.json")
        assert torch.equal((await mgr.load(1))["w"], torch.zeros(3))


async def test_manifest_of_another_step_is_refused(root):
    """A manifest copied into the wrong step directory is refused, not loaded as that step."""
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, {"w": torch.zeros(3)}))
        await (await mgr.save(2, {"w": torch.ones(3)}))
        with open(os.path.join(step_dir(root, 1), "manifest.json"), "rb") as f:
            one = f.read()
        with open(os.path.join(step_dir(root, 2), "manifest.json"), "wb") as f:
            f.write(one)
        with pytest.raises(CorruptCheckpointError, match="does not match its directory"):
            await mgr.load(2)


@pytest.mark.parametrize("change", ["truncate", "extend"])
async def test_shard_of_the_wrong_size_is_refused(root, change):
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, state()))
        shard = os.path.join(step_dir(root, 1), shard_name(root, 1))
        size = os.path.getsize(shard)
        with open(shard, "r+b") as f:
            f.truncate(size - 1 if change == "truncate" else size + 4096)
        with pytest.raises(CorruptCheckpointError, match="the manifest says") as exc:
            await mgr.load(1)
        assert exc.value.path.endswith(shard_name(root, 1))


async def test_swapped_tensor_ranges_are_caught(root):
    """A manifest edited so that two same-sized tensors swap byte ranges (valid JSON, valid
    ranges) fails the crc check instead of loading each tensor into the other's place."""
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, {"a": torch.zeros(8), "b": torch.ones(8)}))
        path = os.path.join(step_dir(root, 1), "manifest.json")
        with open(path) as f:
            m = json.load(f)
        t = m["tensors"][shard_name(root, 1)]
        t["a"]["byte_range"], t["b"]["byte_range"] = t["b"]["byte_range"], t["a"]["byte_range"]
        with open(path, "w") as f:
            json.dump(m, f)
        # The header says where each tensor is, so the swap is refused before the crc32c,
        # which refuses it too (each tensor's bytes are the other's).
        with pytest.raises(CorruptCheckpointError, match="crc32c|disagree on tensor 'a'"):
            await mgr.load(1)
