"""load(into=..., atomic=False) under staging_memory: the bytes come a window at a time, each
read once, checked as it is read and copied while the next is read into the other slab."""

from __future__ import annotations

import bisect
import copy
import json
import os
import struct

import anyio
import pytest
import torch
from _support.roots import flip_byte, manifest_of
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_capped_loads import cap_of, record_parts, zeroed
from test_staging_cap import assert_equal, mixed_state

from aiockpt import AsyncCheckpointManager, CheckpointManager
from aiockpt._core import format as fmt
from aiockpt._core.protocol import LoadAsk, SlabRef, StreamReq, StreamWindowReq
from aiockpt.errors import (
    CheckpointError,
    CorruptCheckpointError,
    LoadMismatchError,
)

MiB = 1 << 20


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(600, 700), torch.nn.Linear(700, 500))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 600)).sum().backward()
    opt.step()
    return model, opt


def save(root: str, state: dict) -> None:
    async def main() -> None:
        async with AsyncCheckpointManager(root) as mgr:
            await (await mgr.save(1, state))

    anyio.run(main)


def shard_path(root: str) -> str:
    return os.path.join(root, fmt.step_dirname(1), manifest_of(root, 1)["shards"][0]["file"])


def data_offsets(root: str) -> dict[str, tuple[int, int]]:
    """Where each tensor's bytes lie in the shard file, by name."""
    with open(shard_path(root), "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return {
        k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1]) for k, v in header.items()
    }


def test_a_streamed_load_reads_each_window_once_and_restores_bit_exact(tmp_path) -> None:
    """No checking pass and no collect: one request says where everything lies, then each
    window is asked for once, in order, within the cap. A module and an optimizer (handed
    their own tensors), a non-contiguous target, a scalar: all restored."""
    model, opt = model_and_optimizer()
    state = {**mixed_state(), "net": model, "opt": opt}
    want = {"net": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict())}
    root = str(tmp_path / "r")
    save(root, state)
    fresh_model, _ = model_and_optimizer()
    with torch.no_grad():
        for p in fresh_model.parameters():
            p.zero_()
    fresh_opt = torch.optim.AdamW(fresh_model.parameters(), lr=0.5)
    into = {**zeroed(mixed_state()), "net": fresh_model, "opt": fresh_opt, "step": 0}
    staging = cap_of(root, 0.25)

    async def main() -> None:
        async with AsyncCheckpointManager(root, staging_memory=staging, read_only=True) as mgr:
            parts = record_parts(mgr)
            assert await mgr.load(1, into=into, atomic=False) is into
            assert 0 < mgr._pool.peak <= staging
            assert mgr._pool.busy == 0
        window = staging // 2 // 4096 * 4096
        assert parts[0] == (window, None)
        assert [w for w, _ in parts] == [window] * len(parts)
        assert [p for _, p in parts[1:]] == list(range(len(parts) - 1))
        assert len(parts) - 1 >= 4

    anyio.run(main)
    assert_equal({k: into[k] for k in mixed_state()}, mixed_state())
    assert_equal(fresh_model.state_dict(), want["net"])
    got = fresh_opt.state_dict()
    assert got["param_groups"] == want["opt"]["param_groups"]
    for i, s in want["opt"]["state"].items():
        assert_equal(got["state"][i], s)


