from __future__ import annotations

import json
import math
import os
import signal
import time
import warnings
from unittest import mock

import anyio
import pytest
import torch
from _support.roots import shard_path
from safetensors import safe_open

from aiockpt import AsyncCheckpointManager, CheckpointInfo, SaveHandle
from aiockpt._core import format as fmt
from aiockpt.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DaemonDiedError,
    InvalidStepError,
    LoadMismatchError,
    ManagerClosedError,
    StepExistsError,
    StorageError,
    UnsupportedValueError,
)

pytestmark = pytest.mark.anyio

ALL_DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.bool,
    torch.complex64,
]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bit patterns of any dtype (NaNs and all), from random bytes."""
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = math.prod(shape)
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=g)
    if dtype is torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.contiguous(), b.contiguous()
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


async def test_round_trip_every_dtype_bit_exact(root):
    state = {}
    for i, dtype in enumerate(ALL_DTYPES):
        name = str(dtype).removeprefix("torch.")
        state[name] = {
            "matrix": random_tensor(dtype, (7, 5), seed=i),
            "scalar": random_tensor(dtype, (), seed=100 + i),
            "empty": random_tensor(dtype, (0, 3), seed=200 + i),
            "strided": random_tensor(dtype, (6, 4), seed=300 + i).t(),  # non-contiguous
        }
    async with AsyncCheckpointManager(root) as mgr:
        handle = await mgr.save(1, state)
        info = await handle
        assert isinstance(info, CheckpointInfo)
        assert info.step == 1
        loaded = await mgr.load()
    for name, group in state.items():
        for key, tensor in group.items():
            out = loaded[name][key]
            assert same_bits(out, tensor), (name, key)
            assert out.is_contiguous()


async def test_nested_tree_round_trip(root):
    state = {
        "model": {"w": torch.ones(2, 2), "layers": [torch.zeros(3), {"b": torch.arange(4)}]},
        "tup": (1, "two", torch.tensor(3.0), (None, True)),
        "optim": {"state": {0: {"step": torch.tensor(5)}, 1: {}}, "groups": [{"lr": 0.1}]},
        "floats": [1.5, float("nan"), float("inf"), -float("inf"), -0.0],
        "text": "héllo ✓",
        "none": None,
        "flag": False,
        "big": 2**70,
    }
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(3, state))
        out = await mgr.load(3)
    assert out["tup"][0:2] == (1, "two")
    assert isinstance(out["tup"], tuple)
    assert isinstance(out["tup"][3], tuple)
    assert out["tup"][3] == (None, True)
    assert set(out["optim"]["state"]) == {0, 1}
    assert torch.equal(out["optim"]["state"][0]["step"], torch.tensor(5))
    assert out["floats"][0] == 1.5
    assert math.isnan(out["floats"][1])
    assert out["floats"][2:4] == [math.inf, -math.inf]
    assert math.copysign(1, out["floats"][4]) == -1
    assert out["text"] == "héllo ✓"
    assert out["none"] is None
    assert out["flag"] is False
    assert out["big"] == 2**70
    assert torch.equal(out["model"]["layers"][1]["b"], torch.arange(4))


async def test_snapshot_taken_when_save_returns(root):
    t = torch.arange(1000, dtype=torch.float32)
    state = {"t": t, "nested": {"u": torch.ones(10)}}
    async with AsyncCheckpointManager(root) as mgr:
        handle = await mgr.save(1, state)
        t.add_(1000)  # the caller mutates right away
        state["nested"]["u"].zero_()
        await handle
        out = await mgr.load(1)
    assert torch.equal(out["t"], torch.arange(1000, dtype=torch.float32))
    assert torch.equal(out["nested"]["u"], torch.ones(10))


async def test_model_and_optimizer_restored_into_fresh_instances(root):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 8), torch.randn(16, 4)

    def train_step(m, o):
        o.zero_grad()
        loss = torch.nn.functional.mse_loss(m(x), y)
        loss.backward()
        o.step()
        return loss.item()

    for _ in range(3):
        train_step(model, opt)
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(3, {"model": model, "optim": opt, "epoch": 1}))
        model2 = torch.nn.Linear(8, 4)
        opt2 = torch.optim.Adam(model2.parameters(), lr=0.5)
        state2 = {"model": model2, "optim": opt2, "epoch": 0}
        restored = await mgr.load(into=state2)
    assert restored is state2
    assert state2["epoch"] == 1
    assert opt2.param_groups[0]["lr"] == 0.01
    for _ in range(3):
        assert train_step(model, opt) == train_step(model2, opt2)
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


async def test_load_into_existing_tensors_in_place(root):
    state = {"a": torch.randn(4, 4), "b": [torch.randn(3)], "n": 1}
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(0, state))
        target = {"a": torch.zeros(4, 4), "b": [torch.zeros(3)], "n": 0}
        a, b = target["a"], target["b"][0]
        await mgr.load(into=target)
        assert target["a"] is a
        assert target["b"][0] is b
        assert torch.equal(a, state["a"])
        assert torch.equal(b, state["b"][0])
        assert target["n"] == 1
        with pytest.raises(LoadMismatchError, match="a: saved torch.float32"):
            await mgr.load(into={"a": torch.zeros(2, 2)})


async def test_twenty_thousand_small_tensors(root):
    state = {f"p{i}": torch.full((3,), float(i)) for i in range(20_000)}
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, state))
        state["p7"].zero_()
        await (await mgr.save(2, state))
        out1 = await mgr.load(1)
        out2 = await mgr.load(2)
    assert len(out1) == 20_000
    assert torch.equal(out1["p19999"], torch.full((3,), 19999.0))
    assert torch.equal(out1["p7"], torch.full((3,), 7.0))
    assert torch.equal(out2["p7"], torch.zeros(3))


async def test_shard_opens_with_safetensors(root):
    state = {"model": {"w": torch.randn(5, 3), "i": torch.arange(7, dtype=torch.int16)}, "x": 2}
    async with AsyncCheckpointManager(root) as mgr:
        info = await (await mgr.save(12, state))
    shard = shard_path(root, 12)
    with open(shard, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
    assert (8 + header_len) % 4096 == 0  # data starts aligned
    with safe_open(shard, framework="pt") as f:
        assert set(f.keys()) == {"model/w", "model/i"}
        assert torch.equal(f.get_tensor("model/w"), state["model"]["w"])
        assert torch.equal(f.get_tensor("model/i"), state["model"]["i"])
    with open(os.path.join(info.url, "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["format"] == "aiockpt"
    assert manifest["version"] == fmt.NAMES_VERSION
    assert manifest["step"] == 12
    assert fmt.parse_shard_filename(manifest["shards"][0]["file"]) == (0, mock.ANY)


async def test_steps_latest_and_partials_ignored(root):
    async with AsyncCheckpointManager(root) as mgr:
        assert await mgr.steps() == []
        assert await mgr.latest_step() is None
        for step in (5, 1, 10):
            await (await mgr.save(step, {"t": torch.tensor(step)}))
        os.makedirs(os.path.join(root, "step_000000000003"))  # a partial: no manifest
        assert await mgr.steps() == [1, 5, 10]
        assert await mgr.latest_step() == 10
        assert torch.equal((await mgr.load())["t"], torch.tensor(10))
        with pytest.raises(CheckpointNotFoundError, match="step 7"):
            await mgr.load(7)
    async with AsyncCheckpointManager(root) as mgr:
        assert not os.path.exists(os.path.join(root, "step_000000000003"))  # collected at start
        assert await mgr.steps() == [1, 5, 10]


async def test_load_from_empty_root_is_not_found(root):
    async with AsyncCheckpointManager(root) as mgr:
        with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
            await mgr.load()


def nested_tensor(layout: torch.layout) -> torch.Tensor:
    with warnings.catch_warnings():  # the strided layout is a prototype, and says so
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)], layout=layout)


@pytest.mark.parametrize(
    ("value", "path", "message"),
    [
        ({"a": {"b": object()}}, "a/b", "cannot be saved"),
        ({"a": [1, {2, 3}]}, "a/1", "cannot be saved"),
        ({"a": {(1, 2): 3}}, "a/(1, 2)", "keys must be str or int"),
        ({"a": {True: 3}}, "a/True", "keys must be str or int"),
        ({"a": torch.zeros(2).to_sparse()}, "a", "dense"),
        ({"n": {"t": nested_tensor(torch.strided)}}, "n/t", "nested"),
        ({"n": {"t": nested_tensor(torch.jagged)}}, "n/t", "nested"),
        ({"a\x00b": 1}, "'a\\x00b'", "NUL"),
        ({0: torch.zeros(1), "0": torch.zeros(1)}, "0", "two keys"),
    ],
)
async def test_unsupported_values_are_named(root, value, path, message):
    async with AsyncCheckpointManager(root) as mgr:
        with pytest.raises(UnsupportedValueError, match=message) as exc:
            await mgr.save(1, value)
        assert isinstance(exc.value, TypeError)
        assert exc.value.path == path
        assert await mgr.steps() == []
    assert not os.path.exists(os.path.join(root, "step_000000000001"))


async def test_state_must_be_a_mapping(root):
    async with AsyncCheckpointManager(root) as mgr:
        with pytest.raises(UnsupportedValueError, match="mapping"):
            await mgr.save(1, [torch.zeros(1)])


@pytest.mark.parametrize("step", [-1, 1.0, "3", True, None, 10**12])
async def test_bad_steps_are_refused(root, step):
    async with AsyncCheckpointManager(root) as mgr:
        with pytest.raises(InvalidStepError) as exc:
            await mgr.save(step, {"t": torch.zeros(1)})
        assert isinstance(exc.value, ValueError)


async def test_committed_and_in_flight_steps_are_refused(root):
    async with AsyncCheckpointManager(root) as mgr:
        h = await mgr.save(4, {"t": torch.zeros(1)})
        with pytest.raises(StepExistsError, match="being saved"):
            await mgr.save(4, {"t": torch.zeros(1)})
        await h
        with pytest.raises(StepExistsError, match="already committed") as exc:
            await mgr.save(4, {"t": torch.zeros(1)})
        assert isinstance(exc.value, ValueError)
    async with AsyncCheckpointManager(root) as mgr:  # a later run knows it too
        with pytest.raises(StepExistsError):
            await mgr.save(4, {"t": torch.zeros(1)})


async def test_bad_metrics_and_metadata_are_refused(root):
    async with AsyncCheckpointManager(root) as mgr:
        with pytest.raises(UnsupportedValueError, match="metrics/loss"):
            await mgr.save(1, {}, metrics={"loss": "low"})
        with pytest.raises(UnsupportedValueError, match="metadata"):
            await mgr.save(1, {}, metadata={"obj": object()})
        info = await (
            await mgr.save(
                1,
                {},
                metrics={"loss": torch.tensor(0.25), "nan": float("nan")},
                metadata={"a": [1]},
            )
        )
        assert info.metrics == {"loss": 0.25, "nan": "nan"}


async def test_use_before_open_and_after_close(root):
    mgr = AsyncCheckpointManager(root)
    with pytest.raises(ManagerClosedError, match="not open") as exc:
        await mgr.save(1, {})
    assert isinstance(exc.value, RuntimeError)
    async with mgr:
        pass
    with pytest.raises(ManagerClosedError, match="closed"):
        await mgr.save(1, {})
    with pytest.raises(ManagerClosedError):
        await mgr.load()
    with pytest.raises(ManagerClosedError, match="opens once"):
        await mgr.open()


async def test_close_waits_for_pending_saves(root):
    state = {"t": torch.randn(1 << 20)}
    async with AsyncCheckpointManager(root) as mgr:
        handles = [await mgr.save(s, state) for s in range(4)]
    assert all(h.done() for h in handles)
    async with AsyncCheckpointManager(root) as mgr:
        assert await mgr.steps() == [0, 1, 2, 3]


async def test_backpressure_bounds_busy_slabs(root):
    state = {"t": torch.randn(1 << 18)}
    async with AsyncCheckpointManager(root, max_pending=1) as mgr:
        handles = []
        for s in range(5):
            handles.append(await mgr.save(s, state))
            assert mgr._pool.busy <= 1
        await mgr.wait()
        assert [h.done() for h in handles] == [True] * 5
        assert len(os.listdir("/dev/shm")) >= 1


async def test_daemon_killed_during_large_save(root):
    big = {"t": torch.randn(64 << 20)}  # 256 MiB: long enough to be caught writing
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, {"small": torch.arange(10)}))
        handle = await mgr.save(2, big)
        os.kill(mgr.daemon_pid, signal.SIGKILL)
        with pytest.raises(DaemonDiedError) as exc:
            await handle
        assert exc.value.exit_code == -signal.SIGKILL
        # the next save starts a new daemon and commits; the earlier checkpoint is intact
        await (await mgr.save(3, {"small": torch.arange(3)}))
        assert await mgr.steps() == [1, 3]
        assert torch.equal((await mgr.load(1))["small"], torch.arange(10))


async def test_corrupt_byte_is_caught_on_load(root):
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, {"a": torch.zeros(100), "b": torch.ones(100)}))
        shard = shard_path(root, 1)
        with open(shard, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            byte = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(
            CorruptCheckpointError, match=r"shard_r00000\.[0-9a-f]{16}\.safetensors: tensor 'b'"
        ) as exc:
            await mgr.load(1)
        assert exc.value.key == "b"


def test_a_failed_check_waits_for_the_others_before_the_segment_is_unmapped(tmp_path):
    """A load whose first crc check fails while a later one still runs: the failure is raised
    only once every check is over (unmapping memory a running check reads raised
    BufferError instead of the corrupt tensor's error)."""
    from concurrent.futures import ThreadPoolExecutor

    from aiockpt._daemon.load.verify import _Checks

    finished = []

    def slow() -> None:
        time.sleep(0.5)
        finished.append(True)

    def corrupt() -> None:
        raise CorruptCheckpointError("tensor 'a' failed its crc32c check")

    with ThreadPoolExecutor(2) as pool:
        checks = _Checks(pool)
        checks.futures = [pool.submit(corrupt), pool.submit(slow)]
        with pytest.raises(CorruptCheckpointError, match="tensor 'a'"):
            checks.wait()
        assert finished == [True]


async def test_truncated_manifest_is_refused(root):
    async with AsyncCheckpointManager(root) as mgr:
        info = await (await mgr.save(1, {"a": torch.zeros(3)}))
        path = os.path.join(info.url, "manifest.json")
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        with pytest.raises(
            CorruptCheckpointError, match="manifest.json: manifest is not valid JSON"
        ):
            await mgr.load(1)


@pytest.mark.parametrize("scheme", ["file", "memory"])
async def test_fsspec_urls(tmp_path, scheme):
    url = f"file://{tmp_path}/run" if scheme == "file" else f"memory://aiockpt-test-{os.getpid()}"
    state = {"w": torch.randn(100, 10), "meta": {"k": [1, 2]}}
    async with AsyncCheckpointManager(url) as mgr:
        info = await (await mgr.save(7, state))
        assert info.url.endswith("step_000000000007")
        assert await mgr.steps() == [7]
        out = await mgr.load()
    assert torch.equal(out["w"], state["w"])
    assert out["meta"] == {"k": [1, 2]}


async def test_default_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("AIOCKPT_ROOT", raising=False)
    async with AsyncCheckpointManager() as mgr:
        await (await mgr.save(1, {"t": torch.zeros(1)}))
    assert os.path.exists(tmp_path / "checkpoints" / "step_000000000001" / "manifest.json")
    monkeypatch.setenv("AIOCKPT_ROOT", str(tmp_path / "env-root"))
    async with AsyncCheckpointManager() as mgr:
        await (await mgr.save(1, {"t": torch.zeros(1)}))
    assert os.path.exists(tmp_path / "env-root" / "step_000000000001" / "manifest.json")


async def test_daemon_imports_aiockpt_from_where_the_trainer_did(tmp_path, monkeypatch):
    """Run from a directory holding another ``aiockpt`` (a checkout of another version, say):
    the daemon must not pick that one up from its working directory."""
    other = tmp_path / "aiockpt"
    other.mkdir()
    (other / "__init__.py").write_text("raise ImportError('the aiockpt of the working dir')\n")
    monkeypatch.chdir(tmp_path)
    async with AsyncCheckpointManager(str(tmp_path / "run")) as mgr:
        await (await mgr.save(1, {"t": torch.ones(2)}))
        assert torch.equal((await mgr.load())["t"], torch.ones(2))


async def test_bad_root_fails_at_open(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StorageError):
        async with AsyncCheckpointManager(str(blocker / "run")) as mgr:
            await (await mgr.save(1, {"t": torch.zeros(1)}))


async def test_handle_api(root):
    async with AsyncCheckpointManager(root) as mgr:
        handle = await mgr.save(9, {"t": torch.zeros(1)})
        assert isinstance(handle, SaveHandle)
        assert handle.step == 9
        info = await handle
        assert handle.done()
        assert await handle == info
        assert "committed" in repr(handle)


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_runs_under_trio(root, anyio_backend):
    state = {"w": torch.randn(64, 64), "step": 1}
    async with AsyncCheckpointManager(root) as mgr:
        handle = await mgr.save(1, state)
        await handle
        await mgr.wait()
        out = await mgr.load()
    assert torch.equal(out["w"], state["w"])


async def test_concurrent_saves_and_loads(root):
    state = {"w": torch.randn(1000)}
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(0, state))
        results = {}

        async def loader(i):
            results[i] = await mgr.load(0)

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(loader, i)
            for s in range(1, 4):
                await mgr.save(s, state)
        await mgr.wait()
        assert await mgr.steps() == [0, 1, 2, 3]
    assert all(torch.equal(r["w"], state["w"]) for r in results.values())


