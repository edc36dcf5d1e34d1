"""Checkpoints of every format version, kept in tests/fixtures, still load.

The fixtures were written by the aiockpt release that introduced each version and are never
rewritten: a change to the format that breaks one of them breaks a promise to every user with
checkpoints on disk.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import torch

from aiockpt import AsyncCheckpointManager, LatestN

FIXTURES = Path(__file__).parent / "fixtures"
SCRIPT = str(Path(sys.executable).parent / "aiockpt")


@pytest.fixture
def v1_root(tmp_path: Path) -> str:
    root = tmp_path / "v1"
    shutil.copytree(FIXTURES / "format_v1", root)
    return str(root)


def test_format_v1_checkpoint_loads(v1_root: str) -> None:
    events = []

    async def main() -> tuple[list[int], dict]:
        async with AsyncCheckpointManager(v1_root, event_handlers=[events.append]) as mgr:
            return await mgr.steps(), await mgr.load()

    steps, state = anyio.run(main)
    assert steps == [7]
    (end,) = [e for e in events if e.name == "load.end"]
    assert end.read_nbytes == 24 + 24 + 6 + 2  # the four tensors' bytes, nothing else
    model = state["model"]
    assert torch.equal(model["w"], torch.arange(6.0).view(2, 3))
    assert torch.equal(model["b"], torch.ones(3, dtype=torch.float16))
    assert torch.equal(model["i"], torch.tensor([1, -2, 3]))
    assert torch.equal(model["m"], torch.tensor([True, False]))
    assert state["step"] == 7
    assert state["name"] == "v1"
    assert math.isnan(state["lr"])
    assert state["sched"] == (1, [2.5, None])


def test_format_v1_checkpoint_loads_into_a_state(v1_root: str) -> None:
    target = {"model": {"w": torch.zeros(2, 3)}, "step": 0}

    async def main() -> dict:
        async with AsyncCheckpointManager(v1_root) as mgr:
            return await mgr.load(7, into=target, strict=False)

    out = anyio.run(main)
    assert out is target
    assert torch.equal(target["model"]["w"], torch.arange(6.0).view(2, 3))


def test_format_v1_checkpoint_verifies(v1_root: str) -> None:
    done = subprocess.run([SCRIPT, "verify", v1_root], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.fixture
def v2_root(tmp_path: Path) -> str:
    root = tmp_path / "v2"
    shutil.copytree(FIXTURES / "format_v2", root)
    return str(root)


def v2_expected() -> dict:
    """What the version 2 fixture holds: written on 2 gloo ranks by tests/_dtensor_worker.py
    (scenario fixture_v2)."""
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(6, 10, generator=g),  # Shard(1): 5 + 5 columns
        "rep": torch.arange(12.0).view(3, 4),  # Replicate(): stored once
        "i": torch.arange(7, dtype=torch.int64),  # Shard(0): 4 + 3
        "plain": torch.arange(3, dtype=torch.int8),
    }


def test_format_v2_checkpoint_loads_whole_in_one_process(v2_root: str) -> None:
    async def main() -> dict:
        async with AsyncCheckpointManager(v2_root) as mgr:
            return await mgr.load()

    state = anyio.run(main)
    assert state["step"] == 5
    for name, value in v2_expected().items():
        assert torch.equal(state[name], value), name


def test_format_v2_checkpoint_verifies_and_reads_with_safetensors(v2_root: str) -> None:
    from safetensors import safe_open

    done = subprocess.run([SCRIPT, "verify", v2_root], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    shard = Path(v2_root) / "step_000000000005" / "shard_r00001.safetensors"
    with safe_open(str(shard), "pt") as f:
        # Rank 1's chunk of "w": columns 5-9.
        assert torch.equal(f.get_tensor("w"), v2_expected()["w"][:, 5:])


@pytest.fixture
def v3_root(tmp_path: Path) -> str:
    """Steps 3 and 4 saved with deduplication, retention keeping one: step 4's shard holds
    its small tensor and reads its 1 MiB tensor from step 3's file, kept in a retired step
    directory (no manifest)."""
    root = tmp_path / "v3"
    shutil.copytree(FIXTURES / "format_v3", root)
    return str(root)


def test_format_v3_checkpoint_loads_through_its_block_table(v3_root: str) -> None:
    events = []

    async def main() -> tuple[list[int], dict]:
        async with AsyncCheckpointManager(v3_root, event_handlers=[events.append]) as mgr:
            return await mgr.steps(), await mgr.load()

    steps, state = anyio.run(main)
    assert steps == [4]
    assert torch.equal(state["big"], torch.arange(262144, dtype=torch.float32))
    assert torch.equal(state["small"], torch.full((4,), 4.0))
    assert state["step"] == 4
    assert state["name"] == "v3"
    # Opening a writing manager kept the retired file step 4 reads from.
    assert (Path(v3_root) / "step_000000000003" / "shard_r00000.safetensors").exists()


def test_format_v3_checkpoint_verifies_and_copies_whole(v3_root: str, tmp_path: Path) -> None:
    done = subprocess.run([SCRIPT, "verify", v3_root], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    dest = str(tmp_path / "copy")
    done = subprocess.run([SCRIPT, "copy", v3_root, "4", dest], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    shutil.rmtree(v3_root)

    async def main() -> dict:
        async with AsyncCheckpointManager(dest, read_only=True) as mgr:
            return await mgr.load()

    assert torch.equal(anyio.run(main)["big"], torch.arange(262144, dtype=torch.float32))


@pytest.fixture
def v4_root(tmp_path: Path) -> str:
    """Version 3's scenario written as version 4: every shard file named by its attempt."""
    root = tmp_path / "v4"
    shutil.copytree(FIXTURES / "format_v4", root)
    return str(root)


