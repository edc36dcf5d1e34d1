from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from _support.daemon import daemon_in_process
from _support.roots import make_partial
from hypothesis import given, settings
from hypothesis import strategies as st

from aiockpt import AsyncCheckpointManager
from aiockpt._core import format as fmt
from aiockpt._core.identity import KEY_FILE, ROOT_FILE
from aiockpt._core.lease import LEASE_DIR
from aiockpt._core.protocol import LoadAsk, LoadReq, RecordsReq, StepsReq
from aiockpt.errors import CheckpointError, CheckpointNotFoundError, StorageError
from aiockpt.retention import (
    AnyOf,
    BestN,
    CheckpointRecord,
    EveryNSeconds,
    EveryNSteps,
    LatestN,
    RetentionPolicy,
    best_order,
    collectable_partials,
    select_deletions,
)
from aiockpt.storage import LocalStorage

TESTS_DIR = str(Path(__file__).resolve().parent)


def recs(*steps: int, metrics: dict[int, dict] | None = None) -> list[CheckpointRecord]:
    """Records with commit time = step (so step order and commit order agree)."""
    metrics = metrics or {}
    return [CheckpointRecord(s, float(s), metrics.get(s, {})) for s in steps]


def kept(policy: RetentionPolicy, records: Sequence[CheckpointRecord]) -> list[int]:
    return [r.step for r, k in zip(records, policy.keep(records), strict=True) if k]


# --------------------------------------------------------------------------- user policies
# Module level, so the daemon can unpickle them: it imports this module (tests/ on its path).


@dataclass(frozen=True)
class KeepEven:
    """A user-defined policy that does not inherit from anything in aiockpt."""

    def keep(self, checkpoints: Sequence[CheckpointRecord]) -> list[bool]:
        return [c.step % 2 == 0 for c in checkpoints]


@dataclass(frozen=True)
class KeepNothing:
    def keep(self, checkpoints: Sequence[CheckpointRecord]) -> list[bool]:
        return [False] * len(checkpoints)


@dataclass(frozen=True)
class Broken:
    def keep(self, checkpoints: Sequence[CheckpointRecord]) -> list[bool]:
        raise RuntimeError("policy bug")


@dataclass(frozen=True)
class WrongAnswer:
    def keep(self, checkpoints: Sequence[CheckpointRecord]) -> list[bool]:
        return ["no"] * len(checkpoints)  # type: ignore[list-item]


# --------------------------------------------------------------------------- policies


def test_latest_n_keeps_the_highest_steps_in_any_order():
    assert kept(LatestN(2), recs(1, 2, 3, 4)) == [3, 4]
    assert kept(LatestN(10), recs(1, 2, 3)) == [1, 2, 3]
    shuffled = recs(4, 1, 3, 2)
    assert kept(LatestN(2), shuffled) == [4, 3]
    assert LatestN(1).keep([]) == []


def test_every_n_steps_keeps_multiples():
    assert kept(EveryNSteps(10), recs(0, 5, 10, 15, 20, 25)) == [0, 10, 20]
    assert kept(EveryNSteps(1), recs(3, 7)) == [3, 7]


def test_every_n_seconds_keeps_the_first_of_each_window_and_is_stable():
    records = [
        CheckpointRecord(1, 1000.0),
        CheckpointRecord(2, 1005.0),
        CheckpointRecord(3, 1010.0),  # a new 10 s window starts at 1010
        CheckpointRecord(4, 1012.0),
        CheckpointRecord(5, 1035.0),
    ]
    policy = EveryNSeconds(10)
    assert kept(policy, records) == [1, 3, 5]
    # What is kept stays kept when the others go: windows are anchored at the epoch.
    survivors = [r for r in records if r.step in (1, 3, 5)]
    assert kept(policy, survivors) == [1, 3, 5]
    # Within a window the earliest commit wins, whatever the step order.
    assert kept(policy, [CheckpointRecord(8, 2003.0), CheckpointRecord(9, 2001.0)]) == [9]


def test_best_n_ranks_by_metric_and_ignores_checkpoints_without_it():
    records = recs(
        1,
        2,
        3,
        4,
        5,
        6,
        metrics={
            1: {"loss": 0.5},
            2: {"loss": 0.2},
            3: {"acc": 0.9},  # no loss: never among the best by loss
            4: {"loss": 0.3},
            5: {"loss": "nan"},  # non-finite metrics are stored as strings: not counted
            6: {"loss": True},  # a bool is not a number here
        },
    )
    assert kept(BestN(2, "loss"), records) == [2, 4]
    assert kept(BestN(1, "loss", mode="max"), records) == [1]
    assert kept(BestN(5, "loss"), records) == [1, 2, 4]
    assert kept(BestN(1, "acc", "max"), records) == [3]
    assert kept(BestN(1, "missing"), records) == []