@pytest.mark.parametrize("skip_unchanged", [False, True])
async def test_a_save_after_load_into_writes_a_whole_shard(root, skip_unchanged):
    """A load(into=) reads over the slab's header and padding; the save that reuses the slab
    (and its views) writes them again, and copies every tensor again even where nothing
    changed since the slab's last save."""
    import safetensors.torch

    state = {"a": torch.arange(5, dtype=torch.int8), "b": torch.arange(3.0), "c": torch.ones(7)}
    async with AsyncCheckpointManager(root, skip_unchanged=skip_unchanged) as mgr:
        await (await mgr.save(1, state))
        first = {k: v.clone() for k, v in state.items()}
        for t in state.values():
            t.add_(1)
        await (await mgr.save(2, state))
        await mgr.load(1, into=state)  # through the slab step 2 was staged in
        assert mgr._pool.busy == 0
        await (await mgr.save(3, state))
    shard = shard_path(root, 3)
    on_disk = safetensors.torch.load_file(shard)  # the header and padding are whole
    assert set(on_disk) == set(state)
    assert all(torch.equal(on_disk[k], first[k]) for k in state)
    async with AsyncCheckpointManager(root, read_only=True) as mgr:
        loaded = await mgr.load(3)
    assert all(torch.equal(loaded[k], first[k]) for k in state)


