"""Crash-point checking (ALICE / CrashMonkey style) of the local backend and of an object store.

A real manager and its daemon save through ``crashrec://`` (tests/plugins/aiockpt-crash-recorder),
which records every file-system operation and Storage call; the trainer marks each ``await
handle`` in the same log. Every state a crash may leave at every point of the log is rebuilt
in a directory and checked: what is listed loads bit-exact and verifies, no step promised
durable is missing, partials are collected and never listed (see docs/crash-points.md).

The two-writer run adds a writer fenced off by a takeover while it was half way through a
shard: what it did after its pause is checked at every position among the new holder's save
and retention, and no committed step of the new holder may change.

The default run checks a seeded sample; ``AIOCKPT_CRASH_ALL=1`` checks every state.
"""

from __future__ import annotations

import anyio
import crc32c
import pytest
from _crash_checker import FULL, Budget, check
from _crash_model import CrashState, FsModel, object_states
from _crash_record import (
    CONTESTED,
    read_log,
    record_incremental,
    record_single,
    record_tier,
    record_two_writers,
)
from _support.ranks import run_ranks
from aiockpt_crash_recorder import RecordingStorage, mark

from aiockpt.errors import StorageError
from aiockpt.storage import registered_protocols

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(7200 if FULL else 900)]

#: The sampled run: states per crash point, crash states a fresh manager opens, and, with two
#: writers, interleavings besides the one with the fenced writer's operations last.
SAMPLED = Budget(per_point=3, opens=3, interleavings=6)
EVERYTHING = Budget(per_point=None, opens=None, interleavings=None)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The recorded single-rank run."""
    assert "crashrec" in registered_protocols(), (
        "install the recorder: pip install --no-deps -e tests/plugins/aiockpt-crash-recorder"
    )
    tmp = tmp_path_factory.mktemp("single")
    return anyio.run(record_single, str(tmp / "run"), str(tmp / "log"))


@pytest.fixture(scope="module")
def incremental(tmp_path_factory):
    """The recorded single-rank run of incremental checkpoints."""
    tmp = tmp_path_factory.mktemp("incremental")
    return anyio.run(record_incremental, str(tmp / "run"), str(tmp / "log"))


@pytest.fixture(scope="module")
def tier(tmp_path_factory):
    """The recorded single-rank run with a recorded local tier and a plain root."""
    tmp = tmp_path_factory.mktemp("tier")
    return anyio.run(record_tier, str(tmp / "root"), str(tmp / "tier"), str(tmp / "log"))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The recorded two-rank run (real gloo ranks, one daemon each), recorded once."""
    tmp = tmp_path_factory.mktemp("ranks")
    root, log = tmp / "run", tmp / "log"
    root.mkdir()
    run_ranks("crash/_rank_worker.py", "record", 2, tmp, str(root), args={"log": str(log)})
    return read_log(str(log), world=2)


@pytest.fixture(scope="module")
def two_writers(tmp_path_factory):
    """The recorded two-writer run: A paused mid-shard, B's takeover, saves and retention,
    then A's late write and its LeaseLostError."""
    tmp = tmp_path_factory.mktemp("writers")
    return anyio.run(record_two_writers, str(tmp / "run"), str(tmp / "log"))


def test_the_recorder_sees_every_kind_of_operation(single):
    kinds = {r["op"] for r in single.records}
    for kind in ("create", "write", "fsync", "fsync_dir", "rename", "link", "unlink", "mkdir"):
        assert kind in kinds
    assert "rmdir" in kinds
    calls = {r["call"] for r in single.records if r["op"] == "api"}
    assert calls == {"write_file", "put_atomic", "put_if_absent", "makedirs", "delete"}
    assert [r["durable"] for r in single.records if "durable" in r] == [1, 2, 4]


def test_the_incremental_run_retires_step_1_and_removes_step_2(incremental):
    """Recorded before the async checks (its fixture runs its own event loop): retention
    deleted step 1's manifest but not its shard, which steps 2 and 3 read, and all of step 2."""
    deletes = [r["path"] for r in incremental.records if r.get("call") == "delete"]
    assert "step_000000000001/manifest.json" in deletes
    assert not any(p.startswith("step_000000000001/shard_r00000.") for p in deletes)
    assert "step_000000000001" not in deletes
    assert "step_000000000002" in deletes  # nothing of it was read by step 3
    assert [r["durable"] for r in incremental.records if "durable" in r] == [1, 2, 3]


def test_the_fenced_writer_resumes_after_the_new_holder_committed(two_writers):
    """Recorded before the async checks (its fixture runs its own event loop): A paused in
    the middle of its own file of step 2; B committed steps 2 and 3 and deleted step 1
    meanwhile; A wrote the rest of its file after all that, and nothing else."""
    records = two_writers.records
    pause = next(i for i, r in enumerate(records) if r["op"] == "pause")
    resume = next(i for i, r in enumerate(records) if r["op"] == "resume")
    step_dir = f"step_{CONTESTED:012d}/"
    (fenced_file,) = {
        r["path"]
        for r in records[pause:]
        if r.get("writer") == "a" and r["op"] == "write" and r["path"].startswith(step_dir)
    }
    between = records[pause + 1 : resume]
    assert all(r.get("writer") == "b" for r in between)
    assert [r["durable"] for r in between if "durable" in r] == [CONTESTED, CONTESTED + 1]
    assert any(
        r.get("call") == "delete" and r["path"] == "step_000000000001/manifest.json"
        for r in between
    )
    committed = [
        r["path"]
        for r in between
        if r.get("call") == "write_file" and r["path"].startswith(step_dir)
    ]
    assert len(committed) == 1
    assert committed != [fenced_file]  # B's file is its own
    late = [r for r in records[resume:] if r.get("writer") == "a"]
    assert {r["op"] for r in late} == {"resume", "write", "fsync", "fsync_dir", "api"}
    assert all(r.get("path") in (fenced_file, step_dir.rstrip("/")) for r in late[1:])