def test_best_order_breaks_ties_towards_the_newer_step():
    records = recs(1, 2, 3, metrics={1: {"loss": 1.0}, 2: {"loss": 1.0}, 3: {"loss": 2.0}})
    assert [records[i].step for i in best_order(records, "loss", "min")] == [2, 1, 3]
    assert kept(BestN(1, "loss"), records) == [2]
    with pytest.raises(ValueError, match="'min' or 'max'"):
        best_order(records, "loss", "median")


def test_or_combines_into_one_flat_any_of():
    a, b, c = LatestN(2), EveryNSteps(10), BestN(1, "loss")
    combined = a | b | c
    assert combined == AnyOf(a, b, c)
    assert (a | (b | c)).policies == (a, b, c)
    records = recs(*range(1, 26))
    assert kept(a | b, records) == [10, 20, 24, 25]


def test_user_defined_policies_combine_on_either_side():
    records = recs(1, 2, 3, 5, 7, 9)
    assert isinstance(KeepEven(), RetentionPolicy)
    assert kept(KeepEven() | LatestN(1), records) == [2, 9]
    assert kept(LatestN(1) | KeepEven(), records) == [2, 9]
    assert kept(AnyOf(KeepEven(), KeepNothing()), records) == [2]
    with pytest.raises(TypeError):
        _ = KeepEven() | KeepNothing()  # neither side knows `|`; AnyOf(...) combines them


def test_policies_pickle_by_value():
    policy = LatestN(3) | EveryNSteps(1000) | BestN(2, "loss", "max") | EveryNSeconds(3600.0)
    assert pickle.loads(pickle.dumps(policy)) == policy


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: LatestN(0), "positive int"),
        (lambda: LatestN(-3), "positive int"),
        (lambda: LatestN(True), "positive int"),
        (lambda: LatestN(2.0), "positive int"),
        (lambda: LatestN("3"), "positive int"),
        (lambda: EveryNSteps(0), "positive int"),
        (lambda: EveryNSeconds(0), "positive number"),
        (lambda: EveryNSeconds(-1.5), "positive number"),
        (lambda: EveryNSeconds(float("nan")), "positive number"),
        (lambda: EveryNSeconds(float("inf")), "positive number"),
        (lambda: EveryNSeconds(True), "positive number"),
        (lambda: EveryNSeconds("60"), "positive number"),
        (lambda: BestN(0, "loss"), "positive int"),
        (lambda: BestN(2, ""), "non-empty str"),
        (lambda: BestN(2, None), "non-empty str"),
        (lambda: BestN(2, "loss", "median"), "'min' or 'max'"),
        (lambda: AnyOf(), "at least one policy"),
    ],
)
def test_bad_arguments_are_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_non_policies_are_refused():
    with pytest.raises(TypeError, match="not a retention policy"):
        AnyOf(LatestN(1), 3)
    with pytest.raises(TypeError):
        _ = LatestN(1) | "latest"


def test_select_deletions_never_deletes_the_newest_or_protected():
    records = recs(1, 2, 3, 4)
    assert select_deletions(None, records) == []
    assert select_deletions(LatestN(1), []) == []
    assert select_deletions(KeepNothing(), records) == [1, 2, 3]
    assert select_deletions(KeepNothing(), records, protected={2}) == [1, 3]
    assert select_deletions(LatestN(2), list(reversed(records))) == [1, 2]


def test_select_deletions_keeps_the_latest_commit_of_a_resumed_run():
    # A run resumed from step 50 after an earlier run reached 100: the checkpoint just
    # committed (51) is not the highest step, and must survive LatestN(1) all the same.
    records = [CheckpointRecord(100, 1000.0), CheckpointRecord(50, 900.0)]
    records.append(CheckpointRecord(51, 2000.0))
    assert select_deletions(LatestN(1), records) == [50]