async def test_skip_unchanged_copies_again_what_a_load_read_over(root):
    """A load into part of the state reads over the slab where a tensor it does not restore
    lies; that tensor is unchanged, yet the next save must copy it again."""
    state = {"small": torch.arange(10.0), "big": torch.arange(100_000.0)}
    small = state["small"].clone()
    async with AsyncCheckpointManager(root, skip_unchanged=True) as mgr:
        await (await mgr.save(1, state))
        await (await mgr.save(2, state))
        await mgr.load(1, into={"big": state["big"]}, strict=False)
        await (await mgr.save(3, state))
        loaded = await mgr.load(3)
    assert torch.equal(loaded["small"], small)
    assert torch.equal(loaded["big"], state["big"])


async def test_load_into_reads_through_the_staging_slab_without_aliasing_it(root):
    """load(into=...) reads through the slab the next save will reuse; whatever it hands over
    by reference (optimizer state, keys the target lacks) must not be a view of that slab."""
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    state = {"model": model, "optim": opt, "extra": torch.full((1000,), 7.0)}
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, state))
        saved_avg = opt.state_dict()["state"][0]["exp_avg"].clone()
        model2 = torch.nn.Linear(64, 64)
        opt2 = torch.optim.Adam(model2.parameters())
        target = {"model": model2, "optim": opt2, "extra": torch.zeros(1000)}
        await mgr.load(1, into=target)
        loaded = await mgr.load(1, keys=["extra"])  # a fresh segment, handed over
        assert mgr._pool.busy == 0
        # The next saves overwrite the slabs with other bytes.
        for step in (2, 3):
            await (await mgr.save(step, {k: v for k, v in state.items() if k != "extra"}))
            with torch.no_grad():
                model.weight.add_(1.0)
        assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], saved_avg)
        assert torch.equal(target["extra"], torch.full((1000,), 7.0))
        assert torch.equal(loaded["extra"], torch.full((1000,), 7.0))
        assert torch.equal(model2.bias, model.bias)
