"""DTensor states (FSDP2, tensor parallel) saved on real gloo ranks and loaded resharded.

Each test spawns real ranks (tests/_dtensor_worker.py); the property test of every layout
against every other runs over simulated ranks in one process (tests/test_dtable.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest
import torch
from _support.ranks import run_ranks

from aiockpt import AsyncCheckpointManager

WORKER = "_dtensor_worker.py"


def ranks(scenario: str, world: int, tmp_path: Path, root: str, **args) -> list[dict]:
    return run_ranks(WORKER, scenario, world, tmp_path, root, timeout=240, args=args)


def manifest(root: str, step: int) -> dict:
    return json.loads((Path(root) / f"step_{step:012d}" / "manifest.json").read_text())


def load_plain(root: str, step: int, into=None):
    async def main():
        async with AsyncCheckpointManager(root) as mgr:
            return await mgr.load(step, into=into)

    return anyio.run(main)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory) -> tuple[str, dict, Path]:
    """An FSDP2 model and its AdamW saved at step 3 on 2 ranks."""
    tmp = tmp_path_factory.mktemp("fsdp")
    root = str(tmp / "root")
    saved = ranks("fsdp_save", 2, tmp, root)
    assert saved[0]["params"] == saved[1]["params"]
    return root, saved[0], tmp


def test_fsdp_saved_on_2_stores_each_row_once_in_a_distributed_table(fsdp_run):
    root, _, _ = fsdp_run
    m = manifest(root, 3)
    assert m["version"] == 4
    weight = m["dtensors"]["model/0.weight"]
    assert weight["shape"] == [5, 4]
    assert weight["placements"] == ["Shard(dim=0)"]
    # 5 rows on 2 ranks: 3 + 2, one chunk per rank, each in its rank's shard.
    assert [(c["offsets"], c["sizes"], c["shard"]) for c in weight["chunks"]] == [
        ([0, 0], [3, 4], m["shards"][0]["file"]),
        ([3, 0], [2, 4], m["shards"][1]["file"]),
    ]
    assert set(m["dtensors"]) >= {"optim/state/0/exp_avg", "optim/state/3/exp_avg_sq"}


@pytest.mark.parametrize("world", [4, 1])
def test_fsdp_saved_on_2_resumes_on_another_world_size_identically(fsdp_run, world):
    root, saved, tmp = fsdp_run
    loaded = ranks("fsdp_load", world, tmp, root)
    for rank in loaded:
        assert rank["step"] == 3
        assert rank["params"] == saved["params"]
        assert rank["moments"] == saved["moments"]
        # Training goes on exactly as the uninterrupted run did.
        assert rank["after"] == saved["after"]


def test_fsdp_saved_on_2_loads_into_dtensors_sharded_on_their_last_dim(fsdp_run):
    root, saved, tmp = fsdp_run
    loaded = ranks("fsdp_load_lastdim", 2, tmp, root)
    for rank in loaded:
        assert rank["params"] == saved["params"]
    # 4 columns on 2 ranks: 2 + 2; the biases (1-D) split their 5 rows 3 + 2.
    assert loaded[0]["local"]["0.weight"] == [5, 2]
    assert loaded[1]["local"]["0.bias"] == [2]


def test_fsdp_checkpoint_loads_whole_in_a_plain_process(fsdp_run):
    root, saved, _ = fsdp_run
    state = load_plain(root, 3)
    assert state["step"] == 3
    for name, value in saved["params"].items():
        tensor = state["model"][name]
        assert type(tensor) is torch.Tensor
        assert tensor.tolist() == value
    # And into a plain module and optimizer, through their load_state_dict.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    load_plain(root, 3, into={"model": model, "optim": opt, "step": 0})
    assert {k: v.tolist() for k, v in model.state_dict().items()} == saved["params"]
    assert opt.state_dict()["state"][0]["exp_avg"].tolist() == saved["moments"]["0/exp_avg"]


def test_layouts_reshard_across_placements_and_replicas_are_stored_once(tmp_path):
    root = str(tmp_path / "root")
    ranks("layouts_save", 2, tmp_path, root)
    m = manifest(root, 1)
    rep = m["dtensors"]["rep"]
    assert len(rep["chunks"]) == 1  # replicated: rank 0 writes it, rank 1 skips its bytes
    assert "rep" not in m["tensors"][m["shards"][1]["file"]]
    assert [c["sizes"] for c in m["dtensors"]["w"]["chunks"]] == [[6, 5], [6, 5]]
    for rank in ranks("layouts_load", 2, tmp_path, root):
        assert rank["got"] == rank["expect"]
    for rank in ranks("bad_loads", 2, tmp_path, root):
        assert rank["shape"]["type"] == "LoadMismatchError"
        assert rank["shape"]["message"] == "w: saved F32[6, 10] does not fit F32[6, 11]"
        assert rank["dtype"]["type"] == "LoadMismatchError"
        assert "does not fit F64[6, 10]" in rank["dtype"]["message"]
        assert rank["shape_untouched"]
        assert rank["dtype_untouched"]


def test_fsdp_over_tensor_parallel_on_a_2x2_mesh_loads_in_a_plain_process(tmp_path):
    root = str(tmp_path / "root")
    saved = ranks("fsdp_tp_save", 4, tmp_path, root)[0]
    assert any("_StridedShard" in p[0] for p in saved["placements"].values())
    state = load_plain(root, 1)
    for name, value in saved["params"].items():
        assert state["model"][name].tolist() == value
    assert state["optim"]["state"][0]["exp_avg"].tolist() == saved["moments"]["0/exp_avg"]


def test_dcp_state_dicts_restore_through_set_state_dict_on_another_world_size(tmp_path):
    root = str(tmp_path / "root")
    saved = ranks("dcp_save", 2, tmp_path, root)[0]
    for rank in ranks("dcp_load", 1, tmp_path, root):
        assert rank["after"] == saved["after"]


def test_unsavable_dtensor_states_fail_on_every_rank_with_nothing_written(tmp_path):
    root = str(tmp_path / "root")
    results = ranks("bad_saves", 2, tmp_path, root)
    for rank in results:
        assert rank["steps"] == []
        partial, mixed, shapes = rank["partial"], rank["mixed"], rank["shapes"]
        assert partial is not None
        assert "Partial" in partial["message"]
        assert "p" in partial["message"]
        assert mixed is not None
        assert "m: a DTensor on ranks [0] but not on ranks [1]" in mixed["message"]
        assert shapes is not None
        assert "s: the ranks hold different DTensors" in shapes["message"]
    assert not list(Path(root).glob("step_*"))


def test_a_dtensor_whose_mesh_reaches_outside_the_managers_group_is_refused(tmp_path):
    root = str(tmp_path / "root")
    first, _ = ranks("outside_group", 2, tmp_path, root)
    assert first["error"]["type"] == "UnsupportedValueError"
    assert "d: the DTensor's device mesh holds global ranks [1]" in first["error"]["message"]
    assert first["steps"] == []