def test_select_deletions_refuses_bad_policy_answers_and_records():
    records = recs(1, 2, 3)
    with pytest.raises(ValueError, match="must return a list of 3 bools"):
        select_deletions(WrongAnswer(), records)

    @dataclass(frozen=True)
    class TooShort:
        def keep(self, checkpoints):
            return [True]

    with pytest.raises(ValueError, match="must return a list of 3 bools"):
        select_deletions(TooShort(), records)
    with pytest.raises(ValueError, match="must return"):
        select_deletions(AnyOf(LatestN(1), TooShort()), records)
    with pytest.raises(ValueError, match="distinct steps"):
        select_deletions(LatestN(1), [*records, CheckpointRecord(3, 9.0)])
    with pytest.raises(TypeError, match="CheckpointRecord"):
        select_deletions(LatestN(1), [(1, 1.0, {})])  # type: ignore[list-item]


POLICIES = st.one_of(
    st.builds(LatestN, st.integers(1, 5)),
    st.builds(EveryNSteps, st.integers(1, 7)),
    st.builds(EveryNSeconds, st.floats(0.5, 50.0)),
    st.builds(BestN, st.integers(1, 4), st.just("loss"), st.sampled_from(["min", "max"])),
)


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(st.integers(0, 200), min_size=1, max_size=25, unique=True),
    losses=st.lists(st.floats(-10, 10) | st.none(), min_size=25, max_size=25),
    parts=st.lists(POLICIES, min_size=1, max_size=4),
    protected=st.sets(st.integers(0, 200), max_size=3),
)
def test_combined_policy_properties(steps, losses, parts, protected):
    records = [
        CheckpointRecord(s, float(s) * 3.7, {} if loss is None else {"loss": loss})
        for s, loss in zip(steps, losses, strict=False)
    ]
    ordered = sorted(records, key=lambda r: r.step)
    policy = AnyOf(*parts)
    # Kept by the union exactly when some part keeps it.
    each = [p.keep(ordered) for p in parts]
    assert policy.keep(ordered) == [any(flags) for flags in zip(*each, strict=True)]
    doomed = select_deletions(policy, records, protected)
    assert doomed == sorted(doomed)
    assert max(steps) not in doomed
    assert not set(doomed) & protected
    assert all(
        not any(flags)
        for flags, r in zip(zip(*each, strict=True), ordered, strict=True)
        if r.step in doomed
    )
    assert len(set(steps) - set(doomed)) >= 1


def test_collectable_partials_spares_what_may_be_in_flight():
    # step -> has a manifest
    dirs = {1: True, 2: False, 3: True, 4: False, 5: False}
    assert collectable_partials(dirs) == [2]  # 4 and 5 are above the newest commit (3)
    assert collectable_partials(dirs, busy={2}) == []
    assert collectable_partials(dirs, everything=True) == [2, 4, 5]
    assert collectable_partials(dirs, busy={4}, everything=True) == [2, 5]
    assert collectable_partials({7: False}) == []  # nothing committed: nothing provably dead
    assert collectable_partials({}) == []


# --------------------------------------------------------------------------- with the daemon


def state(step: int) -> dict:
    return {"w": torch.full((4,), float(step)), "step": step}


def step_dirs(root: str) -> list[str]:
    """What the root holds besides the lease of its writer and its identity."""
    return sorted(n for n in os.listdir(root) if n not in (LEASE_DIR, KEY_FILE, ROOT_FILE))


def dirnames(*steps: int) -> list[str]:
    return [fmt.step_dirname(s) for s in steps]


@pytest.mark.anyio
async def test_latest_2_or_every_10_over_25_saves(root):
    policy = LatestN(2) | EveryNSteps(10)
    async with AsyncCheckpointManager(root, retention=policy) as mgr:
        for step in range(1, 26):
            handle = await mgr.save(step, state(step))
            info = await handle
            assert info.step == step
            # The handle resolves after this commit's retention pass: steps() is exact now.
            expected = {s for s in range(1, step + 1) if s % 10 == 0} | {step - 1, step}
            assert await mgr.steps() == sorted(s for s in expected if s >= 1)
        assert await mgr.steps() == [10, 20, 24, 25]
        assert await mgr.latest_step() == 25
    assert step_dirs(root) == dirnames(10, 20, 24, 25)


@pytest.mark.anyio
async def test_wait_resolves_after_retention(root):
    async with AsyncCheckpointManager(root, retention=LatestN(2), max_pending=2) as mgr:
        for step in range(1, 8):
            await mgr.save(step, state(step))  # not awaiting the handles
        await mgr.wait()
        assert await mgr.steps() == [6, 7]


