"""A tensor under two keys (tied weights) is stored once and comes back shared."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from aiockpt import AsyncCheckpointManager
from aiockpt._trainer.state import flatten

pytestmark = pytest.mark.anyio


def tied(rows: int = 10, extra: int = 0) -> torch.nn.Module:
    emb = torch.nn.Embedding(rows, 4)
    head = torch.nn.Linear(4, rows, bias=False)
    head.weight = emb.weight  # tied, as language models tie input and output embeddings
    layers = [torch.nn.Linear(4, 4) for _ in range(extra)]
    return torch.nn.Sequential(emb, *layers, head)


def manifest(root: str, step: int) -> dict:
    return json.loads((Path(root) / f"step_{step:012d}" / "manifest.json").read_text())


async def test_tied_weights_are_stored_once_and_restored_shared(root):
    torch.manual_seed(0)
    model = tied(extra=8)  # 2 + 16 + 1 tensors: a mapping large enough to be cached
    head = f"{len(model) - 1}.weight"
    opt = torch.optim.AdamW(model.parameters())
    async with AsyncCheckpointManager(root) as mgr:
        for step in (1, 2):  # the second save goes through the flatten cache
            await (await mgr.save(step, {"model": model, "optim": opt}))
            saved = model[0].weight.detach().clone()
            with torch.no_grad():
                model[0].weight.add_(1.0)
        loaded = await mgr.load(2)
        fresh = tied(extra=8)
        await mgr.load(2, into={"model": fresh, "optim": torch.optim.AdamW(fresh.parameters())})
        two_targets = {"model": {"0.weight": torch.zeros(10, 4), head: torch.zeros(10, 4)}}
        await mgr.load(2, into=two_targets, strict=False)
    m = manifest(root, 2)
    records = m["tensors"][m["shards"][0]["file"]]
    assert "model/0.weight" in records
    assert f"model/{head}" not in records  # one copy of the bytes
    sd = loaded["model"]
    assert sd["0.weight"] is sd[head]
    assert torch.equal(sd["0.weight"], saved)
    assert fresh[0].weight is fresh[-1].weight  # still tied, and restored
    assert torch.equal(fresh[0].weight, sd["0.weight"])
    a, b = two_targets["model"]["0.weight"], two_targets["model"][head]
    assert a is not b
    assert torch.equal(a, sd["0.weight"])
    assert torch.equal(b, sd["0.weight"])


def test_only_the_same_bytes_alias():
    base = torch.arange(12.0)
    state = {
        "w": base.view(3, 4),
        "same": base.view(3, 4),  # another view of the same bytes: one tensor
        "t": base.view(3, 4).t(),  # same pointer, other strides: its own
        "part": base[:6].view(2, 3),  # same pointer, other shape: its own
        "as_int": base.view(torch.int32).view(3, 4),  # same bytes, other dtype: its own
        "empty": base[:0],
        "empty2": base[:0],  # empty tensors never alias
    }
    flat = flatten(state)
    assert flat.names == ["w", "t", "part", "as_int", "empty", "empty2"]
    assert flat.tree["D"][1] == ["same", {"T": "w"}]