def test_format_v4_checkpoint_loads_through_its_block_table(v4_root: str) -> None:
    async def main() -> tuple[list[int], dict]:
        async with AsyncCheckpointManager(v4_root) as mgr:
            return await mgr.steps(), await mgr.load()

    steps, state = anyio.run(main)
    assert steps == [4]
    assert torch.equal(state["big"], torch.arange(262144, dtype=torch.float32))
    assert torch.equal(state["small"], torch.full((4,), 4.0))
    assert state["name"] == "v4"
    (retired,) = (Path(v4_root) / "step_000000000003").iterdir()
    assert retired.name.startswith("shard_r00000.")
    done = subprocess.run([SCRIPT, "verify", v4_root], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_version_4_save_reads_from_a_version_3_file_and_outlives_it(v3_root: str) -> None:
    """Incremental references across the versions: a new save into a version 3 root refers
    to the untagged retired file the version 3 step reads from; once that step is deleted,
    the file stays for the new one, and a rewind onto step 3 leaves it alone."""
    big = torch.arange(262144, dtype=torch.float32)

    async def main() -> tuple[dict, dict]:
        async with AsyncCheckpointManager(v3_root, retention=LatestN(1)) as mgr:
            await (await mgr.save(5, {"big": big, "small": torch.full((4,), 5.0)}))
            assert await mgr.steps() == [5]
            await (await mgr.save(3, {"big": big + 1, "small": torch.full((4,), 3.0)}))
            return await mgr.load(5), await mgr.load(3)

    five, three = anyio.run(main)
    manifest = json.loads((Path(v3_root) / "step_000000000005" / "manifest.json").read_text())
    assert manifest["version"] == 4
    sources = {b[2] for b in manifest["shards"][0]["blocks"]} - {""}
    assert sources == {"step_000000000003/shard_r00000.safetensors"}
    assert torch.equal(five["big"], big)
    assert torch.equal(three["big"], big + 1)
    done = subprocess.run([SCRIPT, "verify", v3_root], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture
def v4_replaced_root(tmp_path: Path) -> str:
    """A replaced step (docs/format.md#replacing-a-step): step 2 saved, step 3 reading its
    big tensor from step 2's file, then step 2 replaced with ``overwrite=True``; step 2's
    directory holds its manifest, the new attempt's file and the replaced one's, which step 3
    still reads."""
    root = tmp_path / "v4-replaced"
    shutil.copytree(FIXTURES / "format_v4_replaced", root)
    return str(root)


def test_a_replaced_step_loads_the_replacement_and_the_step_reading_the_replaced_file(
    v4_replaced_root: str,
) -> None:
    big = torch.arange(262144, dtype=torch.float32)

    async def main() -> tuple[list[int], dict, dict]:
        async with AsyncCheckpointManager(v4_replaced_root, read_only=True) as mgr:
            return await mgr.steps(), await mgr.load(2), await mgr.load(3)

    steps, two, three = anyio.run(main)
    assert steps == [2, 3]
    assert two["name"] == "replaced"
    assert torch.equal(two["big"], big + 1)
    assert torch.equal(two["small"], torch.full((4,), 20.0))
    assert three["name"] == "v4"
    assert torch.equal(three["big"], big)
    step_dir = Path(v4_replaced_root) / "step_000000000002"
    named = json.loads((step_dir / "manifest.json").read_text())["shards"][0]["file"]
    shards = sorted(p.name for p in step_dir.iterdir() if p.name != "manifest.json")
    assert len(shards) == 2
    assert named in shards
    done = subprocess.run([SCRIPT, "verify", v4_replaced_root], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr

    async def delete_three() -> dict:
        async with AsyncCheckpointManager(v4_replaced_root) as mgr:
            await mgr.delete(3, allow_latest=True)
            return await mgr.load(2)

    assert torch.equal(anyio.run(delete_three)["big"], big + 1)
    assert sorted(p.name for p in step_dir.iterdir()) == sorted([named, "manifest.json"])
