"""Errors say what happened: a step deleted under a load is not found, a manifest that is
not a file is corruption."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import torch
from _support.roots import manifest_of

from aiockpt import AsyncCheckpointManager
from aiockpt._core import format as fmt
from aiockpt._core.catalog import Catalog
from aiockpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from aiockpt.storage import LocalStorage


@pytest.mark.anyio
async def test_a_step_deleted_while_it_is_loaded_is_not_found(tmp_path, test_storages):
    root, vanish = str(tmp_path / "run"), tmp_path / "vanish"
    url = f"vanishing://{root}"
    async with AsyncCheckpointManager(url, storage_options={"vanish": str(vanish)}) as mgr:
        for step in (1, 2):
            await (await mgr.save(step, {"w": torch.full((1000,), float(step))}))
        vanish.touch()  # step 1 is deleted as its shard is first read
        with pytest.raises(CheckpointNotFoundError, match="deleted .* while it was being loaded"):
            await mgr.load(1)
        assert await mgr.steps() == [2]
        assert torch.equal((await mgr.load())["w"], torch.full((1000,), 2.0))


@pytest.mark.anyio
async def test_a_manifest_that_is_a_directory_is_corrupt(root):
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, {"w": torch.ones(3)}))
    manifest = Path(root) / fmt.step_dirname(1) / fmt.MANIFEST
    os.unlink(manifest)
    manifest.mkdir()
    async with AsyncCheckpointManager(root, read_only=True) as mgr:
        with pytest.raises(CorruptCheckpointError, match="directory"):
            await mgr.load(1)


def test_ls_reads_a_manifests_head_not_its_whole(root, tmp_path):
    """A manifest grown to hundreds of MiB (a sparse file, say) costs `ls` its first bytes,
    not all of them; the listing of a normal root is unchanged; a load still reads and
    checks it whole, and refuses it."""

    async def save() -> None:
        async with AsyncCheckpointManager(root) as mgr:
            for step in (1, 2):
                await (await mgr.save(step, {"w": torch.ones(3)}, metrics={"loss": 0.5}))

    anyio.run(save)
    before = cli("ls", root, "--json")
    assert before.returncode == 0, before.stderr
    manifest = Path(root) / fmt.step_dirname(2) / fmt.MANIFEST
    with open(manifest, "r+b") as f:  # a sparse tail of 512 MiB after the closing brace
        f.truncate(manifest.stat().st_size + (512 << 20))
    storage = CountingReads(root)
    head = Catalog(storage).read_head(2)
    assert head.metrics == {"loss": 0.5}
    assert storage.read <= 64 << 10  # its head: one small read
    after = cli("ls", root, "--json")
    assert after.returncode == 0, after.stderr
    assert after.stdout == before.stdout

    async def load() -> None:
        async with AsyncCheckpointManager(root, read_only=True) as mgr:
            with pytest.raises(CorruptCheckpointError):
                await mgr.load(2)

    anyio.run(load)


class CountingReads(LocalStorage):
    """A local root that counts the bytes read."""

    read = 0

    def read_range(self, path: str, start: int, end: int) -> bytes:
        self.read += end - start
        return super().read_range(path, start, end)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    script = str(Path(sys.executable).parent / "aiockpt")
    return subprocess.run([script, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("kind", ["fifo", "outside"])
def test_a_hostile_file_in_place_of_a_referenced_file_is_corrupt(root, tmp_path, kind):
    """Step 2 reads a tensor from step 1's file: a FIFO, or a link out of the root, in that
    file's place fails load, load(into=), verify, export and copy in time, naming the file."""
    big = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB: a block step 2 refers to

    async def save() -> None:
        async with AsyncCheckpointManager(root) as mgr:
            for step in (1, 2):
                await (await mgr.save(step, {"big": big, "small": torch.full((4,), float(step))}))

    anyio.run(save)
    (source,) = {b[2] for b in manifest_of(root, 2)["shards"][0]["blocks"]} - {""}
    path = Path(root) / source
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:
        outside = tmp_path / "elsewhere.safetensors"
        outside.write_bytes(b"\0" * (2 << 20))
        path.symlink_to(outside)

    async def loads() -> None:
        async with AsyncCheckpointManager(root, read_only=True) as mgr:
            with anyio.fail_after(20):
                with pytest.raises(CorruptCheckpointError, match=source):
                    await mgr.load(2)
                target = {"big": torch.zeros(1 << 18), "small": torch.zeros(4)}
                with pytest.raises(CorruptCheckpointError, match=source):
                    await mgr.load(2, into=target)
                assert not target["big"].any()

    anyio.run(loads)
    for args in (
        ("verify", root, "2"),
        ("export", root, str(tmp_path / "out.safetensors"), "--step", "2"),
        ("copy", root, "2", str(tmp_path / "dest")),
    ):
        r = cli(*args)
        assert r.returncode == 1, (args, r.stdout, r.stderr)
        assert source in r.stdout + r.stderr, (args, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr
