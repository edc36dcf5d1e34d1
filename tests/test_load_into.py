"""load(into=...) checks the whole target before it changes any of it, and strict says whether
the checkpoint and the target must hold the same keys."""

from __future__ import annotations

import logging
import os

import anyio
import pytest
import torch

from aiockpt import AsyncCheckpointManager
from aiockpt.errors import CorruptCheckpointError, LoadMismatchError

pytestmark = pytest.mark.anyio


def saved_state() -> dict:
    torch.manual_seed(0)
    enc, head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW([*enc.parameters(), *head.parameters()])
    (head(enc(torch.randn(3, 4)))).sum().backward()
    opt.step()
    return {"enc": enc, "head": head, "optim": opt, "step": 5, "w": torch.ones(3)}


def fresh(head_rows: int = 2) -> dict:
    enc, head = torch.nn.Linear(4, 4), torch.nn.Linear(4, head_rows)
    return {
        "enc": enc,
        "head": head,
        "optim": torch.optim.AdamW([*enc.parameters(), *head.parameters()]),
        "step": 0,
        "w": torch.zeros(3),
    }


def snapshot(state: dict) -> dict:
    return {
        "enc": {k: v.clone() for k, v in state["enc"].state_dict().items()},
        "head": {k: v.clone() for k, v in state["head"].state_dict().items()},
        "optim": len(state["optim"].state),
        "step": state["step"],
        "w": state["w"].clone(),
        "keys": sorted(state),
    }


def assert_untouched(state: dict, before: dict) -> None:
    after = snapshot(state)
    assert after["keys"] == before["keys"]
    assert after["step"] == before["step"]
    assert after["optim"] == before["optim"]
    assert torch.equal(after["w"], before["w"])
    for part in ("enc", "head"):
        for k, v in before[part].items():
            assert torch.equal(after[part][k], v), (part, k)


@pytest.fixture
async def mgr(root):
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, saved_state()))
        yield mgr


async def test_a_module_that_does_not_fit_leaves_every_earlier_part_untouched(mgr):
    target = fresh(head_rows=3)  # "enc" comes first and fits; "head" has 3 rows, not 2
    before = snapshot(target)
    with pytest.raises(LoadMismatchError, match=r"head/weight: saved torch.float32\[2, 4\]"):
        await mgr.load(1, into=target)
    assert_untouched(target, before)


async def test_a_tensor_that_does_not_fit_leaves_the_target_untouched(mgr):
    target = fresh()
    target["w"] = torch.zeros(3, dtype=torch.float64)
    before = snapshot(target)
    with pytest.raises(LoadMismatchError, match="w: saved torch.float32"):
        await mgr.load(1, into=target)
    assert_untouched(target, before)


async def test_an_optimizer_of_other_parameter_groups_leaves_the_target_untouched(mgr):
    target = fresh()
    enc, head = target["enc"], target["head"]
    target["optim"] = torch.optim.AdamW(
        [{"params": list(enc.parameters())}, {"params": list(head.parameters())}]
    )
    before = snapshot(target)
    with pytest.raises(LoadMismatchError, match="optim: saved 1 parameter groups"):
        await mgr.load(1, into=target)
    assert_untouched(target, before)


async def test_strict_refuses_keys_on_either_side_listing_both(mgr):
    target = fresh()
    del target["step"]
    target["extra"] = 1
    before = snapshot({**target, "step": 0})
    with pytest.raises(LoadMismatchError) as info:
        await mgr.load(1, into=target)
    message = str(info.value)
    assert "saved but not in the target: step" in message
    assert "in the target but not saved: extra" in message
    assert "strict=False" in message
    assert "step" not in target
    assert_untouched({**target, "step": 0}, {**before, "keys": sorted([*target, "step"])})


async def test_strict_false_restores_what_matches_and_logs_the_rest(mgr, caplog):
    target = fresh()
    del target["step"]
    target["extra"] = 1
    with caplog.at_level(logging.WARNING, logger="aiockpt"):
        out = await mgr.load(1, into=target, strict=False)
    assert out is target
    assert "step" not in target  # saved, not in the target: not restored
    assert target["extra"] == 1  # in the target, not saved: left as it was
    assert torch.equal(target["w"], torch.ones(3))
    assert torch.equal(target["head"].weight, saved_state()["head"].weight)
    (record,) = [r for r in caplog.records if "strict=False" in r.getMessage()]
    assert "['step']" in record.getMessage()
    assert "['extra']" in record.getMessage()


async def test_strict_must_be_a_bool(mgr):
    with pytest.raises(TypeError, match="strict must be a bool"):
        await mgr.load(1, into=fresh(), strict="no")


# ------------------------------------------------- the restore planned while the daemon reads


def flip_last_byte(url: str) -> None:
    (shard,) = (n for n in os.listdir(url) if n.startswith("shard_r00000."))
    with open(os.path.join(url, shard), "r+b") as f:
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))


async def test_a_corrupt_shard_leaves_the_target_untouched(root):
    """The daemon answers with where the tensors will lie before it reads them, and the
    trainer plans the restore meanwhile: a checksum failing in that read still changes
    nothing, and the slab comes back."""
    async with AsyncCheckpointManager(root) as mgr:
        info = await (await mgr.save(1, saved_state()))
        flip_last_byte(info.url)
        target = fresh()
        before = snapshot(target)
        with pytest.raises(CorruptCheckpointError, match="failed its crc32c check"):
            await mgr.load(1, into=target)
        assert_untouched(target, before)
        assert mgr._pool.busy == 0
        # The daemon is left with nothing of that load: the next ones go as usual.
        await (await mgr.save(2, saved_state()))
        await mgr.load(2, into=target)
    assert torch.equal(target["w"], torch.ones(3))
    assert target["step"] == 5


async def test_a_mismatch_found_while_the_daemon_reads_is_raised_once_it_is_done(root):
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, saved_state()))
        target = fresh(head_rows=3)
        before = snapshot(target)
        with pytest.raises(LoadMismatchError, match="head"):
            await mgr.load(1, into=target)
        assert_untouched(target, before)
        assert mgr._pool.busy == 0
        ok = fresh()
        await mgr.load(1, into=ok)
        assert ok["step"] == 5
        loaded = await mgr.load(1)
        assert torch.equal(loaded["w"], torch.ones(3))


