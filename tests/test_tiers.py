"""A local tier on one process: every save committed there, every persist_every-th step in the
root too, keep honoured, the newest complete step loaded from either, and a tier that cannot
be written refused at open() with a clear error (see docs/tiers.md)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
from pathlib import Path

import pytest
import torch
from _support.ranks import run_ranks

from aiockpt import AsyncCheckpointManager, CheckpointManager, LatestN, LocalTier
from aiockpt._core.catalog import Catalog
from aiockpt._core.format import step_dirname
from aiockpt.cli import main as cli_main
from aiockpt.errors import CheckpointError, TierMismatchError
from aiockpt.storage import open_storage

pytestmark = pytest.mark.anyio


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.arange(step, step + 7), "step": step}


def committed(path: str | Path) -> list[int]:
    storage = open_storage(str(path))
    try:
        return Catalog(storage).committed_steps()
    finally:
        storage.close()


def same(a: dict, b: dict) -> bool:
    return a["step"] == b["step"] and all(torch.equal(a[k], b[k]) for k in ("w", "b"))


def test_local_tier_checks_its_options(tmp_path):
    tier = LocalTier(tmp_path / "t", keep=3, replicas=1)
    assert (tier.path, tier.keep, tier.replicas) == (str(tmp_path / "t"), 3, 1)
    assert pickle.loads(pickle.dumps(tier)) == tier
    for bad in ({"keep": 0}, {"replicas": -1}, {"keep": True}):
        with pytest.raises(ValueError, match="LocalTier's"):
            LocalTier(tmp_path, **bad)
    with pytest.raises(ValueError, match="not a URL"):
        LocalTier("nosuchstore://bucket/x")  # no storage registered with aiockpt serves it
    assert LocalTier(f"file://{tmp_path}/t") == LocalTier(tmp_path / "t")
    with pytest.raises(TypeError):
        LocalTier(tmp_path, 2)  # type: ignore[misc]  # keywords only
    with pytest.raises(ValueError, match="needs a local tier"):
        AsyncCheckpointManager(tmp_path / "root", persist_every=5)
    with pytest.raises(ValueError, match="staging_memory"):
        AsyncCheckpointManager(tmp_path / "root", local=LocalTier(tmp_path), staging_memory=1 << 20)
    with pytest.raises(ValueError, match="persist_every"):
        AsyncCheckpointManager(tmp_path / "root", local=LocalTier(tmp_path), persist_every=0)


async def test_one_process_saves_locally_and_persists_every_nth(tmp_path, capsys):
    root, local = tmp_path / "root", tmp_path / "local"
    tier = LocalTier(local, keep=2)
    events = []
    async with AsyncCheckpointManager(
        root, local=tier, persist_every=5, retention=LatestN(3), event_handlers=[events.append]
    ) as mgr:
        for step in range(1, 8):
            info = await (await mgr.save(step, state(step)))
            assert info.step == step
        assert await mgr.steps() == [5, 6, 7]  # the local tier's two, and the root's one
        assert await mgr.latest_step() == 7
        got = await mgr.load()
        assert same(got, state(7))
    assert committed(local) == [6, 7]
    assert committed(root) == [5]
    capsys.readouterr()
    assert cli_main(["ls", str(local), "--json"]) == 0  # a tier is a root: `aiockpt ls` lists it
    assert [json.loads(line)["step"] for line in capsys.readouterr().out.splitlines()] == [6, 7]
    names = [e.name for e in events]
    assert names.count("tier.committed") == 7
    assert {e.tier for e in events if e.name.startswith("tier.")} == {"local"}
    assert names.count("tier.delete") == 5
    assert "tier.failed" not in names

    # Relaunched with the tier: step 7 comes back bit-exact, into a state in place too.
    async with AsyncCheckpointManager(root, local=tier, persist_every=5) as mgr:
        assert await mgr.latest_step() == 7
        target = state(0)
        await mgr.load(into=target)
        assert same(target, state(7))
        assert same(await mgr.load(6), state(6))
        assert same(await mgr.load(5), state(5))  # from the root
    # The root alone sees only what was persisted.
    async with AsyncCheckpointManager(root) as mgr:
        assert await mgr.steps() == [5]
        assert same(await mgr.load(), state(5))


async def test_the_tier_never_holds_more_than_keep(tmp_path):
    local = tmp_path / "local"
    async with AsyncCheckpointManager(
        tmp_path / "root", local=LocalTier(local, keep=3), persist_every=100
    ) as mgr:
        for step in range(1, 12):
            await (await mgr.save(step, state(step)))
            assert len(committed(local)) <= 3
            assert committed(local)[-1] == step
    assert committed(local) == [9, 10, 11]
    assert committed(tmp_path / "root") == []


async def test_delete_removes_a_step_from_every_tier(tmp_path):
    """A deleted step never comes back from the tier: delete() removes it wherever it lies,
    the tier and the root, and refuses a step in neither."""
    root, local = tmp_path / "root", tmp_path / "local"
    tier = LocalTier(local, keep=3)
    async with AsyncCheckpointManager(root, local=tier, persist_every=2) as mgr:
        for step in range(1, 5):
            await (await mgr.save(step, state(step)))
        assert (committed(local), committed(root)) == ([2, 3, 4], [2, 4])
        await mgr.delete(2)  # in both
        await mgr.delete(3)  # in the tier alone
        assert (committed(local), committed(root)) == ([4], [4])
        assert await mgr.steps() == [4]
        with pytest.raises(CheckpointError, match="not a committed"):
            await mgr.delete(1)  # in neither
        with pytest.raises(CheckpointError, match="allow_latest"):
            await mgr.delete(4)
        await mgr.delete(4, allow_latest=True)
        assert await mgr.steps() == []
    async with AsyncCheckpointManager(root, local=tier, persist_every=2) as mgr:
        assert await mgr.steps() == []


async def test_wiped_tier_resumes_from_the_root(tmp_path):
    root, local = tmp_path / "root", tmp_path / "local"
    tier = LocalTier(local, keep=2)
    async with AsyncCheckpointManager(root, local=tier, persist_every=5) as mgr:
        for step in range(1, 8):
            await (await mgr.save(step, state(step)))
    for name in os.listdir(local):
        os.system(f"rm -rf {local / name}")
    async with AsyncCheckpointManager(root, local=tier, persist_every=5) as mgr:
        assert await mgr.latest_step() == 5
        assert same(await mgr.load(), state(5))
        await (await mgr.save(6, state(6)))  # saving goes on from there
        assert await mgr.steps() == [5, 6]


async def test_a_tier_url_must_be_served_from_a_local_directory(tmp_path, monkeypatch):
    from _support.storages import open_in_memory, open_unordered

    from aiockpt.storage import register_storage
    from aiockpt.storage._registry import ENV_VAR

    monkeypatch.setenv(ENV_VAR, "")
    tests = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))
    )
    register_storage("inmemory", open_in_memory)
    register_storage("unordered", open_unordered)  # a LocalStorage of its own
    mgr = AsyncCheckpointManager(tmp_path / "root", local=LocalTier("inmemory://tier"))
    with pytest.raises(CheckpointError, match="FsspecStorage, not by a local directory"):
        await mgr.open()
    await mgr.aclose()
    tier = LocalTier(f"unordered://{tmp_path}/tier", keep=1)
    async with AsyncCheckpointManager(tmp_path / "root", local=tier, persist_every=2) as mgr:
        for step in (1, 2, 3):
            await (await mgr.save(step, state(step)))
    assert committed(tmp_path / "tier") == [3]
    assert committed(tmp_path / "root") == [2]


async def test_an_unwritable_tier_fails_open_clearly(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    mgr = AsyncCheckpointManager(tmp_path / "root", local=LocalTier(blocker / "tier"))
    with pytest.raises(CheckpointError, match="local tier .* cannot be written"):
        await mgr.open()
    await mgr.aclose()
    # Nothing reached the root, and a manager without the tier opens on it as before.
    async with AsyncCheckpointManager(tmp_path / "root") as plain:
        assert await plain.steps() == []


async def test_a_tier_failure_mid_run_is_an_event_and_local_only_steps_raise(tmp_path):
    root, local = tmp_path / "root", tmp_path / "local"
    events = []
    async with AsyncCheckpointManager(
        root, local=LocalTier(local), persist_every=2, event_handlers=[events.append]
    ) as mgr:
        await (await mgr.save(1, state(1)))
        for step in (3, 4):  # the tier cannot make these steps' directories
            (local / step_dirname(step)).write_text("in the way")
        with pytest.raises(CheckpointError, match="landed nowhere"):
            await (await mgr.save(3, state(3)))
        info = await (await mgr.save(4, state(4)))  # due in the root: it commits there
        assert info.step == 4
        assert await mgr.steps() == [1, 4]
    failed = [e for e in events if e.name == "tier.failed"]
    assert [e.step for e in failed] == [3, 4]
    assert all(e.tier == "local" and e.detail for e in failed)
    assert committed(root) == [4]


def test_the_sync_manager_takes_the_tier(tmp_path):
    with CheckpointManager(
        tmp_path / "root", local=LocalTier(tmp_path / "local", keep=1), persist_every=2
    ) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state(step)).result()
        assert mgr.steps() == [2, 3]
        assert same(mgr.load(), state(3))
    assert committed(tmp_path / "local") == [3]


async def test_replicas_on_one_host_make_no_copies(tmp_path):
    events = []
    tier = LocalTier(tmp_path / "local", replicas=1)  # one host: nobody to copy to
    async with AsyncCheckpointManager(
        tmp_path / "root", local=tier, persist_every=2, event_handlers=[events.append]
    ) as mgr:
        for step in (1, 2, 3):
            await (await mgr.save(step, state(step)))
        assert same(await mgr.load(), state(3))
    assert not [e for e in events if e.tier == "peer"]


def run_tiers(scenario: str, world: int, tmp_path: Path, root: str, args: dict) -> list[dict]:
    """Each launch a job of its own: its own store file, as a relaunch has."""
    run = tmp_path / f"run{len(list(tmp_path.glob('run*')))}"
    run.mkdir()
    return run_ranks("_tiers_worker.py", scenario, world, run, root, args=args)


def test_two_ranks_share_one_hosts_tier(tmp_path):
    root = str(tmp_path / "root")
    args = {"hosts": ["a", "a"], "local": {"a": str(tmp_path / "a")}, "persist_every": 5}
    saved = run_tiers("save", 2, tmp_path, root, args)
    assert [r["steps"] for r in saved] == [[5, 6, 7]] * 2
    assert saved[0]["events"].count("tier.committed") == 7
    assert committed(tmp_path / "a") == [6, 7]
    assert committed(root) == [5]
    resumed = run_tiers("resume", 2, tmp_path, root, args)
    assert [(r["latest"], r["step"], r["rank"], r["exact"]) for r in resumed] == [
        (7, 7, 0, True),
        (7, 7, 1, True),
    ]
    os.system(f"rm -rf {tmp_path / 'a'}")
    resumed = run_tiers("resume", 2, tmp_path, root, args)
    assert [(r["latest"], r["step"], r["exact"]) for r in resumed] == [(5, 5, True)] * 2


def two_hosts(tmp_path: Path, hosts: tuple[str, str] = ("a", "b"), replicas: int = 0) -> dict:
    """4 ranks as 2 simulated hosts, each host's tier its own directory."""
    a, b = hosts
    local = {h: str(tmp_path / f"local-{h}") for h in hosts}
    return {"hosts": [a, a, b, b], "local": local, "persist_every": 5, "replicas": replicas}


