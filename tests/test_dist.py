"""Multi-rank saves with real gloo process groups, one process per rank."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _support.ranks import run_ranks as _run_ranks

from aiockpt import AsyncCheckpointManager
from aiockpt._core import format as fmt
from aiockpt._daemon.load.graft import graft
from aiockpt.errors import CheckpointError, LoadMismatchError


def run_ranks(scenario: str, world: int, tmp_path, root: str, timeout: float = 150) -> list[dict]:
    return _run_ranks("_dist_worker.py", scenario, world, tmp_path, root, timeout)


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_saves_and_loads_its_own_state(tmp_path, world):
    root = str(tmp_path / "run")
    results = run_ranks("save_load", world, tmp_path, root)
    for rank, r in enumerate(results):
        assert r["steps"] == [2]  # retention decided once, by rank 0
        assert r["own"] == [float(rank + 2)] * 16
        assert r["rank"] == rank + 2
    with open(os.path.join(root, "step_000000000002", "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["world_size"] == world
    files = [s["file"] for s in manifest["shards"]]
    for r, name in enumerate(files):  # named by the attempt that wrote it
        assert re.fullmatch(rf"shard_r{r:05d}\.[0-9a-f]{{16}}\.safetensors", name), name
    names = os.listdir(os.path.join(root, "step_000000000002"))
    # the ranks agreed through the job's store: nothing but the checkpoint in storage
    assert sorted(names) == sorted(["manifest.json", *files])
    for rank, r in enumerate(results):
        for requests in r["requests"]:
            assert requests["write_file"] == 1, requests  # the shard
            assert requests.get("put_if_absent", 0) == (1 if rank == 0 else 0), requests
            assert sum(requests.values()) <= 8, requests
    # the last rank came a second late: a storage poll would show on the others; none does
    late, others = results[-1]["requests"], [r["requests"] for r in results[1:-1]]
    assert all(o == late for o in others)
    assert [
        {k: v for k, v in r.items() if k != "put_if_absent"} for r in results[0]["requests"]
    ] == late


def test_killed_daemon_on_one_rank_fails_every_rank_quickly(tmp_path):
    root = str(tmp_path / "run")
    r0, r1 = run_ranks("kill_daemon", 2, tmp_path, root)
    assert r1["second"]["type"] == "DaemonDiedError"
    assert r0["second"]["type"] == "DistributedSaveError"
    assert r0["second"]["ranks"] == [1]
    assert "rank 1" in r0["second"]["message"]
    assert r0["seconds"] < 30  # told by rank 1's new daemon, long before the 60 s deadline
    assert not os.path.exists(os.path.join(root, "step_000000000002", "manifest.json"))
    assert r0["steps"] == r1["steps"] == [1, 3]
    assert r0["own"] == [0.0] * 16
    assert r1["own"] == [1.0] * 16


def test_mismatched_steps_and_one_sided_refusals_fail_on_every_rank(tmp_path):
    root = str(tmp_path / "run")
    results = run_ranks("mismatch", 2, tmp_path, root)
    for r in results:
        assert r["error"]["type"] == "InvalidStepError"
        assert "rank 0: 10, rank 1: 11" in r["error"]["message"]
        assert r["steps"] == [30]
    assert results[1]["refused"]["type"] == "UnsupportedValueError"
    assert results[0]["refused"]["type"] == "DistributedSaveError"
    assert results[0]["refused"]["ranks"] == [1]


def test_refusal_found_while_copying_fails_every_rank_quickly(tmp_path):
    root = str(tmp_path / "run")
    r0, r1 = run_ranks("late_refusal", 2, tmp_path, root)
    assert r1["second"]["type"] == "UnsupportedValueError"
    assert "model/w03" in r1["second"]["message"]
    assert r0["second"]["type"] == "DistributedSaveError"
    assert r0["second"]["ranks"] == [1]
    assert r0["seconds"] < 30  # told by rank 1, long before the 60 s deadline
    assert r0["steps"] == r1["steps"] == [1, 3]
    assert not os.path.exists(os.path.join(root, "step_000000000002", "manifest.json"))


@pytest.mark.anyio
async def test_replicated_state_loads_on_another_world_size(tmp_path):
    root = str(tmp_path / "run")
    run_ranks("replicated", 2, tmp_path, root)
    async with AsyncCheckpointManager(root) as mgr:  # one process, no process group
        out = await mgr.load(5)
        assert torch.equal(out["shared"]["w"], torch.arange(10, dtype=torch.float32))
        assert out["step"] == 5
        with pytest.raises(CheckpointError, match="differ between ranks.*own"):
            await mgr.load(6)


def test_torchrun_example_saves_stops_and_resumes(tmp_path):
    """examples/torchrun_trainer.py under torchrun with two gloo ranks, run twice."""
    example = os.path.join(os.path.dirname(__file__), "..", "examples", "torchrun_trainer.py")
    root = str(tmp_path / "ddp")
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    outputs = []
    for steps in (20, 40):
        done = subprocess.run(
            [*cmd, example, "--root", root, "--steps", str(steps)],
            env=env,
            capture_output=True,
            text=True,
            timeout=150,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        outputs.append(done.stdout)
    assert "RESUMED" not in outputs[0]
    assert "[rank 0/2] RESUMED from step 20" in outputs[1]
    assert "[rank 1/2] RESUMED from step 20" in outputs[1]
    assert "[rank 1] committed steps: [30, 40]" in outputs[1]


def test_state_dict_raising_on_one_rank_fails_every_rank_and_the_next_save_commits(tmp_path):
    """Ten times over: the last rank's state_dict() raises, every rank raises within
    seconds naming it, and the next save commits on every rank."""
    root = str(tmp_path / "run")
    r0, r1 = run_ranks("state_dict_raises", 2, tmp_path, root, timeout=60)
    for i, (f0, f1) in enumerate(zip(r0["failures"], r1["failures"], strict=True)):
        lazily = i % 2 == 0  # the error escapes state_dict(), raised as the tree is read
        assert f0["type"] == "DistributedSaveError", f0
        assert f0["ranks"] == [1]
        assert "rank 1: " in f0["message"]
        assert "state_dict exploded" in f0["message"]
        if lazily:  # not aiockpt's refusal: named as the rank's failure there too
            assert f1 == {**f0, "seconds": f1["seconds"]}
        else:
            assert f1["type"] == "StateDictError", f1
            assert f"rank 1: {f1['type']}: {f1['message']}" in f0["message"]
        assert f0["seconds"] < 10
        assert f1["seconds"] < 10
    assert len(r0["failures"]) == 10
    assert r0["steps"] == r1["steps"] == list(range(2, 21, 2))


def test_a_rank_late_past_dist_timeout_is_named_by_the_others(tmp_path):
    root = str(tmp_path / "run")
    r0, r1 = run_ranks("late_rank", 2, tmp_path, root, timeout=60)
    assert r0["error"]["type"] == "DistributedSaveError", r0
    assert r0["error"]["ranks"] == [1]
    assert "rank(s) [1] did not join" in r0["error"]["message"]
    assert r0["seconds"] < 2 + 5 + 1.5  # dist_timeout, then the wait for the others' marks
    assert r1["error"] is not None  # too late to save with rank 0, and told within its own
    assert r1["seconds"] < 2 + 5 + 1.5
    assert not os.path.exists(os.path.join(root, "step_000000000001", "manifest.json"))


def test_a_rank_gone_before_a_save_is_named_by_the_others(tmp_path):
    root = str(tmp_path / "run")
    r0, _ = run_ranks("dead_rank", 2, tmp_path, root, timeout=60)
    assert r0["error"]["type"] == "DistributedSaveError", r0
    assert r0["error"]["ranks"] == [1]
    assert "rank(s) [1] did not answer" in r0["error"]["message"]
    assert r0["seconds"] < 5 + 1.5  # the wait for the others' marks, not dist_timeout


@pytest.mark.parametrize(
    ("how", "world"),
    [("corrupt", 2), ("corrupt", 4), ("missing", 2), ("load_state_dict", 2)],
)
def test_a_load_failing_on_one_rank_fails_on_every_rank(tmp_path, how, world):
    """The last rank's shard is corrupt, or its target holds a key the checkpoint lacks:
    every rank raises, every target untouched. Its module refuses its state: every rank
    raises, naming it."""
    root = str(tmp_path / "run")
    *others, last = run_ranks(f"load_fails_{how}", world, tmp_path, root, timeout=90)
    n = world - 1
    own = {"corrupt": "CorruptCheckpointError", "missing": "LoadMismatchError"}
    assert last["error"]["type"] == own.get(how, "CheckpointError"), last
    for r in others:
        assert r["error"]["type"] == "CheckpointError", r
        assert f"failed on rank(s) [{n}]: rank {n}: " in r["error"]["message"]
        if how != "load_state_dict":
            assert last["error"]["message"] in r["error"]["message"]
    for rank, r in enumerate([*others, last]):
        if how != "load_state_dict":
            assert r["own"] == [-1.0] * 16  # untouched
            assert r["model"] == [-1.0] * 4
        else:
            assert "RuntimeError: load_state_dict exploded" in r["error"]["message"]
            assert "partly restored" in r["error"]["message"]
            assert r["own"] == [float(rank)] * 16  # restored before the module refused
            assert r["model"] == ([-1.0] if rank == n else [float(rank)]) * 4
        assert r["seconds"] < 10
        assert r["after"] == [float(rank)] * 16


def test_restore_order_is_the_same_on_every_rank_and_generators_come_last(tmp_path):
    """Two ranks hold the same keys in different orders, and each module's load_state_dict
    runs collectives: every rank restores them in one order (by key path), so each
    collective meets its counterpart; a generator is restored after the modules, so one
    drawing from it as it loads leaves the restored state as saved."""
    root = str(tmp_path / "run")
    r0, r1 = run_ranks("key_orders", 2, tmp_path, root, timeout=60)
    for r in (r0, r1):
        assert r["seen"] == [[name, True] for name in "abcde"]
        assert r["rng_restored"]


@pytest.mark.anyio
async def test_one_process_loads_what_it_selects_of_a_multi_rank_checkpoint(tmp_path):
    root = str(tmp_path / "run")
    run_ranks("replicated", 2, tmp_path, root)
    async with AsyncCheckpointManager(root) as mgr:  # one process, no process group
        out = await mgr.load(6, keys=["shared"])
        assert torch.equal(out["shared"]["w"], torch.arange(10, dtype=torch.float32))
        into = {"shared": {"w": torch.zeros(10), "note": ""}}
        await mgr.load(6, into=into, strict=False)
        assert torch.equal(into["shared"]["w"], torch.arange(10, dtype=torch.float32))
        with pytest.raises(CheckpointError, match=r"own.*ranks"):
            await mgr.load(6, keys=["own"])  # selected, and per rank: refused


@pytest.fixture(scope="module")
def global_keys(tmp_path_factory) -> tuple[str, list[dict]]:
    """The root of a 3-rank run of the ``global_keys`` scenario, and what each rank saw."""
    tmp = tmp_path_factory.mktemp("global")
    root = str(tmp / "run")
    return root, run_ranks("global_keys", 3, tmp, root, timeout=90)


def test_a_key_saved_by_some_ranks_loads_on_every_rank(global_keys):
    """One global namespace: a value saved by rank 0 only (a full state dict), or by two
    ranks identically, is read by any rank whose target asks for it; a key two ranks saved
    differently is refused on a rank that saved none, naming it and them."""
    _, results = global_keys
    full = {"w": [float(i) for i in range(12)], "b": [1.0, 1.0, 1.0]}
    for rank, r in enumerate(results):
        assert r["into"] == {
            "full": full,
            "both": [[0, 1, 2, 3, 4], "same"],
            "mine": [float(rank)] * 4,
            "step": 7,
        }, rank
        assert r["fresh"] == [full["w"], [0, 1, 2, 3, 4]]
    r0, r1, r2 = results
    assert r2["diff"]["type"] == "LoadMismatchError", r2
    assert "'diff'" in r2["diff"]["message"]
    assert "ranks 0, 1" in r2["diff"]["message"]
    for r in (r0, r1):
        assert r["diff"]["type"] == "CheckpointError", r
        assert "failed on rank(s) [2]" in r["diff"]["message"]


@pytest.mark.anyio
async def test_one_process_loads_a_key_rank_0_did_not_save(global_keys):
    root, _ = global_keys
    async with AsyncCheckpointManager(root) as mgr:
        out = await mgr.load(1, keys=["both"])  # saved by ranks 1 and 2, identically
        assert out["both"]["v"].tolist() == [0, 1, 2, 3, 4]
        assert out["both"]["tag"] == "same"
        full = await mgr.load(1, keys=["full"])  # rank 0's alone: the others saved nothing there
        assert full["full"]["w"].tolist() == [float(i) for i in range(12)]
        with pytest.raises(CheckpointError, match=r"diff.*ranks 1"):
            await mgr.load(1, keys=["diff"])


def test_grafting_leaves_the_manifest_trees_as_they_were(global_keys):
    """A manifest is kept and reused by the daemon: what a load takes from other ranks'
    trees is added to a new tree, never to the rank's own."""
    root = Path(global_keys[0])
    text = (root / f"step_{1:012d}" / "manifest.json").read_bytes()
    m = fmt.parse_manifest(text, path="manifest.json")
    before = copy.deepcopy(m.trees)
    tree, borrowed = graft(m, 0, m.trees[0], ["both", "mine", "nowhere"])
    assert m.trees == before
    assert [key for key, _ in tree["D"]] == [key for key, _ in before[0]["D"]] + ["both"]
    assert sorted(borrowed) == ["both/v"]
    assert borrowed["both/v"].covering(borrowed["both/v"].box)[0].shard == m.shard_of(1).file
    with pytest.raises(LoadMismatchError, match=r"'diff'.*ranks 0, 1"):
        graft(m, 2, m.trees[2], ["diff"])


def test_overwrite_and_delete_on_every_rank(tmp_path):
    """save(overwrite=True) on every rank replaces the step (the old shards swept), and
    delete() on every rank deletes through rank 0's daemon; the newest step is refused on
    every rank, as the same error."""
    root = str(tmp_path / "run")
    r0, r1 = run_ranks("replace_and_delete", 2, tmp_path, root, timeout=90)
    for rank, r in enumerate((r0, r1)):
        assert r["replaced"] == [10.0 + rank] * 4
        assert len(r["files"]) == 2  # one shard a rank: the replaced ones are gone
        assert r["newest"]["type"] == "InvalidStepError", r
        assert r["steps"] == [2]
        assert r["on_disk"] == [f"step_{2:012d}"]
    assert "allow_latest" in r0["newest"]["message"]
    assert "failed on rank 0" in r1["newest"]["message"]
