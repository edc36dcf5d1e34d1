"""``load()`` from a local root: the training process reads the files straight into the new
tensors it returns (the daemon plans, the trainer reads), with no shared-memory segment, every
tensor's crc32c checked and every hard-edge rule kept."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from _support.roots import flip_byte, manifest_of, shard_path

from aiockpt import AsyncCheckpointManager
from aiockpt.errors import CorruptCheckpointError, StorageError

pytestmark = pytest.mark.anyio

MiB = 1 << 20


def shm_mappings() -> set[str]:
    """The shared-memory files this process maps (a load's segment stays mapped while its
    tensors live)."""
    with open("/proc/self/maps") as f:
        return {line.split(None, 5)[5].strip() for line in f if "/dev/shm/" in line}


def mapping_of(address: int) -> str:
    """The file behind the mapping holding ``address`` of this process ('' if anonymous)."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(None, 5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return fields[5].strip() if len(fields) > 5 else ""
    return ""


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(3 * MiB // 4, generator=g),  # 3 MiB
        "mat": torch.randn(512, 513, generator=g),
        "half": torch.randn(1001, generator=g).to(torch.bfloat16),
        "small": {f"t{i}": torch.randn(i + 1, generator=g) for i in range(40)},
        "ints": torch.arange(77, dtype=torch.int64),
        "empty": torch.empty(0, 3),
        "rng": torch.Generator().manual_seed(seed).get_state(),
        "step": seed,
    }


def assert_same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype
        assert a.shape == b.shape
        if a.numel():
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    elif isinstance(a, dict):
        assert isinstance(b, dict)
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    else:
        assert a == b


def tensor_offset(path: str, name: str) -> int:
    """Where tensor ``name``'s bytes start in the safetensors file ``path``."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return 8 + n + header[name]["data_offsets"][0]


async def test_a_local_load_is_read_into_tensors_of_its_own(root):
    saved = state(1)
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, saved))
        before = shm_mappings()
        loaded = await mgr.load()
        after = shm_mappings()
    assert after <= before, f"a load mapped shared memory: {sorted(after - before)}"
    assert_same(saved, loaded)
    flat = [loaded["big"], loaded["mat"], loaded["half"], loaded["ints"], loaded["rng"]]
    flat += list(loaded["small"].values())
    for t in flat:
        where = mapping_of(t.data_ptr())
        assert "/dev/shm/" not in where, where
    # The big tensors own their memory: freeing one frees it, whatever the others do.
    assert loaded["big"].untyped_storage().nbytes() == loaded["big"].nbytes
    assert loaded["mat"].untyped_storage().nbytes() == loaded["mat"].nbytes
    torch.set_rng_state(loaded["rng"])  # an RNG state owns its memory, from its start


async def test_a_corrupted_byte_names_the_file_and_the_tensor(root):
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, state(1)))
        path = shard_path(root, 1)
        flip_byte(path, tensor_offset(path, "mat") + 12345)
        with pytest.raises(CorruptCheckpointError) as exc:
            await mgr.load()
    assert "'mat'" in str(exc.value)
    assert os.path.basename(path) in str(exc.value)
    assert exc.value.key == "mat"


def big_state(seed: int, changed: int) -> dict:
    """A 24 MiB tensor, a 4 MiB one that changes with ``changed``, and a small one."""
    g = torch.Generator().manual_seed(seed)
    frozen = torch.randn(6 * MiB, generator=g)
    moving = torch.randn(MiB, generator=torch.Generator().manual_seed(changed))
    return {"frozen": frozen, "moving": moving, "bias": torch.arange(10.0) + changed}


async def test_incremental_checkpoints_load_bit_exact(root):
    async with AsyncCheckpointManager(root) as mgr:
        for step in (1, 2, 3):
            await (await mgr.save(step, big_state(0, step)))
        assert any(b[2] for b in manifest_of(root, 3)["shards"][0]["blocks"]), "nothing reused"
        before = shm_mappings()
        for step in (1, 2, 3):
            assert_same(big_state(0, step), await mgr.load(step))
        assert shm_mappings() <= before


async def test_a_referenced_file_cut_short_under_a_load_is_an_error(root):
    """Step 2's frozen blocks lie in step 1's file; that file cut short after the save (the
    load's plan does not read it) is an error of the load, never a signal."""
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, big_state(0, 1)))
        await (await mgr.save(2, big_state(0, 2)))
        first = shard_path(root, 1)
        assert any(b[2] for b in manifest_of(root, 2)["shards"][0]["blocks"]), "nothing reused"
        os.truncate(first, os.path.getsize(first) // 3)
        with pytest.raises((CorruptCheckpointError, StorageError)) as exc:
            await mgr.load(2)
    assert os.path.basename(first) in str(exc.value)
