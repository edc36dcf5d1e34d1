"""Nothing overwrites a committed byte: every file a save writes has a name only that attempt
can produce, so a rewind, a failed save, a fenced writer or a copy can leave only files no
manifest refers to, and a committed checkpoint stays loadable until retention deletes it."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from _support.roots import manifest_of, step_numbers
from _support.storages import FullDiskStorage
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiockpt import AsyncCheckpointManager, EveryNSteps, LatestN
from aiockpt._core import format as fmt
from aiockpt._core.catalog import Catalog
from aiockpt.errors import (
    CorruptCheckpointError,
    DaemonDiedError,
    LeaseLostError,
    StorageError,
)

pytestmark = pytest.mark.anyio

SCRIPT = str(Path(sys.executable).parent / "aiockpt")
MiB = 1 << 20


def verify(root: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SCRIPT, "verify", root], capture_output=True, text=True, timeout=120)


def state_at(step: int, changed_at: int) -> dict[str, torch.Tensor]:
    """A 1 MiB tensor that changes only at ``changed_at`` (later steps read it from that
    step's file) and a small one that changes every step."""
    big = torch.full((MiB // 4,), float(changed_at if step >= changed_at else 0))
    return {"big": big, "small": torch.full((8,), float(step))}


def expected(step: int, changed_at: int) -> dict[str, torch.Tensor]:
    return state_at(step, changed_at)


def assert_loads(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


async def test_a_rewind_onto_a_retired_step_keeps_the_steps_that_read_from_it(root):
    policy = EveryNSteps(10) | LatestN(1)
    async with AsyncCheckpointManager(root, retention=policy) as mgr:
        for step in range(13):
            await (await mgr.save(step, state_at(step, 3)))
        assert await mgr.steps() == [0, 10, 12]
        assert 3 in step_numbers(root)  # retired: steps 10 and 12 read "big" from it
        # The documented rewind: load an earlier step, train from there, save again.
        await mgr.load(0)
        for step in (1, 2, 3):
            await (await mgr.save(step, state_at(step, 2)))
        for step in (10, 12):
            assert_loads(await mgr.load(step), expected(step, 3))
        assert_loads(await mgr.load(3), expected(3, 2))
    result = verify(root)
    assert result.returncode == 0, result.stdout + result.stderr


async def test_a_failed_save_of_a_retired_step_removes_only_its_own_file(tmp_path, test_storages):
    root = str(tmp_path / "run")
    flag = str(tmp_path / "full")
    policy = EveryNSteps(10) | LatestN(1)
    url = f"fulldisk://{root}"
    async with AsyncCheckpointManager(url, retention=policy, storage_options={"flag": flag}) as mgr:
        for step in range(13):
            await (await mgr.save(step, state_at(step, 3)))
        retired = set(os.listdir(os.path.join(root, fmt.step_dirname(3))))
        await mgr.load(0)
        Path(flag).touch()  # the disk is full when step 3 commits again
        with pytest.raises(StorageError, match="no space left"):
            await (await mgr.save(3, state_at(3, 2)))
        os.unlink(flag)
        assert set(os.listdir(os.path.join(root, fmt.step_dirname(3)))) == retired
        for step in (10, 12):
            assert_loads(await mgr.load(step), expected(step, 3))
    result = verify(root)
    assert result.returncode == 0, result.stdout + result.stderr


def _first_writer(root: str, gate: str, reached: str, done: str) -> None:
    """Writer A: its shard write of step 2 pauses half way until ``gate`` exists."""

    async def main() -> None:
        options = {"gate": gate, "reached": reached}
        async with AsyncCheckpointManager(f"gated://{root}", storage_options=options) as mgr:
            handle = await mgr.save(2, {"w": torch.full((MiB,), 1.0)})
            try:
                await handle
            except LeaseLostError as e:
                Path(done).write_text(f"fenced: {e}")
                return
            Path(done).write_text("committed")

    anyio.run(main)


async def test_a_fenced_writer_finishing_its_write_changes_nothing_committed(
    tmp_path, test_storages
):
    root = str(tmp_path / "run")
    gate, reached, done = (str(tmp_path / n) for n in ("gate", "reached", "done"))
    code = (
        "import sys; sys.path[:0] = sys.argv[1:2]\n"
        "from test_unique_names import _first_writer\n"
        "_first_writer(*sys.argv[2:])\n"
    )
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.path.join(tests, "..")])}
    first = subprocess.Popen(
        [sys.executable, "-c", code, tests, root, gate, reached, done], env=env
    )
    try:
        with anyio.fail_after(60):
            while not os.path.exists(reached):
                await anyio.sleep(0.02)
        # Writer B takes the root over and commits step 2 while A is paused mid-shard.
        async with AsyncCheckpointManager(root, takeover=True) as mgr:
            await (await mgr.save(2, {"w": torch.full((MiB,), 2.0)}))
        Path(gate).touch()  # A resumes and finishes its write
        assert first.wait(60) == 0
        assert Path(done).read_text().startswith("fenced")
        async with AsyncCheckpointManager(root, read_only=True) as mgr:
            assert torch.equal((await mgr.load(2))["w"], torch.full((MiB,), 2.0))
        result = verify(root)
        assert result.returncode == 0, result.stdout + result.stderr
        assert manifest_of(root, 2)["shards"][0]["file"] in os.listdir(
            os.path.join(root, fmt.step_dirname(2))
        )
    finally:
        first.kill()
        first.wait()


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SCRIPT, *args], capture_output=True, text=True, timeout=120)


