"""AiockptFSDPStrategy on the CPU (gloo), two real processes: every rank saves its own shard
into one aiockpt checkpoint, and a resumed run, on two processes or resharded onto one, goes on
bit for bit as if never stopped.

Every rank trains on the same batches, so the gradients FSDP averages are equal and a
two-process run computes what one process does: the runs are checked against one
uninterrupted single-process run of the same model. The model has a hidden layer of 6, so
that its first layer's rows are split 3 + 3 between the ranks and its output layer's one row
lies on rank 0 alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import _train
import pytest
import torch
from test_distributed import same_as, train
from test_lightning import committed_steps, pointers

from aiockpt_lightning import SAVES_PER_GLOBAL_STEP, AiockptCheckpointIO, AiockptFSDPStrategy

pytestmark = [
    pytest.mark.filterwarnings(
        r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning"
    ),
]

HIDDEN = 6


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The record of one uninterrupted single-process run of 24 steps."""
    tmp = tmp_path_factory.mktemp("full")
    return _train.run(str(tmp / "root"), str(tmp / "ckpts"), max_steps=24, hidden=HIDDEN)


def shards(root: Path, step: int) -> list[int]:
    """The ranks whose shards the committed ``step``'s manifest names."""
    manifest = json.loads((root / f"step_{step:012d}" / "manifest.json").read_text())
    return sorted(int(shard["rank"]) for shard in manifest["shards"])


@pytest.mark.timeout(360)  # two-rank Lightning fits, about 70 s on a quiet 2-core machine
def test_fsdp_saves_shards_and_resumes_bit_exact(tmp_path: Path, full: dict[str, Any]) -> None:
    root, ckpts = tmp_path / "root", tmp_path / "ckpts"
    args = (str(root), str(ckpts))
    first = train(tmp_path, "first", *args, "16", "-", "fsdp", "2", str(HIDDEN))
    assert first["losses"] == {k: v for k, v in full["losses"].items() if int(k) < 16}
    assert pointers(ckpts) == {
        "epoch=0-step=4.ckpt": 4 * SAVES_PER_GLOBAL_STEP,
        "epoch=0-step=8.ckpt": 8 * SAVES_PER_GLOBAL_STEP,
        "epoch=1-step=12.ckpt": 12 * SAVES_PER_GLOBAL_STEP,
        "epoch=1-step=16.ckpt": 16 * SAVES_PER_GLOBAL_STEP,
        "last.ckpt": 16 * SAVES_PER_GLOBAL_STEP + 1,
    }
    assert committed_steps(root) == sorted(pointers(ckpts).values())
    # One checkpoint, written by both ranks: each its own shard, nothing gathered.
    for step in committed_steps(root):
        assert shards(root, step) == [0, 1]

    # Outside any distributed run, the sharded checkpoint loads whole: the state dict's
    # tensors come back full, as the weights were at step 16.
    io = AiockptCheckpointIO(root)
    try:
        checkpoint = io.load_checkpoint(ckpts / "last.ckpt")
    finally:
        io.teardown()
    assert checkpoint["global_step"] == 16
    weights = {
        k: [float(v).hex() for v in t.flatten().tolist()]
        for k, t in checkpoint["state_dict"].items()
    }
    assert weights == first["weights"]
    assert all(type(t) is torch.Tensor for t in checkpoint["state_dict"].values())

    # Both ranks load last.ckpt, each its own part, and go on bit for bit.
    again = train(tmp_path, "again", *args, "24", "last", "fsdp", "2", str(HIDDEN))
    same_as(full, again, 16)
    assert pointers(ckpts)["last.ckpt"] == 24 * SAVES_PER_GLOBAL_STEP + 1
    assert committed_steps(root) == sorted(pointers(ckpts).values())

    # What two processes saved, one process resumes from, resharded: bit for bit again.
    step_8 = str(ckpts / "epoch=0-step=8.ckpt")
    resume = (str(root), str(tmp_path / "alone"), "24", step_8)
    alone = train(tmp_path, "alone", *resume, "fsdp", "1", str(HIDDEN))
    same_as(full, alone, 8)


def test_fsdp_strategy_refuses_what_it_cannot_save() -> None:
    with pytest.raises(ValueError, match="state_dict_type"):
        AiockptFSDPStrategy(state_dict_type="full")
    with pytest.raises(ValueError, match="device_mesh"):
        AiockptFSDPStrategy(process_group=object())
    with pytest.raises(ValueError, match="device_mesh"):
        AiockptFSDPStrategy(sharding_strategy="HYBRID_SHARD", auto_wrap_policy={torch.nn.Linear})
