"""A load into the run's slab reads the shard as it lies in the file, when it can.

A ``load(into=state)`` lends the daemon the slab the next save of ``state`` uses, whose views
of the state's layout are already made. When the shard's head is the header of that layout
(a run resuming into the state it saved), the daemon reads the tensors where the file has
them, which is where those views are, and answers without a place for each tensor
(``LoadReq.image``, ``LoadReply.image``). Otherwise it reads as before.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from aiockpt import AsyncCheckpointManager
from aiockpt._core.catalog import Catalog
from aiockpt._core.protocol import CollectReq, LoadAsk, LoadReq, SlabRef
from aiockpt._core.shm import Segment
from aiockpt._daemon.load import Reader
from aiockpt._daemon.shared import Slabs
from aiockpt._trainer.staging import make_layout
from aiockpt._trainer.state import flatten
from aiockpt.errors import CorruptCheckpointError, LoadMismatchError
from aiockpt.storage import open_storage
from tests._support.roots import flip_byte, manifest_of, shard_name, shard_path

pytestmark = pytest.mark.anyio

N = 400  # tensors of each kind: the head stays a small part of the shard


def state(seed: float = 1.0) -> dict:
    """Mixed dtypes, RNG states (small byte tensors, which a load gives memory of their
    own), a generator and a value that is not a tensor."""
    gen = torch.Generator().manual_seed(int(seed))
    out: dict = {"step": int(seed), "rng": torch.get_rng_state(), "gen": gen}
    for i in range(N):
        out[f"f{i}"] = torch.full((4096,), seed + i)
        out[f"h{i}"] = torch.full((3, 5), seed - i, dtype=torch.bfloat16)
        out[f"n{i}"] = torch.arange(7, dtype=torch.int64) * i
    return out


def blank(template: dict) -> dict:
    out = {k: torch.zeros_like(v) for k, v in template.items() if isinstance(v, torch.Tensor)}
    return {**out, "step": 0, "gen": torch.Generator()}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, b[k]), k
        elif isinstance(v, torch.Generator):
            assert torch.equal(v.get_state(), b[k].get_state()), k
        else:
            assert v == b[k], k


async def save(root: str, step: int, value: dict) -> None:
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(step, value))


async def test_the_layout_of_the_saved_state_is_the_shards_head(tmp_path):
    """What lets a resumed run's load read the file's image: the trainer's layout of the
    state it saved is, byte for byte, the head of the shard that save wrote."""
    root, saved = str(tmp_path), state()
    await save(root, 1, saved)
    layout = make_layout(flatten(blank(saved)))
    with open(shard_path(root, 1), "rb") as f:
        head = f.read(layout.data_start)
    assert layout.image == (len(head), hashlib.sha256(head).digest())


@pytest.fixture
def reader(tmp_path):
    with ThreadPoolExecutor(2) as pool:
        reader = Reader(Catalog(open_storage(str(tmp_path))), Slabs(), pool)
        yield reader
        reader.close()


@pytest.fixture
def slab():
    made: list[Segment] = []

    def make(size: int) -> Segment:
        made.append(Segment.create(size))
        return made[-1]

    yield make
    for seg in made:
        seg.close()
        seg.unlink()


def read_early(reader: Reader, seg: Segment, image) -> tuple:
    """A load into ``seg`` answered early, then collected: (answer, outcome)."""
    slab = SlabRef(seg.name, seg.size)
    answer = reader.load(LoadReq(0, LoadAsk(None, 0, 1), slab=slab, early="x", image=image))
    reader.early.read()
    return answer, reader.collect(CollectReq(0, "x"))


async def test_a_shard_whose_head_is_the_layout_is_read_as_its_image(tmp_path, reader, slab):
    root, saved = str(tmp_path), state()
    await save(root, 1, saved)
    layout = make_layout(flatten(saved))
    seg = slab(layout.file_size)
    answer, done = read_early(reader, seg, layout.image)
    assert answer.image
    assert answer.pending
    assert answer.tensors == {}  # the trainer's layout says where each lies
    assert done.read_nbytes == os.path.getsize(shard_path(root, 1))
    with open(shard_path(root, 1), "rb") as f:
        file = f.read()
    lo = layout.data_start
    assert bytes(seg.buf[lo : layout.file_size]) == file[lo:]


async def test_a_head_that_differs_is_read_as_before(tmp_path, reader, slab):
    """Another layout (its header's digest differs), or the same one over a damaged head:
    every tensor's place is sent, at the file's offsets when the slab holds the file."""
    root, saved = str(tmp_path), state()
    await save(root, 1, saved)
    layout = make_layout(flatten(saved))
    records = manifest_of(root, 1)["tensors"][shard_name(root, 1)]
    seg = slab(layout.file_size)
    for image in [(layout.data_start, b"\0" * 32), (layout.data_start + 4096, layout.digest)]:
        answer, done = read_early(reader, seg, image)
        assert not answer.image
        assert {k: at[2] for k, at in answer.tensors.items()} == {
            k: r["byte_range"][0] for k, r in records.items()
        }
        assert done.read_nbytes == os.path.getsize(shard_path(root, 1))
    flip_byte(shard_path(root, 1), 30)  # inside the header's JSON: the tensors are intact
    answer, _ = read_early(reader, seg, layout.image)
    assert not answer.image
    assert len(answer.tensors) == len(records)


async def test_a_slab_too_small_for_the_file_gets_the_tensors_from_its_start(
    tmp_path, reader, slab
):
    root, saved = str(tmp_path), state()
    await save(root, 1, saved)
    layout = make_layout(flatten(saved))
    data = layout.file_size - layout.data_start
    seg = slab(data)
    answer, _ = read_early(reader, seg, layout.image)
    assert not answer.image
    assert min(at[2] for at in answer.tensors.values()) == 0


async def test_a_resumed_run_loads_saves_and_loads_again(tmp_path):
    """A new process's load reads into a fresh slab as the file's image; the save after it
    writes the header again over a slab whose head the load left as it was, and every step
    loads bit-exact, into the state and as new tensors."""
    root, first = str(tmp_path), state(1.0)
    await save(root, 1, first)
    async with AsyncCheckpointManager(root) as mgr:
        target = blank(first)
        await mgr.load(1, into=target)
        assert_same(target, first)
        for k, v in state(2.0).items():
            if isinstance(v, torch.Tensor):
                target[k].copy_(v)
            elif isinstance(v, torch.Generator):
                target[k].set_state(v.get_state())
            else:
                target[k] = v
        await (await mgr.save(2, target))
        again = blank(first)
        await mgr.load(2, into=again)
        assert_same(again, state(2.0))
    async with AsyncCheckpointManager(root, read_only=True) as mgr:
        assert_same(await mgr.load(2), state(2.0))
        assert_same(await mgr.load(1), first)


async def test_what_a_load_read_as_an_image_checks_is_unchanged(tmp_path):
    """A damaged tensor is named and the target left as it was; a target tensor of another
    shape is refused the same way: the image's views are the tensors a load would view."""
    root, saved = str(tmp_path), state()
    await save(root, 1, saved)
    async with AsyncCheckpointManager(root) as mgr:
        target = blank(saved)
        target["f3"] = torch.zeros(4095)
        with pytest.raises(LoadMismatchError, match="f3"):
            await mgr.load(1, into=target)
        assert not any(t.any() for k, t in target.items() if isinstance(t, torch.Tensor))
        record = manifest_of(root, 1)["tensors"][shard_name(root, 1)]["h17"]
        flip_byte(shard_path(root, 1), record["byte_range"][0] + 3)
        target = blank(saved)
        with pytest.raises(CorruptCheckpointError, match="'h17' failed its crc32c") as err:
            await mgr.load(1, into=target)
        assert err.value.key == "h17"
        assert not any(t.any() for k, t in target.items() if isinstance(t, torch.Tensor))