async def test_copy_into_a_root_a_writer_holds_is_refused(tmp_path):
    src, dest = str(tmp_path / "src"), str(tmp_path / "dest")
    async with AsyncCheckpointManager(src) as mgr:
        await (await mgr.save(3, state_at(3, 3)))
    async with AsyncCheckpointManager(dest) as mgr:
        await (await mgr.save(3, state_at(3, 1)))
        before = {
            n: os.path.getmtime(os.path.join(dest, fmt.step_dirname(3), n))
            for n in os.listdir(os.path.join(dest, fmt.step_dirname(3)))
        }
        copied = cli("copy", src, "3", dest)
        assert copied.returncode == 1, copied.stdout + copied.stderr
        assert "leased by another writer" in copied.stderr
        after = {
            n: os.path.getmtime(os.path.join(dest, fmt.step_dirname(3), n))
            for n in os.listdir(os.path.join(dest, fmt.step_dirname(3)))
        }
        assert after == before
        assert_loads(await mgr.load(3), expected(3, 1))


async def test_copy_beside_a_retired_step_keeps_what_reads_from_it(tmp_path):
    src, dest = str(tmp_path / "src"), str(tmp_path / "dest")
    async with AsyncCheckpointManager(src) as mgr:
        await (await mgr.save(3, state_at(3, 2)))
    async with AsyncCheckpointManager(dest, retention=EveryNSteps(10) | LatestN(1)) as mgr:
        for step in range(13):
            await (await mgr.save(step, state_at(step, 3)))
    assert 3 in step_numbers(dest)  # retired: steps 10 and 12 read from it
    copied = cli("copy", src, "3", dest)
    assert copied.returncode == 0, copied.stderr
    async with AsyncCheckpointManager(dest, read_only=True) as mgr:
        for step in (10, 12):
            assert_loads(await mgr.load(step), expected(step, 3))
        assert_loads(await mgr.load(3), expected(3, 2))
    result = verify(dest)
    assert result.returncode == 0, result.stdout + result.stderr


