"""States that hold no tensor bytes: only plain values, or only empty tensors."""

from __future__ import annotations

import pytest
import torch

from aiockpt import AsyncCheckpointManager


@pytest.mark.anyio
@pytest.mark.parametrize(
    "state",
    [
        {"epoch": 3, "name": "run", "lr": [0.1, 0.01]},
        {"empty": torch.empty(0), "also": torch.zeros(0, 4, dtype=torch.int64)},
    ],
    ids=["plain-values-only", "empty-tensors-only"],
)
async def test_a_checkpoint_without_tensor_bytes_loads(root, state):
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, state))
        loaded = await mgr.load()
        restored = await mgr.load(
            into={k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
        )
    for out in (loaded, restored):
        assert out.keys() == state.keys()
        for key, value in state.items():
            if torch.is_tensor(value):
                assert out[key].dtype == value.dtype
                assert out[key].shape == value.shape
            else:
                assert out[key] == value