def test_the_tier_run_commits_prunes_and_collects_in_the_tier(tier):
    """Recorded before the async checks (its fixture runs its own event loop): every step
    committed in the tier, its retention deleted steps 1 and 2 there (2 is in the root too),
    and the new manager's open removed the partial step 3."""
    records = tier.records
    commits = [r["path"] for r in records if r.get("call") == "put_if_absent"]
    for step in (1, 2, 4, 5):
        assert f"step_{step:012d}/manifest.json" in commits
    deletes = [r["path"] for r in records if r.get("call") == "delete"]
    for step in (1, 2):
        assert f"step_{step:012d}/manifest.json" in deletes
    last = max(i for i, r in enumerate(records) if "durable" in r)
    assert any(r.get("path") == "step_000000000003" for r in records[last:])
    assert [r["durable"] for r in records if "durable" in r] == [1, 2, 4, 5]


def test_a_peer_replica_is_whole_under_its_name_in_every_crash_state(tmp_path):
    """A peer replica's arrival (``LocalStorage.receive``, into which the daemon's
    ``receive_file`` streams what a partner sends, and a replacement host's fetch): in every
    crash state of every model, the file's name holds nothing or all of its bytes, and all of
    them once ``receive`` has returned; a second copy never replaces it, a copy that fails
    its crc32c leaves nothing, and no temporary file survives a finished call."""
    (tmp_path / "tier").mkdir()
    log = str(tmp_path / "log")
    storage = RecordingStorage(str(tmp_path / "tier"), log=log)
    storage.makedirs("step_000000000001")
    path = "step_000000000001/shard_r00000.0123456789abcdef.safetensors"
    data = bytes(range(256)) * 1000
    pieces = [data[i : i + 100_000] for i in range(0, len(data), 100_000)]
    assert storage.receive(path, iter(pieces), crc32c.crc32c(data))
    mark(log, received=path)
    assert not storage.receive(path, iter([b"another"]), crc32c.crc32c(b"another"))
    with pytest.raises(StorageError, match="crc32c"):
        storage.receive(path + ".x", iter([b"torn"]), 0)
    records = read_log(log).records
    assert [r["result"] for r in records if r.get("call") == "receive"] == [True, False]
    done = next(i for i, r in enumerate(records) if r.get("received"))
    seen = {"absent": 0, "whole": 0}
    for model in ("ordered", "posix", "objects"):
        if model == "objects":
            trees = list(object_states(records))
        else:
            fs = FsModel(records, model)
            trees = [
                (p, fs.tree(st)) for p in range(len(records) + 1) for st in fs.states(p, None, "")
            ]
        for point, tree in trees:
            got = tree.get(path)
            assert got in (None, data), f"{model}, crash point {point}: {path} is torn"
            assert point <= done or got == data, f"{model}, crash point {point}: {path} lost"
            seen["absent" if got is None else "whole"] += 1
    final = FsModel(records, "posix").tree(CrashState(len(records), ()))
    assert sorted(final) == ["step_000000000001", path]
    assert seen["absent"] >= 10
    assert seen["whole"] >= 10


FLOORS = {  # crash states checked at least, (sampled, full); see docs/crash-points.md
    ("single", "ordered"): (150, 230),
    ("single", "posix"): (250, 2000),
    ("single", "objects"): (15, 15),
    ("ranks", "ordered"): (150, 220),
    ("ranks", "posix"): (250, 1000),
    ("ranks", "objects"): (12, 12),
    ("incremental", "ordered"): (150, 220),
    ("incremental", "posix"): (250, 950),
    ("incremental", "objects"): (12, 14),
    ("writers", "ordered"): (400, 40000),
    ("writers", "posix"): (400, 400000),
    ("writers", "objects"): (80, 80),
    ("tier", "ordered"): (150, 230),
    ("tier", "posix"): (250, 1400),
    ("tier", "objects"): (18, 18),
}


@pytest.mark.parametrize("model", ["ordered", "posix", "objects"])
@pytest.mark.parametrize("scenario", ["single", "ranks", "incremental", "writers", "tier"])
async def test_every_crash_state_keeps_the_promises(scenario, model, request, tmp_path):
    fixture = {"ranks": "two_ranks", "writers": "two_writers"}.get(scenario, scenario)
    rec = request.getfixturevalue(fixture)
    report = await check(rec, model, tmp_path, EVERYTHING if FULL else SAMPLED)
    assert report.states >= FLOORS[scenario, model][FULL]
    assert report.opened >= 1
    assert not report.violations, (
        f"{len(report.violations)} violations in {report.states} states, e.g.:\n"
        + "\n".join(report.violations[:8])
    )
