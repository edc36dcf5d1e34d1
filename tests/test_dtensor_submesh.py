"""DTensors on a sub-mesh of the job's mesh: FSDP + TP where a module is not tensor parallel.

On a (dp, tp) mesh, a module left out of tensor parallelism and sharded by FSDP has DTensors
of the 1-D dp sub-mesh: one sub-mesh per tp rank, each holding the same value. Each distinct
chunk is saved once, by the lowest global rank holding it, and loads into any layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest
from _support.ranks import run_ranks

from aiockpt import AsyncCheckpointManager

WORKER = "_dtensor_worker.py"


def ranks(scenario: str, world: int, tmp_path: Path, root: str, **args) -> list[dict]:
    return run_ranks(WORKER, scenario, world, tmp_path, root, timeout=120, args=args)


@pytest.fixture(scope="module", params=[[2, 2], [1, 2, 2]], ids=["dp2xtp2", "pp1xdp2xtp2"])
def mixed_run(request, tmp_path_factory) -> tuple[str, dict, Path]:
    """The model with one tensor-parallel layer saved on 4 ranks."""
    tmp = tmp_path_factory.mktemp("mixed")
    root = str(tmp / "root")
    saved = ranks("mixed_tp_save", 4, tmp, root, mesh=request.param)
    for rank in saved[1:]:
        assert rank["params"] == saved[0]["params"]
        assert rank["moments"] == saved[0]["moments"]
    return root, saved, tmp


def test_each_chunk_of_a_submesh_dtensor_is_saved_once_by_the_lowest_rank(mixed_run):
    root, saved, _ = mixed_run
    # The second layer is on the dp sub-meshes {0, 2} and {1, 3}.
    assert saved[0]["meshes"]["1.weight"] == [0, 2]
    assert saved[1]["meshes"]["1.weight"] == [1, 3]
    m = json.loads((Path(root) / f"step_{1:012d}" / "manifest.json").read_text())
    files = [s["file"] for s in m["shards"]]
    weight = m["dtensors"]["model/1.weight"]
    assert weight["shape"] == [5, 6]
    assert weight["mesh"] == [2]
    # 5 rows on dp = 2: 3 + 2, written by ranks 0 and 2 (ranks 1 and 3 hold copies).
    assert [(c["offsets"], c["sizes"], c["shard"]) for c in weight["chunks"]] == [
        ([0, 0], [3, 6], files[0]),
        ([3, 0], [2, 6], files[2]),
    ]
    for name in ("model/1.weight", "optim/state/3/exp_avg"):
        assert name not in m["tensors"][files[1]]
        assert name not in m["tensors"][files[3]]
    # The tensor-parallel layer is on the whole mesh: four chunks, one a rank.
    assert len(m["dtensors"]["model/0.weight"]["chunks"]) == 4


def test_a_submesh_checkpoint_loads_whole_in_a_plain_process(mixed_run):
    root, saved, _ = mixed_run

    async def main():
        async with AsyncCheckpointManager(root) as mgr:
            return await mgr.load(1)

    state = anyio.run(main)
    assert {k: v.tolist() for k, v in state["model"].items()} == saved[0]["params"]
    got = {
        f"{i}/{k}": v.tolist()
        for i, st in state["optim"]["state"].items()
        for k, v in st.items()
        if k != "step"
    }
    assert got == {k: v for k, v in saved[0]["moments"].items() if not k.endswith("/step")}


def test_a_submesh_checkpoint_loads_on_2_ranks_with_fsdp_alone(mixed_run):
    root, saved, tmp = mixed_run
    for rank in ranks("mixed_tp_load_fsdp", 2, tmp, root):
        assert rank["params"] == saved[0]["params"]
        assert rank["moments"] == saved[0]["moments"]


def test_a_full_state_saved_on_rank_0_loads_into_fsdp_and_tp_on_every_rank(tmp_path):
    """One global namespace of keys: the full state dict rank 0 alone saved (FSDP1's
    rank0_only habit) and the sharded state dict every rank saved, each loaded on every rank
    of a 2 x 2 (dp, tp) mesh into a fresh model: every parameter equals the saved one."""
    root = str(tmp_path / "root")
    saved = ranks("rank0_full_save", 4, tmp_path, root)
    assert [r["saved"] for r in saved] == [["full", "sharded"]] + [["sharded"]] * 3
    for rank in ranks("rank0_full_load", 4, tmp_path, root):
        assert rank["full"] == saved[0]["params"]
        assert rank["sharded"] == saved[0]["params"]
