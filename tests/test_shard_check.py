"""A load of a whole shard is checked by the shard's own crc32c, and still names what is bad.

With many small tensors a check per tensor is Python work per tensor in the daemon, holding
the GIL while its reads wait for it; a load that reads every tensor of a shard reads the
shard's head as well and checks the shard's crc32c instead (see the reader's
``whole_shard``). Only when that fails are the tensors checked one by one, to name the bad
one.
"""

from __future__ import annotations

import pytest
import torch

from aiockpt import AsyncCheckpointManager
from aiockpt._core import format as fmt
from aiockpt._daemon.load.plan import whole_shard
from aiockpt.errors import CorruptCheckpointError
from tests._support.roots import flip_byte, manifest_of, shard_name, shard_path

pytestmark = pytest.mark.anyio

N = 600  # tensors: enough that the head is a small part of the shard


def state() -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((1024,), float(i)) for i in range(N)}


def zeros() -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.zeros(1024) for i in range(N)}


def load_ends(events: list) -> list:
    return [e for e in events if e.name == "load.end"]


def shard_file(root: str, step: int) -> str:
    return shard_path(root, step)


def record(root: str, step: int, name: str) -> dict:
    return manifest_of(root, step)["tensors"][shard_name(root, step)][name]


async def test_a_load_of_every_tensor_reads_the_whole_shard(tmp_path):
    """The head is read with the tensors: the bytes read are the shard's size, and both
    kinds of load restore every tensor. A load as new tensors from a local root is read by
    the trainer, each tensor checked by its own crc32c: it reads the tensors' bytes alone."""
    root, events = str(tmp_path), []
    async with AsyncCheckpointManager(root, event_handlers=[events.append]) as mgr:
        await (await mgr.save(1, state()))
        nbytes = manifest_of(root, 1)["shards"][0]["nbytes"]
        target = zeros()
        await mgr.load(1, into=target)
        fresh = await mgr.load(1)
    tensors = N * 1024 * 4
    assert [e.read_nbytes for e in load_ends(events)] == [nbytes, tensors]
    for i in range(N):
        assert torch.equal(target[f"t{i}"], torch.full((1024,), float(i)))
        assert torch.equal(fresh[f"t{i}"], torch.full((1024,), float(i)))


async def test_a_partial_load_reads_only_its_tensors(tmp_path):
    """``keys`` and a target holding fewer tensors read what they select, not the head."""
    root, events = str(tmp_path), []
    async with AsyncCheckpointManager(root, event_handlers=[events.append]) as mgr:
        await (await mgr.save(1, state()))
        picked = await mgr.load(1, keys=["t7"])
        target = {"t3": torch.zeros(1024)}
        await mgr.load(1, into=target, strict=False)
    assert [e.read_nbytes for e in load_ends(events)] == [1024 * 4, 1024 * 4]
    assert torch.equal(picked["t7"], torch.full((1024,), 7.0))
    assert torch.equal(target["t3"], torch.full((1024,), 3.0))


@pytest.mark.parametrize("into", [True, False])
async def test_a_bad_tensor_is_named_and_the_target_left_untouched(tmp_path, into):
    root = str(tmp_path)
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, state()))
        start, _ = record(root, 1, "t321")["byte_range"]
        flip_byte(shard_file(root, 1), start + 5)
        target = zeros()
        with pytest.raises(CorruptCheckpointError, match="'t321' failed its crc32c") as err:
            await mgr.load(1, into=target if into else None)
        assert err.value.key == "t321"
        assert all(not t.any() for t in target.values())


async def test_damage_to_the_head_alone_is_refused_and_leaves_the_target(tmp_path):
    """The head (the safetensors header) says what each tensor's bytes mean, and a load
    checks it against the manifest (see test_header_agrees.py): damaged, it is refused as
    corrupt before anything is copied, though every tensor passes its own crc32c."""
    root = str(tmp_path)
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, state()))
        flip_byte(shard_file(root, 1), 20)  # inside the header's JSON
        target = zeros()
        with pytest.raises(CorruptCheckpointError):
            await mgr.load(1, into=target)
        assert torch.equal(target["t599"], torch.zeros(1024))


def test_which_loads_are_checked_whole():
    """Only a load of every record of a shard, and nothing else, whose head is at most a
    sixteenth of its tensors' bytes."""
    shard = fmt.ShardRecord(file="shard_r00000.safetensors", rank=0, nbytes=17_000, crc32c=7)
    run = [(1000, 17_000, [("a", None), ("b", None), ("c", None)])]
    assert whole_shard(shard, run, [], of=3) is shard
    assert whole_shard(shard, run, [], of=4) is None  # not every record
    assert whole_shard(shard, run, [("x", "F32", None)], of=3) is None  # a box as well
    assert whole_shard(shard, run * 2, [], of=6) is None  # two runs
    assert whole_shard(shard, [(1000, 16_999, run[0][2])], [], of=3) is None  # not to the end
    assert whole_shard(shard, [(1001, 17_000, run[0][2])], [], of=3) is None  # head too large
