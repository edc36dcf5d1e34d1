"""load(into=...) checks the whole target before it changes any of it, and strict says whether
the checkpoint and the target must hold the same keys."""

from __future__ import annotations

import logging

import pytest
import torch

from aiockpt import AsyncCheckpointManager
from aiockpt.errors import LoadMismatchError

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