def shard_ranks(tier: Path, step: int) -> set[int]:
    return {int(f[7:12]) for f in os.listdir(tier / step_dirname(step)) if f.startswith("shard_r")}


def test_two_hosts_resume_from_their_own_tiers(tmp_path):
    root = str(tmp_path / "root")
    args = two_hosts(tmp_path)
    saved = run_tiers("save", 4, tmp_path, root, args)
    assert [r["steps"] for r in saved] == [[5, 6, 7]] * 4
    assert committed(root) == [5]
    for host, ranks in (("a", {0, 1}), ("b", {2, 3})):
        assert committed(tmp_path / f"local-{host}") == [6, 7]
        files = os.listdir(tmp_path / f"local-{host}" / step_dirname(7))
        assert {int(f[7:12]) for f in files if f.startswith("shard_r")} == ranks
    resumed = run_tiers("resume", 4, tmp_path, root, args)
    assert [(r["latest"], r["step"], r["rank"], r["exact"]) for r in resumed] == [
        (7, 7, rank, True) for rank in range(4)
    ]
    assert [r["tiers"] for r in resumed] == [["local"]] * 4


def test_a_host_lost_without_replicas_resumes_from_the_root(tmp_path):
    root = str(tmp_path / "root")
    args = two_hosts(tmp_path)
    run_tiers("save", 4, tmp_path, root, args)
    # Host b is replaced by a fresh host c with an empty tier: step 7's shards of ranks 2
    # and 3 are nowhere, so the newest step every rank can load is the root's 5.
    fresh = two_hosts(tmp_path, ("a", "c"))
    resumed = run_tiers("resume", 4, tmp_path, root, fresh)
    assert [(r["latest"], r["step"], r["exact"]) for r in resumed] == [(5, 5, True)] * 4
    assert [r["tiers"] for r in resumed] == [["root"]] * 4


