"""One writer per root: the lease a manager takes at open, its takeover, and the fencing of a
writer whose lease is gone (it commits and deletes nothing more)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest
import torch
from _support.ranks import TESTS, run_ranks

from aiockpt import AsyncCheckpointManager, CheckpointManager, LatestN
from aiockpt._core.catalog import Catalog
from aiockpt._core.identity import KEY_FILE, ROOT_FILE
from aiockpt._core.lease import LEASE_DIR, LeaseRecord, lease_path, read_current
from aiockpt.cli import main as cli_main
from aiockpt.errors import DaemonDiedError, LeaseLostError, ReadOnlyError, RootLockedError
from aiockpt.storage import open_storage

#: What a root holds beside its steps and lease from its first writable open on: its id.
IDENTITY = [KEY_FILE, ROOT_FILE]

pytestmark = pytest.mark.anyio

#: A TTL short enough to wait out in a test, long enough for a renewal on a busy machine.
TTL = 3.0


def state(v: float) -> dict:
    return {"w": torch.full((4,), v)}


def current(root: str):
    return read_current(open_storage(root))


class Writer:
    """A manager in another process (tests/_lease_worker.py), driven line by line."""

    def __init__(self, root: str, ttl: float = TTL, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(TESTS / "_lease_worker.py"), root, str(ttl)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=None if env is None else {**os.environ, **env},
        )
        self.ready = self.read()
        assert self.ready.get("ready"), self.ready

    def read(self) -> dict:
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        assert line, f"the writer exited with {self.proc.wait()}"
        return json.loads(line)

    def ask(self, cmd: str) -> dict:
        self.proc.stdin.write(cmd + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self.read()

    def signal(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)  # the trainer and its daemon

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.ask("close")
                self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.proc.stdin.close()  # type: ignore[union-attr]
            self.proc.stdout.close()  # type: ignore[union-attr]


async def test_a_second_writer_is_refused_naming_the_first(tmp_path):
    root = str(tmp_path / "run")
    async with AsyncCheckpointManager(root) as first:
        await (await first.save(1, state(1)))
        with anyio.fail_after(30), pytest.raises(RootLockedError) as info:
            async with AsyncCheckpointManager(root):
                pass
        # The training process is named (alive, on this host: refused), and its daemon.
        assert f"pid {os.getpid()}" in str(info.value)
        assert f"daemon pid {first.daemon_pid}" in str(info.value)
        assert "takeover=True" in str(info.value)
        assert info.value.holder is not None
        assert info.value.holder["generation"] == 1
        assert info.value.holder["trainer_pid"] == os.getpid()
        await (await first.save(2, state(2)))  # the refusal changed nothing for the holder
        assert await first.steps() == [1, 2]
    # Closed: the lease is released, and the next writer takes the root at once.
    assert current(root).record.released
    async with AsyncCheckpointManager(root) as again:
        assert await again.steps() == [1, 2]
    assert current(root).generation == 2


async def test_a_takeover_fences_the_first_writer_off(tmp_path):
    root = str(tmp_path / "run")
    events: list = []
    async with AsyncCheckpointManager(root, retention=LatestN(1)) as first:
        await (await first.save(1, state(1)))
        async with AsyncCheckpointManager(
            root, takeover=True, event_handlers=[events.append]
        ) as second:
            taken = [e for e in events if e.name == "lease.takeover"]
            assert len(taken) == 1
            assert "forced takeover" in taken[0].detail
            assert taken[0].generation == 2
            # Both save step 5 at once: only the new holder's commit lands.
            async with anyio.create_task_group() as tg:
                outcomes: dict[str, object] = {}

                async def save(name: str, mgr: AsyncCheckpointManager, v: float) -> None:
                    try:
                        outcomes[name] = await (await mgr.save(5, state(v)))
                    except LeaseLostError as e:
                        outcomes[name] = e

                tg.start_soon(save, "first", first, 1.0)
                tg.start_soon(save, "second", second, 2.0)
            assert isinstance(outcomes["first"], LeaseLostError)
            assert "another writer took the root over" in str(outcomes["first"])
            assert outcomes["second"].step == 5  # type: ignore[attr-defined]
            # The first writer's retention (LatestN(1)) deletes nothing of the second's.
            with pytest.raises(LeaseLostError):
                await (await first.save(6, state(6)))
            assert await second.steps() == [1, 5]
            assert torch.equal((await second.load(5))["w"], state(2)["w"])
            assert not os.path.exists(os.path.join(root, "step_000000000006", "manifest.json"))


def test_a_paused_writer_resumed_after_a_takeover_commits_and_deletes_nothing(tmp_path):
    root = str(tmp_path / "run")
    first = Writer(root)
    try:
        assert first.ask("save 1") == {"saved": 1}
        first.signal(signal.SIGSTOP)  # a frozen VM, a stopped job: its lease runs out
        time.sleep(TTL + 0.5)

        async def second_writer() -> list:
            events: list = []
            async with AsyncCheckpointManager(root, event_handlers=[events.append]) as mgr:
                await (await mgr.save(10, state(10)))
            return events

        events = anyio.run(second_writer)  # no takeover needed: the lease expired
        taken = [e for e in events if e.name == "lease.takeover"]
        assert len(taken) == 1
        assert "expired lease" in taken[0].detail
        first.signal(signal.SIGCONT)
        answer = first.ask("save 11")
        assert answer["error"] == "LeaseLostError", answer
        assert sorted(os.listdir(root)) == [
            LEASE_DIR,
            *IDENTITY,
            "step_000000000001",
            "step_000000000010",
        ]
        assert os.listdir(os.path.join(root, "step_000000000001")) != []
    finally:
        first.signal(signal.SIGCONT)
        first.close()


def test_a_killed_writers_root_is_free_after_its_ttl(tmp_path):
    """On another host nothing proves the writer dead: its root is free once its TTL ran out.
    (On the same host it is free at once: see test_restart.py.)"""
    root = str(tmp_path / "run")
    ttl = 4 * TTL  # the refused open below must come before it expires, on a busy machine too
    first = Writer(root, ttl, env={"AIOCKPT_HOST_ID": "another-host"})
    assert first.ask("save 1") == {"saved": 1}
    first.signal(signal.SIGKILL)
    killed = time.monotonic()
    first.proc.wait(30)
    first.close()

    async def open_root() -> list[int]:
        async with AsyncCheckpointManager(root) as mgr:
            return await mgr.steps()

    with pytest.raises(RootLockedError, match="is leased by another writer"):
        anyio.run(open_root)
    time.sleep(max(0.0, killed + ttl + 0.5 - time.monotonic()))
    assert anyio.run(open_root) == [1]


async def test_a_second_writer_in_the_holders_own_process_is_told_so(tmp_path):
    root = str(tmp_path / "run")
    async with AsyncCheckpointManager(root) as first:
        await (await first.save(1, state(1)))
        with anyio.fail_after(60), pytest.raises(RootLockedError) as info:
            async with AsyncCheckpointManager(root):
                pass
        message = str(info.value)
        assert f"{root} is leased by this process (pid {os.getpid()}" in message
        assert "another writer" not in message
        assert "a manager opened on it earlier in this process is still open" in message
        assert "takeover=True" in message
        assert "read_only=True" in message
        assert info.value.holder["pid"] == os.getpid()
        await (await first.save(2, state(2)))  # the holder is untouched
    async with AsyncCheckpointManager(root) as second:  # closed: the root is free
        assert await second.steps() == [1, 2]


async def test_a_respawned_daemon_keeps_its_managers_lease(tmp_path):
    root = str(tmp_path / "run")
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, state(1)))
        held = current(root).record
        os.kill(mgr.daemon_pid, signal.SIGKILL)  # type: ignore[arg-type]
        with anyio.fail_after(60):
            while True:  # a save sent before the death was seen fails; the next gets a daemon
                try:
                    await (await mgr.save(2, state(2)))  # a new daemon, the same lease
                    break
                except DaemonDiedError:
                    continue
        after = current(root).record
        assert (after.generation, after.owner) == (held.generation, held.owner)
        assert after.pid != held.pid
        assert after.expires >= held.expires
        assert await mgr.steps() == [1, 2]


def write_lease(root: str, data: bytes, generation: int = 1) -> None:
    path = Path(root, lease_path(generation))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"\x00garbage{", "not JSON"),
        (b"[" * 70_000, "too large for a lease"),
        (
            LeaseRecord("x", "h", 1, time.time(), time.time() + 30 * 365 * 86400, 1, 30.0).encode(),
            "beyond what any writer sets",
        ),
        (json.dumps({"owner": "x", "host": "h", "pid": 1}).encode(), "bad times"),
        (
            json.dumps(
                {
                    **json.loads(
                        LeaseRecord("x", "h", 1, time.time(), time.time() + 9, 1, 9.0).encode()
                    ),
                    "trainer_pid": "1",
                }
            ).encode(),
            "bad process ids",
        ),
        (
            json.dumps(
                {
                    **json.loads(
                        LeaseRecord("x", "h", 1, time.time(), time.time() + 9, 1, 9.0).encode()
                    ),
                    "job": {"deep": [1]},
                }
            ).encode(),
            "bad job",
        ),
    ],
    ids=["garbage", "huge", "decades ahead", "fields missing", "bad trainer pid", "bad job"],
)
async def test_a_hostile_lease_file_is_refused_clearly_and_taken_over_on_request(
    tmp_path, data, why
):
    root = str(tmp_path / "run")
    write_lease(root, data)
    with anyio.fail_after(30):
        with pytest.raises(RootLockedError, match=why) as info:
            async with AsyncCheckpointManager(root):
                pass
        assert "takeover=True" in str(info.value)
        async with AsyncCheckpointManager(root, takeover=True) as mgr:
            await (await mgr.save(1, state(1)))
    assert current(root).generation == 2


async def test_a_read_only_manager_needs_no_lease_and_changes_nothing(tmp_path):
    root = str(tmp_path / "run")
    async with AsyncCheckpointManager(root) as writer:
        await (await writer.save(1, state(1)))
        await (await writer.save(3, state(3)))
        os.makedirs(os.path.join(root, "step_000000000002"))  # a partial a read-only open keeps
        async with AsyncCheckpointManager(root, read_only=True) as reader:
            assert await reader.steps() == [1, 3]
            assert torch.equal((await reader.load(1))["w"], state(1)["w"])
            with pytest.raises(ReadOnlyError, match="read_only=True"):
                await reader.save(4, state(4))
        assert os.path.isdir(os.path.join(root, "step_000000000002"))
        assert current(root).record.owner != ""  # the writer's lease, untouched
        await (await writer.save(4, state(4)))
    with pytest.raises(ValueError, match="read_only"):
        AsyncCheckpointManager(root, read_only=True, retention=LatestN(1))
    with pytest.raises(ValueError, match="lease_ttl must be at most"):
        AsyncCheckpointManager(root, lease_ttl=7 * 86400)


def test_the_sync_manager_takes_the_same_lease(tmp_path):
    root = str(tmp_path / "run")
    with CheckpointManager(root) as first:
        first.save(1, state(1)).result()
        with pytest.raises(RootLockedError):
            CheckpointManager(root).open()
        with CheckpointManager(root, read_only=True) as reader:
            assert reader.steps() == [1]


async def test_prune_refuses_a_root_a_live_writer_holds_unless_forced(tmp_path, capsys):
    root = str(tmp_path / "run")
    async with AsyncCheckpointManager(root) as writer:
        for step in (1, 2, 3):
            await (await writer.save(step, state(step)))
        assert cli_main(["prune", root, "--keep-last", "1", "--yes"]) == 2
        assert "leased by a running writer" in capsys.readouterr().err
        assert cli_main(["prune", root, "--keep-last", "1"]) == 0  # a dry run is fine
        assert cli_main(["prune", root, "--keep-last", "2", "--yes", "--force"]) == 0
        assert await writer.steps() == [2, 3]
    assert cli_main(["prune", root, "--keep-last", "1", "--yes"]) == 0  # released: free
    assert sorted(os.listdir(root)) == [LEASE_DIR, *IDENTITY, "step_000000000003"]


def test_every_rank_of_a_job_refuses_a_root_another_writer_holds(tmp_path):
    root = str(tmp_path / "run")
    now = time.time()
    write_lease(root, LeaseRecord("other", "elsewhere", 7, now, now + 60, 1, 60.0).encode())
    results = run_ranks("_lease_worker.py", "open_leased", 2, tmp_path, root, args={})
    for r in results:
        assert r["error"] == "RootLockedError", r
        assert "elsewhere pid 7" in r["message"]
    assert not [n for n in os.listdir(root) if n not in (LEASE_DIR, *IDENTITY)]


def test_a_job_taken_over_fails_its_next_save_on_every_rank(tmp_path):
    root = str(tmp_path / "run")
    r0, r1 = run_ranks("_lease_worker.py", "taken_over", 2, tmp_path, root, args={})
    assert r0["error"] == "LeaseLostError", r0
    # Rank 1 checks rank 0's generation itself before it writes; either way nothing lands.
    assert r1["error"] in ("LeaseLostError", "DistributedSaveError"), r1
    assert "generation" in r1["message"] or "rank" in r1["message"]
    # Committed: the job's first save and the new writer's; step 3 at most a partial (the
    # ranks' failure notices), never listed.
    assert Catalog(open_storage(root)).committed_steps() == [1, 2]
