"""load(keys=...) and load(into=subset, strict=False) read only what they restore."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from aiockpt import AsyncCheckpointManager
from aiockpt.errors import LoadMismatchError

pytestmark = pytest.mark.anyio
FIXTURES = Path(__file__).parent / "fixtures"


def state() -> dict:
    torch.manual_seed(0)
    return {
        "model": {
            "embed": torch.randn(64, 32),
            "layers.3": {"w": torch.randn(32, 32), "b": torch.randn(32)},
            "layers.4": {"w": torch.randn(32, 32)},
        },
        "optim": {"m": torch.randn(64, 32), "v": torch.randn(64, 32), "step": 9},
        "history": [torch.ones(2), 3],
        "name": "run",
    }


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.fixture
async def saved(root):
    events: list = []
    async with AsyncCheckpointManager(root, event_handlers=[events.append]) as mgr:
        await (await mgr.save(1, state()))
        yield mgr, events


def read_bytes(events: list) -> int:
    return [e for e in events if e.name == "load.end"][-1].read_nbytes


async def test_keys_read_and_return_only_what_lies_under_them(saved):
    mgr, events = saved
    s = state()
    out = await mgr.load(1, keys=["model"])
    assert list(out) == ["model"]
    assert torch.equal(out["model"]["embed"], s["model"]["embed"])
    m = s["model"]
    assert read_bytes(events) == nbytes(
        m["embed"], m["layers.3"]["w"], m["layers.3"]["b"], m["layers.4"]["w"]
    )
    out = await mgr.load(1, keys="model/layers.3")
    assert out == {"model": {"layers.3": out["model"]["layers.3"]}}
    assert torch.equal(out["model"]["layers.3"]["w"], m["layers.3"]["w"])
    assert read_bytes(events) == nbytes(m["layers.3"]["w"], m["layers.3"]["b"])
    # Several keys, far apart in the shard; a plain value; a list taken whole.
    out = await mgr.load(1, keys=["optim/v", "name", "history"])
    assert out["name"] == "run"
    assert torch.equal(out["optim"]["v"], s["optim"]["v"])
    assert out["history"][1] == 3
    assert read_bytes(events) == nbytes(s["optim"]["v"], s["history"][0])


async def test_a_key_under_another_key_is_found_and_read_once(saved):
    mgr, events = saved
    s = state()
    out = await mgr.load(1, keys=["model/layers.3", "model", "model/layers.3/w"])
    assert list(out) == ["model"]
    assert torch.equal(out["model"]["layers.3"]["w"], s["model"]["layers.3"]["w"])
    m = s["model"]
    assert read_bytes(events) == nbytes(
        m["embed"], m["layers.3"]["w"], m["layers.3"]["b"], m["layers.4"]["w"]
    )


async def test_keys_that_name_nothing_or_are_malformed_are_refused(saved):
    mgr, _ = saved
    with pytest.raises(LoadMismatchError, match="no saved value at 'model/layers.9'"):
        await mgr.load(1, keys=["model", "model/layers.9"])
    # A KeyError too, naming the close matches among the saved key paths.
    with pytest.raises(KeyError) as info:
        await mgr.load(1, keys=["model/layer.3", "optim/w"])
    message = str(info.value)
    assert "no saved value at 'model/layer.3', 'optim/w'" in message
    assert "'model/layer.3': did you mean 'model/layers.3'" in message
    assert not message.startswith('"')  # the message itself, not KeyError's repr of it
    for bad in ([""], ["/model"], ["model/"], [3]):
        with pytest.raises(ValueError, match="key paths"):
            await mgr.load(1, keys=bad)
    with pytest.raises(ValueError, match="empty"):
        await mgr.load(1, keys=[])
    with pytest.raises(TypeError, match="keys must be"):
        await mgr.load(1, keys=5)


async def test_into_a_subset_with_strict_false_reads_only_that_subset(saved):
    mgr, events = saved
    s = state()
    target = {"model": {"embed": torch.zeros(64, 32)}, "optim": {"step": 0}}
    await mgr.load(1, into=target, strict=False)
    assert torch.equal(target["model"]["embed"], s["model"]["embed"])
    assert target["optim"] == {"step": 9}
    assert read_bytes(events) == nbytes(s["model"]["embed"])
    # strict=True refuses the same target, naming what it lacks.
    with pytest.raises(LoadMismatchError, match="saved but not in the target: model/layers.3"):
        await mgr.load(1, into={"model": {"embed": torch.zeros(64, 32)}})


async def test_keys_select_distributed_tensors_whole(tmp_path):
    root = tmp_path / "v2"
    shutil.copytree(FIXTURES / "format_v2", root)
    events: list = []
    async with AsyncCheckpointManager(str(root), event_handlers=[events.append]) as mgr:
        out = await mgr.load(keys=["w", "step"])
    assert sorted(out) == ["step", "w"]
    assert out["w"].shape == (6, 10)
    assert read_bytes(events) == 6 * 10 * 4


async def test_keys_with_into_check_keys_only_within_the_selection(saved):
    mgr, _ = saved
    s = state()
    target = {
        "model": {"embed": torch.zeros(64, 32), "layers.3": {"w": torch.zeros(32, 32)}},
        "optim": {"m": torch.zeros(64, 32)},  # outside the selection: left alone
    }
    target["model"]["layers.3"]["b"] = torch.zeros(32)
    target["model"]["layers.4"] = {"w": torch.zeros(32, 32)}
    await mgr.load(1, into=target, keys=["model"])
    assert torch.equal(target["model"]["layers.3"]["w"], s["model"]["layers.3"]["w"])
    assert not target["optim"]["m"].any()
    del target["model"]["layers.4"]
    with pytest.raises(LoadMismatchError, match="saved but not in the target: model/layers.4"):
        await mgr.load(1, into=target, keys=["model"])