def test_version_4_names_and_block_sources_are_checked():
    """A version-4 shard is named by its attempt, and may read from another file of its own
    step's directory (a rewound step reading the retired file of the same number), never
    from itself; versions 1-3 keep their plain names and read only from other steps."""
    fixture = Path(__file__).parent / "fixtures" / "format_v3" / "step_000000000004"
    raw = json.loads((fixture / fmt.MANIFEST).read_text())

    def parse(m: dict) -> fmt.Manifest:
        return fmt.parse_manifest(json.dumps(m).encode(), path="m.json", step=4)

    def renamed(m: dict, version: int, name: str) -> dict:
        m = copy.deepcopy(m)
        old = m["shards"][0]["file"]
        m["version"], m["shards"][0]["file"] = version, name
        m["tensors"] = {name: m["tensors"][old]}
        return m

    tagged = fmt.shard_filename(0, fmt.new_tag())
    parse(raw)
    v4 = renamed(raw, fmt.NAMES_VERSION, tagged)
    assert parse(v4).shards[0].file == tagged
    with pytest.raises(CorruptCheckpointError, match="does not match format version"):
        parse(renamed(raw, fmt.NAMES_VERSION, fmt.shard_filename(0)))
    with pytest.raises(CorruptCheckpointError, match="does not match format version"):
        parse(renamed(raw, fmt.REFS_VERSION, tagged))
    sources = {b[2] for b in v4["shards"][0]["blocks"]} - {""}
    assert sources  # the fixture reads from another step
    same_dir = f"{fmt.step_dirname(4)}/{fmt.shard_filename(0, fmt.new_tag())}"
    own = f"{fmt.step_dirname(4)}/{tagged}"
    for source, ok in ((same_dir, True), (own, False)):
        m = copy.deepcopy(v4)
        for b in m["shards"][0]["blocks"]:
            if b[2]:
                b[2] = source
        if ok:
            parse(m)
        else:
            with pytest.raises(CorruptCheckpointError, match="not another shard file"):
                parse(m)
    m = copy.deepcopy(raw)  # version 3: its own step's directory is never a source
    for b in m["shards"][0]["blocks"]:
        if b[2]:
            b[2] = same_dir
    with pytest.raises(CorruptCheckpointError, match="not another shard file"):
        parse(m)


#: One operation of a run: ("save", step, content), ("kill",), or ("full", where, step,
#: content) for a save on a disk that fills up at its write or at its commit.
OPS = st.one_of(
    st.tuples(st.just("save"), st.integers(0, 15), st.integers(0, 3)),
    st.tuples(st.just("kill")),
    st.tuples(
        st.just("full"),
        st.sampled_from(["write_flag", "flag"]),
        st.integers(0, 15),
        st.integers(0, 3),
    ),
)