@pytest.mark.anyio
async def test_deletion_comes_only_after_the_displacing_commit(root):
    events = []
    async with AsyncCheckpointManager(
        root, retention=LatestN(1), event_handlers=[events.append]
    ) as mgr:
        for step in range(1, 6):
            await (await mgr.save(step, state(step)))
    deletes = [(i, e) for i, e in enumerate(events) if e.name == "retention.delete"]
    assert sorted(e.step for _, e in deletes) == [1, 2, 3, 4]
    for i, delete in deletes:
        # The deletion belongs to the save that displaced it, and follows that save's commit.
        committed = [
            j
            for j, e in enumerate(events[:i])
            if e.name == "save.committed" and e.uuid == delete.uuid
        ]
        assert committed, f"step {delete.step} was deleted before its successor committed"
        assert events[committed[0]].step == delete.step + 1
    assert step_dirs(root) == dirnames(5)


@pytest.mark.anyio
@pytest.mark.parametrize("full_at", ["write_flag", "flag"])
async def test_a_save_that_fails_in_the_daemon_deletes_nothing(tmp_path, test_storages, full_at):
    root = str(tmp_path / "run")
    flag = str(tmp_path / "full")
    url = f"fulldisk://{root}"
    async with AsyncCheckpointManager(
        url, retention=LatestN(1), storage_options={full_at: flag}
    ) as mgr:
        await (await mgr.save(1, state(1)))
        # The disk fills up: the shard write (or, after the shard is written, the commit)
        # fails inside the daemon.
        with open(flag, "w"):
            pass
        handle = await mgr.save(2, state(2))
        with pytest.raises(StorageError, match="no space left"):
            await handle
        os.unlink(flag)
        assert await mgr.steps() == [1]
        assert step_dirs(root) == dirnames(1)  # the failed save's directory is cleaned up
        loaded = await mgr.load(1)
        assert torch.equal(loaded["w"], state(1)["w"])
        await (await mgr.save(3, state(3)))
        assert await mgr.steps() == [3]