def test_both_tiers_wiped_resume_from_the_root(tmp_path):
    root = str(tmp_path / "root")
    args = two_hosts(tmp_path)
    run_tiers("save", 4, tmp_path, root, args)
    for host in ("a", "b"):
        os.system(f"rm -rf {tmp_path / f'local-{host}'}")
    resumed = run_tiers("resume", 4, tmp_path, root, args)
    assert [(r["latest"], r["step"], r["exact"]) for r in resumed] == [(5, 5, True)] * 4


def test_a_host_replaced_resumes_from_its_partners_replicas(tmp_path):
    root = str(tmp_path / "root")
    args = two_hosts(tmp_path, replicas=1)
    saved = run_tiers("save", 4, tmp_path, root, args)
    assert [r["steps"] for r in saved] == [[5, 6, 7]] * 4
    # Each rank's shard of each step is in its own host's tier and in its partner's.
    assert [r["events"].count("tier.replicated") for r in saved] == [7] * 4
    assert all("tier.failed" not in r["events"] for r in saved)
    for host in ("a", "b"):
        assert committed(tmp_path / f"local-{host}") == [6, 7]
        assert shard_ranks(tmp_path / f"local-{host}", 7) == {0, 1, 2, 3}
    # Host b is lost, its disk with it, and replaced by a fresh host c with an empty tier:
    # ranks 2 and 3 read step 7's shards from host a over the network as they load, and
    # resume it bit-exact; nothing is copied into host c's tier.
    os.system(f"rm -rf {tmp_path / 'local-b'}")
    fresh = two_hosts(tmp_path, ("a", "c"), replicas=1)
    resumed = run_tiers("resume", 4, tmp_path, root, fresh)
    assert [(r["latest"], r["step"], r["rank"], r["exact"]) for r in resumed] == [
        (7, 7, rank, True) for rank in range(4)
    ]
    assert [r["tiers"] for r in resumed] == [["local"], ["local"], ["peer"], ["peer"]]
    assert committed(tmp_path / "local-c") == []
    assert os.listdir(tmp_path / "local-c") == ["_tier.json"]  # its tie to the root alone