def content(step: int, variant: int) -> dict[str, torch.Tensor]:
    """A state whose 1 MiB tensor takes one of four values (so later saves refer to earlier
    steps' files) and whose small tensor is the step's own."""
    return {
        "big": torch.full((MiB // 4,), float(variant)),
        "small": torch.full((8,), float(step * 10 + variant)),
    }


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    ops=st.lists(OPS, min_size=4, max_size=14),
    keep=st.integers(1, 3),
    every=st.integers(2, 6),
)
def test_every_kept_checkpoint_loads_whatever_the_run_did(
    tmp_path_factory, test_storages, ops, keep, every
):
    """Random runs of saves (step numbers reused below kept ones: rewinds), retention, disks
    that fill up at a write or a commit, and daemons killed: after every step of the run,
    every checkpoint retention kept loads bit-exact, and `verify` is clean at the end."""
    tmp = tmp_path_factory.mktemp("run")
    root, write_flag, flag = str(tmp / "run"), str(tmp / "full-write"), str(tmp / "full-commit")
    options = {"write_flag": write_flag, "flag": flag}
    saved: dict[int, dict[str, torch.Tensor]] = {}

    async def run() -> None:
        async with AsyncCheckpointManager(
            f"fulldisk://{root}",
            storage_options=options,
            retention=LatestN(keep) | EveryNSteps(every),
        ) as mgr:
            killed = False  # the daemon was killed since the last call reached it

            async def call(fn: Any, *args: Any, **kwargs: Any) -> Any:
                """One call; the first after a kill may hear of the death (and respawns)."""
                nonlocal killed
                try:
                    return await fn(*args, **kwargs)
                except DaemonDiedError:
                    if not killed:
                        raise
                    killed = False
                    return await fn(*args, **kwargs)
                finally:
                    killed = False

            for op in ops:
                if op[0] == "kill":
                    if mgr.daemon_pid is not None:
                        os.kill(mgr.daemon_pid, signal.SIGKILL)
                        killed = True
                    continue
                step, variant = op[-2:]
                full = op[1] if op[0] == "full" else None
                if step in saved:
                    continue  # committed: a save of it is refused (StepExistsError)
                state = content(step, variant)
                if full is not None:
                    Path(options[full]).touch()

                async def save(step: int = step, state: dict = state) -> None:
                    await (await mgr.save(step, state))

                try:
                    await call(save)
                except StorageError:
                    assert full is not None  # the full disk, nothing else
                else:
                    assert full is None
                    saved[step] = state
                finally:
                    for f in (write_flag, flag):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(f)
                kept = await call(mgr.steps)
                assert set(kept) <= set(saved)
                for gone in set(saved) - set(kept):
                    del saved[gone]
                for step in kept:
                    assert_loads(await call(mgr.load, step), saved[step])

    anyio.run(run)
    if saved:
        result = verify(root)
        assert result.returncode == 0, result.stdout + result.stderr


async def test_an_outage_reading_an_earlier_steps_file_is_a_storage_error(tmp_path, test_storages):
    """Step 2 reads its big tensor from step 1's file: a storage failing that read is a
    StorageError, as it is on the step's own file, not a corrupt checkpoint; once the storage
    answers again, the same load works."""
    root, flag = str(tmp_path / "run"), str(tmp_path / "outage")
    options = {"read_flag": flag, "read_match": f"{fmt.step_dirname(1)}/"}
    async with AsyncCheckpointManager(f"fulldisk://{root}", storage_options=options) as mgr:
        await (await mgr.save(1, state_at(1, 1)))
        await (await mgr.save(2, state_at(2, 1)))
        sources = {b[2] for b in manifest_of(root, 2)["shards"][0]["blocks"]} - {""}
        assert sources  # step 2 reads from step 1's file
        Path(flag).touch()
        with pytest.raises(StorageError, match="connection reset") as info:
            await mgr.load(2)
        assert not isinstance(info.value, CorruptCheckpointError)
        os.unlink(flag)
        assert_loads(await mgr.load(2), expected(2, 1))


async def test_verify_raises_an_outage_rather_than_calling_the_step_corrupt(root, tmp_path):
    """The same outage, met by verify: the storage's error is raised; the step is not
    reported corrupt, and once the storage answers verify finds it intact."""
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, state_at(1, 1)))
        await (await mgr.save(2, state_at(2, 1)))
    flag = tmp_path / "outage"
    storage = FullDiskStorage(
        root, None, None, read_flag=str(flag), read_match=f"{fmt.step_dirname(1)}/"
    )
    catalog = Catalog(storage)
    m = catalog.read_manifest(2)
    (shard,) = m.shards
    flag.touch()
    with pytest.raises(StorageError, match="connection reset") as info:
        catalog.verify_shard(2, shard, m.tensors[shard.file])
    assert not isinstance(info.value, CorruptCheckpointError)
    flag.unlink()
    assert catalog.verify_shard(2, shard, m.tensors[shard.file]) == []


async def test_a_create_refused_because_the_name_is_taken_removes_nothing(tmp_path, test_storages):
    """A save whose exclusive create is refused (EEXIST: another attempt's file is at that
    name) fails without removing that file, which is not its own."""
    root, flag = str(tmp_path / "run"), tmp_path / "taken"
    url = f"fulldisk://{root}"
    async with AsyncCheckpointManager(url, storage_options={"taken_flag": str(flag)}) as mgr:
        await (await mgr.save(1, state_at(1, 1)))
        flag.touch()
        with pytest.raises(StorageError, match="refused"):
            await (await mgr.save(2, state_at(2, 1)))
        flag.unlink()
        (other,) = os.listdir(os.path.join(root, fmt.step_dirname(2)))
        assert Path(root, fmt.step_dirname(2), other).read_bytes() == b"another attempt's bytes"
        assert await mgr.steps() == [1]