def test_a_corrupt_byte_in_the_first_window_fails_before_anything_changes(tmp_path, caplog) -> None:
    """The restore is planned, and nothing copied, until the first window is in and checked:
    a flipped byte there leaves the target as it was, and the log says nothing of a partial
    restore."""
    state = mixed_state()
    root = str(tmp_path / "r")
    save(root, state)
    a, b = min(span for span in data_offsets(root).values() if span[1] > span[0])
    flip_byte(shard_path(root), (a + min(b, a + 4096)) // 2)
    into = zeroed(mixed_state())

    async def main() -> None:
        async with AsyncCheckpointManager(
            root, staging_memory=cap_of(root, 0.25), read_only=True
        ) as mgr:
            parts = record_parts(mgr)
            with pytest.raises(CorruptCheckpointError, match="crc32c"):
                await mgr.load(1, into=into, atomic=False)
            assert [p for _, p in parts] == [None, 0]
            assert mgr._pool.busy == 0

    with caplog.at_level("ERROR", logger="aiockpt"):
        anyio.run(main)
    assert_equal(into, zeroed(mixed_state()))
    assert "partly restored" not in caplog.text


def test_a_corrupt_byte_mid_tensor_cut_by_windows_fails_and_says_the_target_is_partly_restored(
    tmp_path, caplog
) -> None:
    """A tensor whose bytes lie in several windows is checked by its running crc32c once its
    last window is in: the load fails naming it, after earlier windows were copied."""
    state = mixed_state()
    root = str(tmp_path / "r")
    save(root, state)
    staging = cap_of(root, 0.25)
    a, b = data_offsets(root)["model/w1"]
    assert b - a > staging  # more than two windows: cut by two at least
    flip_byte(shard_path(root), (a + b) // 2)
    into = zeroed(mixed_state())

    async def main() -> None:
        async with AsyncCheckpointManager(root, staging_memory=staging, read_only=True) as mgr:
            parts = record_parts(mgr)
            with pytest.raises(CorruptCheckpointError, match="model/w1.*crc32c"):
                await mgr.load(1, into=into, atomic=False)
            assert [p for _, p in parts][:3] == [None, 0, 1]
            assert 0 < mgr._pool.peak <= staging
            assert mgr._pool.busy == 0
        # A later load starts the windows again and restores the same target whole.
        flip_byte(shard_path(root), (a + b) // 2)
        async with AsyncCheckpointManager(root, staging_memory=staging, read_only=True) as mgr:
            await mgr.load(1, into=into, atomic=False)

    with caplog.at_level("ERROR", logger="aiockpt"):
        anyio.run(main)
    assert "the target may be partly restored" in caplog.text
    assert_equal(into, mixed_state())


def test_a_streamed_load_that_does_not_match_changes_nothing(tmp_path) -> None:
    """Keys, shapes and dtypes are checked against the whole plan before the first copy."""
    state = mixed_state()
    root = str(tmp_path / "r")
    save(root, state)
    into = zeroed(mixed_state())
    into["small"]["s5"] = torch.zeros(3, 3)

    async def main() -> None:
        async with AsyncCheckpointManager(
            root, staging_memory=cap_of(root, 0.25), read_only=True
        ) as mgr:
            with pytest.raises(LoadMismatchError, match="s5"):
                await mgr.load(1, into=into, atomic=False)
            assert mgr._pool.busy == 0

    anyio.run(main)
    want = zeroed(mixed_state())
    want["small"]["s5"] = torch.zeros(3, 3)
    assert_equal(into, want)


def test_a_load_that_fits_its_slab_is_atomic_either_way(tmp_path, caplog) -> None:
    """Without a cap (or under one the shard fits) nothing is copied before every checksum
    passed, atomic=False or not: a byte flipped in the last tensor leaves the target as it
    was."""
    state = mixed_state()
    root = str(tmp_path / "r")
    save(root, state)
    flip_byte(shard_path(root), max(data_offsets(root).values())[1] - 3)
    into = zeroed(mixed_state())

    async def main() -> None:
        async with AsyncCheckpointManager(root, read_only=True) as mgr:
            parts = record_parts(mgr)
            with pytest.raises(CorruptCheckpointError, match="crc32c"):
                await mgr.load(1, into=into, atomic=False)
            assert all(window == 0 for window, _ in parts)

    with caplog.at_level("ERROR", logger="aiockpt"):
        anyio.run(main)
    assert_equal(into, zeroed(mixed_state()))
    assert "partly restored" not in caplog.text


def test_windows_of_a_streamed_load_are_asked_for_in_order(tmp_path) -> None:
    """The daemon keeps each streamed load by its name, so two can interleave; it refuses a
    window of one that was not started, or out of turn (a running crc32c depends on the
    windows before it), and then drops that load. The trainer never asks so: the daemon's
    failure says what it was asked."""
    state = {"w": torch.arange(3 * MiB, dtype=torch.float32)}
    root = str(tmp_path / "r")
    save(root, state)

    async def main() -> None:
        async with AsyncCheckpointManager(root, read_only=True) as mgr:
            slab = await mgr._pool.acquire(16 * MiB, None)
            try:
                ask = {"ask": LoadAsk(1, 0, 1), "window": MiB}
                lent = SlabRef(slab.name, slab.size)
                with pytest.raises(CheckpointError, match="ValueError: window 0 .*'a'.* not st"):
                    await mgr._read(StreamWindowReq, name="a", slab=lent, part=0)
                reply = await mgr._read(StreamReq, name="a", **ask)
                assert len(reply.windows) == 12
                await mgr._read(StreamReq, name="b", **ask)
                await mgr._read(StreamWindowReq, name="a", slab=lent, part=0)
                await mgr._read(StreamWindowReq, name="b", slab=lent, part=0)
                await mgr._read(StreamWindowReq, name="a", slab=lent, part=1)
                with pytest.raises(CheckpointError, match="ValueError: .*1 is next, not 2"):
                    await mgr._read(StreamWindowReq, name="b", slab=lent, part=2)
                with pytest.raises(CheckpointError, match="'b', which was not started"):
                    await mgr._read(StreamWindowReq, name="b", slab=lent, part=1)
                for i in range(2, 12):
                    await mgr._read(StreamWindowReq, name="a", slab=lent, part=i)
                with pytest.raises(CheckpointError, match="'a', which was not started"):
                    await mgr._read(StreamWindowReq, name="a", slab=lent, part=11)  # done: dropped
            finally:
                mgr._pool.release(slab.name)

    anyio.run(main)


def test_atomic_is_a_bool_and_the_sync_manager_streams_too(tmp_path) -> None:
    state = {"w": torch.randn(1000, 100), "step": 3}
    root = str(tmp_path / "r")
    save(root, state)
    with CheckpointManager(root, staging_memory=128 * 1024, read_only=True) as mgr:
        with pytest.raises(TypeError, match="atomic must be a bool"):
            mgr.load(1, into=state, atomic="no")
        parts = record_parts(mgr._async)
        into = {"w": torch.zeros(1000, 100), "step": 0}
        assert mgr.load(1, into=into, atomic=False)["step"] == 3
        assert [p for _, p in parts] == [None, *range(len(parts) - 1)]
    assert torch.equal(into["w"], state["w"])


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "streamed"])
def test_a_capped_load_counts_the_bytes_it_read(tmp_path, atomic) -> None:
    """load.end's read_nbytes is what the daemon read: the tensors' bytes twice for an atomic
    load in windows (checked whole, then copied), once streamed. (Every tensor of this state
    is copied in place, none handed over: the restore planned first is carried out.)"""
    state = {"w": torch.randn(4_000_000), "v": torch.randn(1_000_000), "step": 3}
    root = str(tmp_path / "r")
    save(root, state)
    events: list = []
    into = {**zeroed(state), "step": 0}

    async def main() -> None:
        async with AsyncCheckpointManager(
            root, staging_memory=4 * MiB, read_only=True, event_handlers=[events.append]
        ) as mgr:
            assert await mgr.load(1, into=into, atomic=atomic) is into

    anyio.run(main)
    assert_equal(into, state)
    (end,) = [e for e in events if e.name == "load.end"]
    assert end.read_nbytes == (2 if atomic else 1) * 20_000_000


@pytest.fixture(scope="module")
def varied(tmp_path_factory) -> tuple[str, dict]:
    """A checkpoint of tensors of several dtypes and sizes, an empty and a 0-d one among them,
    some larger than the windows the property test below cuts."""
    g = torch.Generator().manual_seed(5)
    state = {
        "a": torch.randn(300_001, generator=g),
        "b": torch.empty(0),
        "c": torch.tensor(2.5),
        "d": torch.randint(-100, 100, (70_001,), generator=g).to(torch.int8),
        "e": torch.randn(1000, 333, generator=g).to(torch.bfloat16),
        "f": torch.randn(250_007, generator=g).double(),
        "g": torch.randint(0, 2, (5,), generator=g).bool(),
    }
    root = str(tmp_path_factory.mktemp("varied") / "r")
    save(root, state)
    return root, state


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    pages=st.integers(1, 300),
    flip=st.none() | st.tuples(st.sampled_from("adef"), st.floats(0, 1, exclude_max=True)),
)
def test_streamed_windows_hold_every_byte_and_find_any_flipped_one(varied, pages, flip) -> None:
    """The daemon's side, in this process: whatever the window (4 KiB to 1.2 MiB), the windows
    of a streamed load tile its output with the saved bytes, each tensor where the first
    answer says; with one byte of a tensor flipped, the window where that tensor ends fails,
    naming it, and none before."""
    from concurrent.futures import ThreadPoolExecutor

    from aiockpt._core.catalog import Catalog
    from aiockpt._core.shm import Segment
    from aiockpt._daemon.load import Reader
    from aiockpt._daemon.shared import Slabs
    from aiockpt.storage import LocalStorage

    root, state = varied
    window = pages * 4096
    flipped = None
    if flip is not None:
        name, where = flip
        a, b = data_offsets(root)[name]
        flipped = a + int(where * (b - a))
        flip_byte(shard_path(root), flipped)
    seg = Segment.create(window)
    try:
        with ThreadPoolExecutor(2) as pool:
            reader = Reader(Catalog(LocalStorage(root)), Slabs(), pool)
            lent = SlabRef(seg.name, seg.size)
            reply = reader.stream(StreamReq(0, LoadAsk(1, 0, 1), window, "s"))
            out = bytearray(reply.size)
            failed = None
            for i, (a, b) in enumerate(reply.windows):
                try:
                    reader.stream_window(StreamWindowReq(0, "s", lent, i))
                except CorruptCheckpointError as e:
                    failed = (i, e.key)
                    break
                out[a:b] = seg.buf[: b - a]
            reader.slabs.close()
            reader.close()
    finally:
        seg.close()
        seg.unlink()
        if flipped is not None:
            flip_byte(shard_path(root), flipped)
    if flip is None:
        assert failed is None
        for key, t in state.items():
            _, _, at = reply.tensors[key]
            want = t.reshape(-1).view(torch.uint8).numpy().tobytes()
            assert out[at : at + len(want)] == want, key
    else:
        _, _, at = reply.tensors[name]
        end = at + state[name].nbytes
        assert failed == (bisect.bisect_left([b for _, b in reply.windows], end), name)