def test_collecting_a_load_never_answered_early_is_an_error(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from aiockpt._core.catalog import Catalog
    from aiockpt._core.protocol import CollectReq
    from aiockpt._daemon.load import Reader
    from aiockpt._daemon.shared import Slabs
    from aiockpt.errors import CheckpointError
    from aiockpt.storage import open_storage

    with ThreadPoolExecutor(1) as pool:
        reader = Reader(Catalog(open_storage(str(tmp_path))), Slabs(), pool)
        with pytest.raises(CheckpointError, match="no load named 'x' was answered early"):
            reader.collect(CollectReq(0, "x"))


class _FakePlan:
    """What _Early uses of a load's plan: its reply, made here by ``make``."""

    tree = None

    def __init__(self, make):
        self.make = make

    def placed(self):
        return {}

    def reply(self, **fields):
        return self.make(fields)


def test_a_read_into_a_lent_slab_starts_before_its_answer_is_built():
    """The read ahead runs while the answer is made; collecting gives its outcome."""
    import threading

    from aiockpt._daemon.load.answer import _Early

    started = threading.Event()

    def make(fields):
        assert started.wait(10), "the read had not started while the answer was built"
        return fields

    def read():
        started.set()
        return 123

    early = _Early()
    answer = early.answer("a", _FakePlan(make), read, ahead=True)
    assert answer["pending"] is True
    early.read()
    collected = early.collect("a")
    assert collected["read_nbytes"] == 123


def test_a_read_started_ahead_is_waited_for_when_its_answer_cannot_be_made():
    """The trainer takes its slab back on hearing of the failure: nothing may still be
    reading into it by then, and the load is forgotten."""
    import threading
    import time

    from aiockpt._daemon.load.answer import _Early
    from aiockpt.errors import CheckpointError

    finished = []
    started = threading.Event()

    def make(fields):
        started.wait(10)
        raise RuntimeError("cannot make the answer")

    def read():
        started.set()
        time.sleep(0.2)
        finished.append(True)
        return 1

    early = _Early()
    with pytest.raises(RuntimeError, match="cannot make the answer"):
        early.answer("a", _FakePlan(make), read, ahead=True)
    assert finished == [True]
    early.read()
    with pytest.raises(CheckpointError, match="no load named 'a' was answered early"):
        early.collect("a")


def test_a_read_not_ahead_waits_for_its_answer_to_be_sent():
    """A read into a new segment is made only once the answer is out (the trainer faults
    the segment in alongside it); one whose answer could not be sent is never made."""
    from aiockpt._daemon.load.answer import _Early

    reads = []
    early = _Early()
    early.answer("a", _FakePlan(lambda f: f), lambda: reads.append("a") or 5)
    assert reads == []
    early.read()
    assert reads == ["a"]
    assert early.collect("a")["read_nbytes"] == 5
    early.answer("b", _FakePlan(lambda f: f), lambda: reads.append("b") or 5)
    early.drop()  # its answer could not be sent
    early.read()
    assert reads == ["a"]


def test_a_warmed_load_finds_its_manifest_parsed_and_checked(tmp_path, monkeypatch):
    """WarmReq does ahead what a load checks before it reads: the load after it parses no
    manifest and checks no tree again; a step that is not there is left for the load to
    raise."""
    from concurrent.futures import ThreadPoolExecutor

    from aiockpt._core import format as fmt
    from aiockpt._core.catalog import Catalog
    from aiockpt._core.protocol import LoadAsk, LoadReq
    from aiockpt._daemon.load import Reader
    from aiockpt._daemon.shared import Slabs
    from aiockpt.errors import CheckpointNotFoundError
    from aiockpt.storage import open_storage

    state = {f"t{i}": torch.full((i + 1,), float(i)) for i in range(40)}

    async def save() -> None:
        async with AsyncCheckpointManager(str(tmp_path)) as mgr:
            await (await mgr.save(3, state))

    anyio.run(save)
    real = fmt.parse_manifest
    parsed: list[int | None] = []

    def parse(data, **kw):
        parsed.append(kw.get("step"))
        return real(data, **kw)

    monkeypatch.setattr(fmt, "parse_manifest", parse)
    checked: list[object] = []
    real_check = fmt.check_tree
    monkeypatch.setattr(
        fmt, "check_tree", lambda *a, **kw: checked.append(a) or real_check(*a, **kw)
    )
    with ThreadPoolExecutor(2) as pool:
        reader = Reader(Catalog(open_storage(str(tmp_path))), Slabs(), pool)
        reader.warm(None, 0, 1)
        assert (len(parsed), len(checked)) == (1, 1)
        m = reader.catalog.read_manifest(3, lazy=True)
        assert m.tensors[m.shard_of(0).file]._all is not None  # every record checked
        reply = reader.load(LoadReq(0, LoadAsk(None, 0, 1)))
        assert (len(parsed), len(checked)) == (1, 1)  # nothing parsed or checked again
        assert set(reply.tensors) == set(state)
        with pytest.raises(CheckpointNotFoundError, match="step 4 is not a committed"):
            reader.warm(4, 0, 1)
        reader.close()


async def test_a_load_built_while_read_is_handed_over_only_once_verified(tmp_path):
    """load() is answered before the daemon reads: its segment is mapped (and its name
    unlinked) and the values built meanwhile. Verified bytes come back, a generator with its
    state; a corrupt byte is raised, and neither way leaves a load segment in /dev/shm."""
    from _support.roots import flip_byte, manifest_of

    from aiockpt._core import format as fmt

    gen = torch.Generator().manual_seed(11)
    state = {"w": torch.arange(50_000.0), "gen": gen, "n": 3}
    root = str(tmp_path / "r")
    async with AsyncCheckpointManager(root, dedup=False) as mgr:  # shards of their own
        await (await mgr.save(1, state))
        await (await mgr.save(2, state))
    shard = manifest_of(root, 2)["shards"][0]
    flip_byte(os.path.join(root, fmt.step_dirname(2), shard["file"]), shard["nbytes"] - 5)
    before = {n for n in os.listdir("/dev/shm") if "-load-" in n}
    async with AsyncCheckpointManager(root, read_only=True) as mgr:
        loaded = await mgr.load(1)
        assert torch.equal(loaded["w"], state["w"])
        assert torch.equal(loaded["gen"].get_state(), gen.get_state())
        assert loaded["n"] == 3
        with pytest.raises(CorruptCheckpointError, match="crc32c"):
            await mgr.load(2)
        assert {n for n in os.listdir("/dev/shm") if "-load-" in n} == before