@pytest.mark.anyio
async def test_newest_is_kept_whatever_the_policy_says(root, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", TESTS_DIR)
    async with AsyncCheckpointManager(root, retention=KeepNothing()) as mgr:
        for step in (1, 2, 3):
            await (await mgr.save(step, state(step)))
            assert await mgr.steps() == [step]


@pytest.mark.anyio
async def test_user_defined_policy_runs_in_the_daemon(root, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", TESTS_DIR)
    async with AsyncCheckpointManager(root, retention=KeepEven() | LatestN(1)) as mgr:
        for step in range(1, 8):
            await (await mgr.save(step, state(step)))
        assert await mgr.steps() == [2, 4, 6, 7]


@pytest.mark.anyio
@pytest.mark.parametrize("policy", [Broken(), WrongAnswer()])
async def test_a_failing_policy_deletes_nothing_and_says_so(root, monkeypatch, policy):
    monkeypatch.setenv("PYTHONPATH", TESTS_DIR)
    async with AsyncCheckpointManager(root, retention=policy) as mgr:
        for step in (1, 2):
            handle = await mgr.save(step, state(step))
            # The commit stands; the error says so.
            with pytest.raises(CheckpointError, match=f"step {step} was committed.*nothing was"):
                await handle
        assert await mgr.steps() == [1, 2]
        assert (await mgr.load(1))["step"] == 1


@pytest.mark.anyio
async def test_retention_sees_checkpoints_of_an_earlier_run(root):
    async with AsyncCheckpointManager(root) as mgr:  # no policy: keep everything
        for step in range(1, 6):
            await (await mgr.save(step, state(step), metrics={"loss": 10.0 - step}))
        assert await mgr.steps() == [1, 2, 3, 4, 5]
    async with AsyncCheckpointManager(root, retention=LatestN(2) | BestN(1, "loss")) as mgr:
        await (await mgr.save(6, state(6), metrics={"loss": 9.5}))
        # 5 is both among the latest two and the best of the earlier run.
        assert await mgr.steps() == [5, 6]
        await (await mgr.save(7, state(7), metrics={"loss": 8.0}))
        assert await mgr.steps() == [5, 6, 7]


@pytest.mark.anyio
async def test_a_step_pruned_behind_the_daemons_back_does_not_count(root):
    async with AsyncCheckpointManager(root, retention=LatestN(3)) as mgr:
        for step in (1, 2, 3):
            await (await mgr.save(step, state(step)))
        # Someone (aiockpt prune) removes step 3 while the run goes on.
        os.unlink(os.path.join(root, fmt.step_dirname(3), fmt.MANIFEST))
        LocalStorage(root).delete(fmt.step_dirname(3), recursive=True)
        await (await mgr.save(4, state(4)))
        assert await mgr.steps() == [1, 2, 4]  # the vanished 3 took no place among the 3 latest


@pytest.mark.anyio
async def test_best_step_and_load_it(root):
    losses = {1: 0.9, 2: 0.4, 3: 0.7, 4: 0.1, 5: 0.3, 6: float("nan")}
    async with AsyncCheckpointManager(root, retention=BestN(2, "loss") | LatestN(1)) as mgr:
        assert await mgr.best_step("loss") is None
        for step, loss in losses.items():
            await (await mgr.save(step, state(step), metrics={"loss": loss, "acc": step / 10}))
        assert await mgr.steps() == [4, 5, 6]
        best = await mgr.best_step("loss")
        assert best == 4
        assert await mgr.best_step("loss", mode="max") == 5  # nan never counts as best
        assert await mgr.best_step("acc", "max") == 6
        assert await mgr.best_step("unknown") is None
        loaded = await mgr.load(best)
        assert loaded["step"] == 4
        assert torch.equal(loaded["w"], state(4)["w"])
        with pytest.raises(ValueError, match="'min' or 'max'"):
            await mgr.best_step("loss", mode="lowest")
        with pytest.raises(ValueError, match="non-empty str"):
            await mgr.best_step("")


@pytest.mark.anyio
async def test_latest_step_stays_newest_under_a_best_policy(root):
    async with AsyncCheckpointManager(root, retention=BestN(1, "loss")) as mgr:
        for step, loss in [(1, 0.1), (2, 0.5), (3, 0.9)]:  # getting worse
            await (await mgr.save(step, state(step), metrics={"loss": loss}))
            assert await mgr.latest_step() == step
        assert await mgr.steps() == [1, 3]
        assert (await mgr.load())["step"] == 3


def test_a_policy_from_main_is_refused_at_construction(monkeypatch):
    @dataclass(frozen=True)
    class MainPolicy:
        def keep(self, checkpoints):
            return [True] * len(checkpoints)

    # What a class defined in the user's script looks like to pickle.
    MainPolicy.__module__ = "__main__"
    MainPolicy.__qualname__ = "MainPolicy"
    monkeypatch.setattr(sys.modules["__main__"], "MainPolicy", MainPolicy, raising=False)
    with pytest.raises(TypeError, match="defined in __main__"):
        AsyncCheckpointManager("unused", retention=MainPolicy())
    with pytest.raises(TypeError, match="defined in __main__"):
        AsyncCheckpointManager("unused", retention=LatestN(2) | MainPolicy())


@pytest.mark.parametrize("bad", [3, "latest", lambda cps: [True] * len(cps)])
def test_not_a_policy_is_refused_at_construction(bad):
    with pytest.raises(TypeError, match="retention must be a policy"):
        AsyncCheckpointManager("unused", retention=bad)


def test_a_policy_class_instead_of_an_instance_is_refused_at_construction():
    with pytest.raises(TypeError, match="retention must be a policy"):
        AsyncCheckpointManager("unused", retention=LatestN)


def test_an_unpicklable_policy_is_refused_at_construction():
    @dataclass(frozen=True)
    class Local:  # defined in a function: pickle cannot find it by name
        def keep(self, checkpoints):
            return [True] * len(checkpoints)

    with pytest.raises(TypeError, match="cannot be sent to the daemon"):
        AsyncCheckpointManager("unused", retention=Local())


# --------------------------------------------------------------------------- partials


@pytest.mark.anyio
async def test_partials_are_never_listed_or_loaded(root):
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, state(1)))
        make_partial(root, 2)
        assert await mgr.steps() == [1]
        assert await mgr.latest_step() == 1
        assert (await mgr.load())["step"] == 1
        with pytest.raises(CheckpointNotFoundError, match="step 2 is not a committed"):
            await mgr.load(2)


@pytest.mark.anyio
async def test_start_up_collects_dead_partials_and_spares_newer_ones(root):
    async with AsyncCheckpointManager(root) as mgr:
        for step in (1, 3):
            await (await mgr.save(step, state(step)))
    make_partial(root, 2)  # below the newest commit: dead
    make_partial(root, 5)  # above it: a previous trainer's daemon may still be writing it
    async with AsyncCheckpointManager(root) as mgr:
        assert step_dirs(root) == dirnames(1, 3, 5)
        assert await mgr.steps() == [1, 3]
        await (await mgr.save(6, state(6)))
    async with AsyncCheckpointManager(root) as mgr:  # 6 committed: 5 is dead now
        assert step_dirs(root) == dirnames(1, 3, 6)