def test_a_corrupt_or_lost_replica_fails_the_load_on_every_rank(tmp_path):
    root = str(tmp_path / "root")
    args = two_hosts(tmp_path, replicas=1)
    run_tiers("save", 4, tmp_path, root, args)
    os.system(f"rm -rf {tmp_path / 'local-b'}")
    fresh = two_hosts(tmp_path, ("a", "c"), replicas=1)
    # A byte of host a's copy of rank 2's shard of step 7 rots: the tensor's crc32c catches
    # it as rank 2 reads it over the network, and the load fails on every rank.
    step7 = tmp_path / "local-a" / step_dirname(7)
    (replica,) = [f for f in os.listdir(step7) if f.startswith("shard_r00002.")]
    data = bytearray((step7 / replica).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (step7 / replica).write_bytes(bytes(data))
    resumed = run_tiers("try_resume", 4, tmp_path, root, fresh)
    assert [r["latest"] for r in resumed] == [7] * 4
    errors = [r["error"] for r in resumed]
    assert errors[2][0] == "CorruptCheckpointError"
    assert all(e[0] == "CheckpointError" and "rank(s) [2]" in e[1] for e in errors[:2] + errors[3:])
    assert errors[2][1].startswith(f"peer://rank0/{step_dirname(7)}/{replica}")
    # Host a's daemons die once the ranks agreed on step 7 and before host c's load it: the
    # load fails on every rank, never a hang; host c's ranks find step 7 nowhere, having
    # said that their partners cannot be reached.
    data[len(data) // 2] ^= 0xFF
    (step7 / replica).write_bytes(bytes(data))
    resumed = run_tiers("try_resume", 4, tmp_path, root, {**fresh, "kill": "a"})
    assert [r["latest"] for r in resumed] == [7] * 4
    errors = [r["error"] for r in resumed]
    assert errors[0] is not None  # their daemons died: what they say depends on how soon
    assert errors[1] is not None
    for rank, partner in ((2, 0), (3, 1)):
        assert errors[rank][0] == "CheckpointNotFoundError"
        assert "step 7 is not a committed checkpoint" in errors[rank][1]
        assert any(f"by rank {partner}:" in why for why in resumed[rank]["failed"])


def test_delete_on_several_hosts_removes_the_step_from_every_tier(tmp_path):
    root = str(tmp_path / "root")
    args = two_hosts(tmp_path)
    run_tiers("save", 4, tmp_path, root, args)
    deleted = run_tiers("delete", 4, tmp_path, root, {**args, "delete": 6})
    assert [r["steps"] for r in deleted] == [[5, 7]] * 4
    for host in ("a", "b"):
        assert committed(tmp_path / f"local-{host}") == [7], host
    resumed = run_tiers("resume", 4, tmp_path, root, args)
    assert [(r["step"], r["exact"]) for r in resumed] == [(7, True)] * 4


def test_delete_on_several_hosts_is_checked_against_what_a_resume_loads(tmp_path):
    root = str(tmp_path / "root")
    args = two_hosts(tmp_path)
    run_tiers("save", 4, tmp_path, root, args)
    # A delete(6) that removed step 6 from the root side and host a's tier, then failed on
    # host b: asked again, it removes what is left, rather than find nothing on rank 0.
    os.system(f"rm -rf {tmp_path / 'local-a' / step_dirname(6)}")
    again = run_tiers("try_delete", 4, tmp_path, root, {**args, "delete": 6})
    assert [r["error"] for r in again] == [None] * 4
    assert (committed(tmp_path / "local-a"), committed(tmp_path / "local-b")) == ([7], [7])
    # Host b's tier lost: a resume loads the root's 5, the newest step every rank can load,
    # so delete(5) needs allow_latest although host a's tier holds 7.
    os.system(f"rm -rf {tmp_path / 'local-b'}")
    refused = run_tiers("try_delete", 4, tmp_path, root, {**args, "delete": 5})
    assert [r["error"][0] for r in refused] == ["InvalidStepError"] * 4
    assert [r["steps"] for r in refused] == [[5]] * 4
    gone = run_tiers("try_delete", 4, tmp_path, root, {**args, "delete": 4})
    assert [r["error"][0] for r in gone] == ["CheckpointNotFoundError"] * 4


def test_a_tier_that_cannot_be_cleaned_fails_open_on_every_rank(tmp_path):
    """Host b's first rank cannot remove a partial step of its tier: every rank's open()
    fails at once, saying so, instead of waiting out the others at a barrier."""
    root = str(tmp_path / "root")
    args = two_hosts(tmp_path)
    run_tiers("save", 4, tmp_path, root, {**args, "last": 3})
    partial = tmp_path / "local-b" / step_dirname(1)
    partial.mkdir()
    stuck = partial / "shard_r00002.0123456789abcdef.safetensors"
    stuck.write_bytes(b"cut short")
    subprocess.run(["chattr", "+i", str(stuck)], check=True)  # unlink(2) fails, even as root
    try:
        opened = run_tiers("opens", 4, tmp_path, root, {**args, "dist_timeout": 600})
    finally:
        subprocess.run(["chattr", "-i", str(stuck)], check=True)
    kinds = [r["error"][0] for r in opened]
    assert kinds == ["DaemonStartError"] * 2 + ["StorageError"] + ["DaemonStartError"], opened
    for r in opened:
        assert "Operation not permitted" in r["error"][1]


async def test_a_tier_reshards_only_steps_whose_every_shard_it_can_read(tmp_path, monkeypatch):
    """One process resumes, as host a, a weight 2 ranks on hosts a and b sharded: it needs
    both ranks' shards. Host a's tier holds rank 1's through its replica; where that replica
    is missing, the step is not loadable there and an older one is."""
    from _tiers_worker import full_weight

    root = str(tmp_path / "root")
    args = {"hosts": ["a", "b"], "local": {h: str(tmp_path / f"local-{h}") for h in "ab"}}
    args.update(persist_every=5, replicas=1)
    run_tiers("save_sharded", 2, tmp_path, root, args)
    monkeypatch.setenv("AIOCKPT_HOST_ID", "a")
    tier = LocalTier(args["local"]["a"], keep=2, replicas=1)

    async def resumed() -> tuple[int | None, dict]:
        async with AsyncCheckpointManager(root, local=tier, persist_every=5) as mgr:
            target = {"w": torch.zeros(6, 4), "step": 0}
            await mgr.load(into=target)
            return await mgr.latest_step(), target

    latest, target = await resumed()
    assert (latest, target["step"]) == (7, 7)
    assert torch.equal(target["w"], full_weight(7))
    step7 = tmp_path / "local-a" / step_dirname(7)
    for name in os.listdir(step7):
        if name.startswith("shard_r00001."):
            os.unlink(step7 / name)  # rank 1's replica of step 7 is lost
    latest, target = await resumed()
    assert (latest, target["step"]) == (6, 6)
    assert torch.equal(target["w"], full_weight(6))


def test_every_hosts_tier_loses_its_partial_steps_at_open(tmp_path):
    """A save cut short leaves a step directory without a manifest in each host's tier; the
    next open removes it on every host, not only on rank 0's."""
    root = str(tmp_path / "root")
    args = two_hosts(tmp_path)
    run_tiers("save", 4, tmp_path, root, args)
    for host, rank in (("a", 0), ("b", 2)):
        partial = tmp_path / f"local-{host}" / step_dirname(3)
        partial.mkdir()
        (partial / f"shard_r{rank:05d}.0123456789abcdef.safetensors").write_bytes(b"cut short")
    resumed = run_tiers("resume", 4, tmp_path, root, args)
    assert [(r["step"], r["exact"]) for r in resumed] == [(7, True)] * 4
    for host in ("a", "b"):
        assert not (tmp_path / f"local-{host}" / step_dirname(3)).exists(), host
        assert committed(tmp_path / f"local-{host}") == [6, 7]


# ------------------------------------------------------------------ a tier belongs to one root


async def test_two_roots_sharing_a_tier_path_are_kept_apart(tmp_path):
    """Run B, its root new, opens run A's tier directory: refused, naming both roots, before
    anything is listed, loaded or pruned; run A, reopened, has its steps as they were."""
    tier = LocalTier(tmp_path / "nvme", keep=2)
    root_a, root_b = tmp_path / "a", tmp_path / "b"
    async with AsyncCheckpointManager(root_a, local=tier, persist_every=5) as mgr:
        for step in (1, 2, 3):
            await (await mgr.save(step, state(step)))
        id_a = mgr.root_id
    with pytest.raises(TierMismatchError) as err:
        async with AsyncCheckpointManager(root_b, local=tier, persist_every=5) as mgr:
            pass
    message = str(err.value)
    assert str(root_a) in message
    assert str(root_b) in message
    assert id_a is not None
    assert id_a in message
    assert committed(tmp_path / "nvme") == [2, 3]
    async with AsyncCheckpointManager(root_a, local=tier, persist_every=5) as mgr:
        assert await mgr.steps() == [2, 3]
        assert same(await mgr.load(), state(3))


async def test_a_tier_is_tied_to_its_root_by_id_not_by_spelling(tmp_path, monkeypatch):
    real = tmp_path / "gpfs" / "run"
    (tmp_path / "link").symlink_to(tmp_path / "gpfs")
    tier = LocalTier(tmp_path / "nvme", keep=2)
    async with AsyncCheckpointManager(real, local=tier) as mgr:
        await (await mgr.save(1, state(1)))
    monkeypatch.chdir(tmp_path)
    for spelling in (f"file://{real}", str(tmp_path / "link" / "run") + "/", "gpfs/run"):
        async with AsyncCheckpointManager(spelling, local=tier) as mgr:
            assert same(await mgr.load(), state(1))


async def test_a_tier_from_before_ties_is_taken_by_the_first_root_to_open_it(tmp_path):
    """A root and tier as releases before identities left them (no _root.json, _peer.key,
    _tier.json): they open and load; the tier is then tied to that root, said by an event."""
    root, nvme = tmp_path / "root", tmp_path / "nvme"
    tier = LocalTier(nvme, keep=2)
    async with AsyncCheckpointManager(root, local=tier, persist_every=2) as mgr:
        for step in (1, 2, 3):
            await (await mgr.save(step, state(step)))
    for old in (root / "_root.json", root / "_peer.key", nvme / "_tier.json"):
        old.unlink()
    events: list = []
    async with AsyncCheckpointManager(
        root, local=tier, persist_every=2, event_handlers=[events.append]
    ) as mgr:
        assert await mgr.steps() == [2, 3]
        assert same(await mgr.load(), state(3))
        rid = mgr.root_id
    assert [e.name for e in events].count("tier.adopted") == 1
    assert json.loads((nvme / "_tier.json").read_text())["root"] == rid
    with pytest.raises(TierMismatchError):
        async with AsyncCheckpointManager(tmp_path / "other", local=tier):
            pass


def test_ranks_of_one_host_with_a_tier_each_are_refused_at_open(tmp_path):
    """Two ranks of one host, each given its own tier directory (as two machines given one
    AIOCKPT_HOST_ID would be): every rank's open() fails, naming the ranks, the host and
    both directories; nothing is saved that no rank could load."""
    root = str(tmp_path / "root")
    t0, t1 = str(tmp_path / "t0"), str(tmp_path / "t1")
    args = {"hosts": ["a", "a"], "local": {"a": t0}, "tier_of_rank": [t0, t1]}
    opened = run_tiers("opens", 2, tmp_path, root, args)
    for r in opened:
        assert r["error"] is not None, opened
        kind, message = r["error"]
        assert kind == "TierMismatchError", r
        assert "rank 1 (host a) does not share the tier of rank 0" in message
        assert t0 in message
        assert t1 in message
    assert os.listdir(t1) == []  # rank 1's directory: nothing of this job
    assert committed(t0) == []