@pytest.mark.anyio
async def test_a_save_overwrites_a_stale_partial_of_its_step(root):
    make_partial(root, 4)
    async with AsyncCheckpointManager(root) as mgr:
        assert step_dirs(root) == dirnames(4)  # nothing committed: nothing provably dead
        await (await mgr.save(4, state(4)))
        assert await mgr.steps() == [4]
        loaded = await mgr.load(4)
        assert torch.equal(loaded["w"], state(4)["w"])


# --------------------------------------------------------------------------- interrupted deletion


class DeletionInterrupted(LocalStorage):
    """A real local root whose recursive deletes fail, as if the process died mid-deletion."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.calls: list[tuple[str, bool]] = []

    def delete(self, path: str, *, recursive: bool = False) -> None:
        self.calls.append((path, recursive))
        if recursive:
            raise StorageError(f"delete {path} interrupted")
        super().delete(path, recursive=recursive)


@pytest.mark.anyio
async def test_an_interrupted_deletion_is_never_listed_or_loaded(root):
    async with AsyncCheckpointManager(root) as mgr:
        for step in (1, 2):
            await (await mgr.save(step, state(step)))

    # The daemon's retention pass, in this process, over a storage that fails mid-deletion.
    storage = DeletionInterrupted(root)
    with daemon_in_process(root, LatestN(1), storage) as daemon:
        daemon.pruner.scan_index()
        deleted, error = daemon.pruner.apply("uuid", 2)
        assert isinstance(error, CheckpointError)
        assert "retention failed to delete" in str(error)
        assert storage.calls[0] == (f"{fmt.step_dirname(1)}/{fmt.MANIFEST}", False)  # first
        assert deleted == [1]
        (left,) = os.listdir(os.path.join(root, fmt.step_dirname(1)))
        assert fmt.parse_shard_filename(left) is not None
        assert daemon.handle(StepsReq(0)) == (2,)
        assert [r.step for r in daemon.handle(RecordsReq(0))] == [2]
        with pytest.raises(CheckpointNotFoundError, match="step 1 is not a committed"):
            daemon.handle(LoadReq(0, LoadAsk(1, 0, 1)))

    async with AsyncCheckpointManager(root) as mgr:
        # Start-up collected the half-deleted step (it lies below the newest commit).
        assert step_dirs(root) == dirnames(2)
        assert await mgr.steps() == [2]
        with pytest.raises(CheckpointNotFoundError):
            await mgr.load(1)


class ReadCounting(LocalStorage):
    """The local storage, noting which files are read."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.read: list[str] = []

    def read_range(self, path: str, start: int, end: int) -> bytes:
        self.read.append(path)
        return super().read_range(path, start, end)


@pytest.mark.anyio
async def test_start_up_reads_no_manifest_and_retention_reads_each_once(root):
    """Opening a manager must not cost a read per earlier checkpoint (at 20k tensors a
    manifest is megabytes, and a run can have hundreds): retention reads them when it
    first runs, once."""
    async with AsyncCheckpointManager(root) as mgr:
        for step in (1, 2, 3):
            await (await mgr.save(step, state(step), metrics={"loss": float(step)}))
    storage = ReadCounting(root)
    with daemon_in_process(root, LatestN(2), storage) as daemon:
        daemon.start()
        assert storage.read == [ROOT_FILE]  # the root's id, and no manifest
        for _ in range(2):
            deleted, error = daemon.pruner.apply("uuid", 3)
            assert error is None
        assert deleted == []
        manifests = [f"{fmt.step_dirname(s)}/{fmt.MANIFEST}" for s in (1, 2, 3)]
        assert sorted(storage.read) == [ROOT_FILE, *manifests]
        assert daemon.handle(StepsReq(0)) == (2, 3)


@pytest.mark.anyio
async def test_retention_counts_a_checkpoint_whose_tensor_entries_are_damaged(root):
    """Retention needs a manifest's step, time and metrics; damage elsewhere in it makes the
    checkpoint fail to load, but must not hide it from retention forever."""
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, state(1)))
    path = os.path.join(root, fmt.step_dirname(1), fmt.MANIFEST)
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(text.replace('"dtype":"F32"', '"dtype":"F33"'))
    async with AsyncCheckpointManager(root, retention=LatestN(1)) as mgr:
        with pytest.raises(CheckpointError, match="unknown dtype"):
            await mgr.load(1)
        await (await mgr.save(2, state(2)))
        assert await mgr.steps() == [2]
