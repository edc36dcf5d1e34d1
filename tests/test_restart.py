"""A job restarted gets its root back at once when its previous holder is provably gone; a
lease whose renewals failed heals once the storage answers; nothing is left held by a dead
process; a daemon's death costs at most the saves in flight; exit never hangs."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from multiprocessing import Pipe
from pathlib import Path

import anyio
import pytest
import torch
from _support.ranks import run_ranks
from test_lease import Writer, current, state, write_lease

from aiockpt import AsyncCheckpointManager, CheckpointManager
from aiockpt._core.catalog import Catalog
from aiockpt._core.lease import LeaseRecord, job_identity
from aiockpt._core.protocol import Hello, LeaseSpec
from aiockpt._core.shm import Segment, unlink
from aiockpt._trainer.client import _PKG_PARENT, DAEMON_BOOT
from aiockpt.cli import main as cli_main
from aiockpt.errors import LeaseLostError, RootLockedError
from aiockpt.storage import open_storage

pytestmark = pytest.mark.anyio


def start_ticks(pid: int) -> int:
    """A process's start time, in clock ticks since boot (field 22 of /proc/PID/stat)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rpartition(")")[2].split()[19])


def this_host() -> dict:
    """What a lease written on this host, in this pid namespace, records about where."""
    return {
        "host": os.environ.get("AIOCKPT_HOST_ID") or socket.gethostname(),
        "boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
        "pid_ns": os.readlink("/proc/self/ns/pid"),
    }


def lease_of(pid: int, start: int, **more: object) -> bytes:
    """A live lease (a minute left) held by process ``pid`` started at ``start`` on this host."""
    now = time.time()
    record = {
        "owner": "an earlier run",
        "pid": pid,
        "daemon_pid": pid,
        "trainer_pid": pid,
        "trainer_start": start,
        "daemon_start": start,
        "since": now - 5,
        "expires": now + 60,
        "ttl": 60.0,
        "generation": 1,
        "released": False,
        **this_host(),
        **more,
    }
    return json.dumps(record).encode()


def segments_of(*pids: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") for p in pids if n.startswith(f"aiockpt-{p}-")]


def test_a_job_killed_whole_gets_its_root_back_at_once(tmp_path):
    root = str(tmp_path / "run")
    first = Writer(root, ttl=60.0)  # a TTL no restart would wait out
    trainer, daemon = first.proc.pid, first.ready["daemon"]
    assert first.ask("save 1") == {"saved": 1}
    assert first.ask("save 2") == {"saved": 2}
    first.signal(signal.SIGKILL)  # the whole job: trainer and daemon
    first.proc.wait(30)
    first.close()
    # Nobody writes there any more: prune needs no --force (it wanted one until the TTL).
    assert cli_main(["prune", root, "--keep-last", "1", "--yes"]) == 0

    async def reopen() -> tuple[float, list, list[int], torch.Tensor]:
        events: list = []
        t0 = time.monotonic()
        async with AsyncCheckpointManager(root, event_handlers=[events.append]) as mgr:
            opened = time.monotonic() - t0
            return opened, events, await mgr.steps(), (await mgr.load())["w"]

    opened, events, steps, w = anyio.run(reopen)
    assert opened < 1.0, opened
    assert steps == [2]  # the worker keeps LatestN(1)
    assert torch.equal(w, state(2)["w"])
    taken = [e for e in events if e.name == "lease.takeover"]
    assert len(taken) == 1
    assert f"pid {trainer}" in taken[0].detail
    assert "gone" in taken[0].detail
    assert segments_of(trainer, daemon) == []


async def test_a_holder_alive_on_this_host_is_refused(tmp_path):
    root = str(tmp_path / "run")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        write_lease(root, lease_of(live.pid, start_ticks(live.pid)))
        with anyio.fail_after(30), pytest.raises(RootLockedError) as info:
            async with AsyncCheckpointManager(root):
                pass
        assert f"pid {live.pid}" in str(info.value)
        assert current(root).generation == 1
    finally:
        live.kill()
        live.wait()


@pytest.mark.parametrize("how", ["pid reused", "pid gone", "zombie"])
async def test_a_stale_lease_of_a_dead_process_on_this_host_is_taken(tmp_path, how):
    root = str(tmp_path / "run")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = start_ticks(other.pid)
        if how == "pid reused":  # the pid now belongs to a live process started later
            start -= 100
        elif how == "pid gone":
            other.kill()
            other.wait()
        else:  # killed, not reaped yet: the pid exists, the process does not run
            other.kill()
            while Path(f"/proc/{other.pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
                time.sleep(0.01)
        write_lease(root, lease_of(other.pid, start))
        events: list = []
        with anyio.fail_after(30):
            async with AsyncCheckpointManager(root, event_handlers=[events.append]) as mgr:
                await (await mgr.save(1, state(1)))
        taken = [e for e in events if e.name == "lease.takeover"]
        assert len(taken) == 1
        assert f"pid {other.pid}" in taken[0].detail
        assert current(root).generation == 2
    finally:
        other.kill()
        other.wait()


async def test_a_lease_from_another_boot_or_an_older_version_waits_for_its_ttl(tmp_path):
    root = str(tmp_path / "run")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    for i, data in enumerate(
        [
            lease_of(gone.pid, 1, boot_id="an-earlier-boot", generation=1),
            # An older writer's file: no boot id, no training process; still parsed.
            json.dumps(
                {
                    "owner": "old",
                    "host": this_host()["host"],
                    "pid": gone.pid,
                    "since": time.time(),
                    "expires": time.time() + 60,
                    "ttl": 60.0,
                    "generation": 2,
                }
            ).encode(),
        ],
        start=1,
    ):
        write_lease(root, data, generation=i)
        with anyio.fail_after(30), pytest.raises(RootLockedError, match=f"pid {gone.pid}"):
            async with AsyncCheckpointManager(root):
                pass


def test_an_earlier_attempt_of_the_same_job_on_another_host_is_taken_over(tmp_path, monkeypatch):
    root = str(tmp_path / "run")
    job = {"TORCHELASTIC_RUN_ID": "job-17", "TORCHELASTIC_RESTART_COUNT": "0"}
    first = Writer(root, ttl=60.0, env={"AIOCKPT_HOST_ID": "node-a", **job})
    try:
        assert first.ask("save 1") == {"saved": 1}
        monkeypatch.setenv("AIOCKPT_HOST_ID", "node-b")
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-17")

        async def open_root() -> list:
            events: list = []
            async with AsyncCheckpointManager(root, event_handlers=[events.append]) as mgr:
                await (await mgr.save(2, state(2)))
            return events

        # The same attempt on another host is another rank or a mistake, not a restart; so
        # is another job.
        for run, attempt in (("job-17", "0"), ("job-18", "1")):
            monkeypatch.setenv("TORCHELASTIC_RUN_ID", run)
            monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
            with pytest.raises(RootLockedError, match="job job-17 attempt 0"):
                anyio.run(open_root)
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-17")
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
        events = anyio.run(open_root)
        taken = [e for e in events if e.name == "lease.takeover"]
        assert len(taken) == 1, taken
        assert "attempt 0" in taken[0].detail
        answer = first.ask("save 3")
        assert answer["error"] == "LeaseLostError", answer
        assert Catalog(open_storage(root)).committed_steps() == [1, 2]
        assert current(root).record.job == "job-17"
    finally:
        first.close()


async def test_a_lease_paused_past_its_ttl_is_regained_when_nobody_took_it(tmp_path):
    root = str(tmp_path / "run")
    events: list = []
    ttl = 3.0  # renewed every second: a busy machine does not make it lapse by itself
    async with AsyncCheckpointManager(root, lease_ttl=ttl, event_handlers=[events.append]) as mgr:
        await (await mgr.save(1, state(1)))
        daemon = mgr.daemon_pid
        assert daemon is not None
        os.kill(daemon, signal.SIGSTOP)  # no renewals: a paused process, a frozen VM
        try:
            await anyio.sleep(ttl * 1.2)
        finally:
            os.kill(daemon, signal.SIGCONT)
        with anyio.fail_after(30):
            await (await mgr.save(2, state(2)))
            await (await mgr.save(3, state(3)))
        assert await mgr.steps() == [1, 2, 3]
    names = [e.name for e in events]
    assert "lease.lapsed" in names
    assert "lease.regained" in names
    assert names.index("lease.lapsed") < names.index("lease.regained")


async def test_saves_fail_clearly_while_the_lease_cannot_be_renewed_then_commit(tmp_path):
    root = str(tmp_path / "run")
    events: list = []
    ttl = 3.0  # renewed every second: a busy machine does not make it lapse by itself
    async with AsyncCheckpointManager(root, lease_ttl=ttl, event_handlers=[events.append]) as mgr:
        await (await mgr.save(1, state(1)))
        lease_dir, away = Path(root, "_lease"), Path(root, "_lease.away")
        lease_dir.rename(away)  # every renewal fails: the storage lost the directory
        try:
            await anyio.sleep(ttl)
            with anyio.fail_after(30), pytest.raises(LeaseLostError) as info:
                await (await mgr.save(2, state(2)))
            assert "could not be renewed" in str(info.value)
            assert "_lease" in str(info.value)  # the storage's own error, naming the file
        finally:
            away.rename(lease_dir)
        with anyio.fail_after(30):
            await (await mgr.save(3, state(3)))
        assert await mgr.steps() == [1, 3]
    assert [e.name for e in events if e.name.startswith("lease.")] == [
        "lease.acquired",
        "lease.lapsed",
        "lease.regained",
    ]


async def test_a_cancelled_open_leaves_the_root_free(tmp_path):
    root = str(tmp_path / "run")
    rng = random.Random(7)
    t0 = time.monotonic()
    async with AsyncCheckpointManager(root):
        pass
    opening = time.monotonic() - t0
    # Another manager's slab in this process: a cancelled open must leave it be.
    theirs = f"/aiockpt-{os.getpid()}-slab-another{time.monotonic_ns()}"
    Segment(theirs, 4096, create=True).close()
    in_open = 0  # runs cancelled while open() ran, not after
    deadline = time.monotonic() + 40
    for _ in range(25):
        if time.monotonic() > deadline:
            break
        opened = False
        with anyio.move_on_after(rng.uniform(0, 1.2 * opening)):
            async with AsyncCheckpointManager(root, lease_ttl=60.0):
                opened = True
                await anyio.sleep(5)
        in_open += not opened
        # The next writer gets the root at once, whatever the cancelled one had taken.
        with anyio.fail_after(20):
            async with AsyncCheckpointManager(root, lease_ttl=60.0):
                pass
    assert in_open >= 8
    assert theirs[1:] in os.listdir("/dev/shm")
    unlink(theirs)
    rec = current(root).record
    assert rec is not None
    assert rec.released


def wait_dead(pid: int) -> None:
    """Block (no event loop runs) until our child ``pid`` has died, every thread of it, without
    reaping it (its Popen does that)."""
    try:
        while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            time.sleep(0.01)
    except ChildProcessError:
        pass  # reaped already: the manager saw it die


async def test_a_save_after_an_idle_daemons_death_commits(tmp_path):
    root = str(tmp_path / "run")
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, state(1)))
        for step in range(2, 22):  # 20 trials
            pid = mgr.daemon_pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            wait_dead(pid)  # a synchronous training step: the loop does not run meanwhile
            with anyio.fail_after(60):
                await (await mgr.save(step, state(step)))
        assert await mgr.steps() == list(range(1, 22))


async def test_a_save_right_after_the_daemon_was_killed_commits(tmp_path):
    """SIGKILLed and saved to at once: the daemon is dying (its threads exit, its memory is
    torn down, it is a zombie not yet reaped) when the save comes, and never gets it. The
    save goes to a new daemon and commits."""
    root = str(tmp_path / "run")
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, state(1)))
        for step in range(2, 10):  # 8 trials
            pid = mgr.daemon_pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            with anyio.fail_after(60):
                await (await mgr.save(step, state(step)))
            assert mgr.daemon_pid != pid
        assert await mgr.steps() == list(range(1, 10))


def test_a_sync_save_after_an_idle_daemons_death_commits(tmp_path):
    root = str(tmp_path / "run")
    with CheckpointManager(root) as mgr:
        mgr.save(1, state(1)).result(60)
        for step in range(2, 6):
            pid = mgr.daemon_pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            wait_dead(pid)  # its death may or may not have been seen by the manager's loop
            mgr.save(step, state(step)).result(60)
        assert mgr.steps() == [1, 2, 3, 4, 5]


def test_an_unclosed_sync_manager_does_not_hold_the_interpreter(tmp_path):
    root = str(tmp_path / "run")
    script = textwrap.dedent(
        """
        import sys, torch
        from aiockpt import CheckpointManager

        mgr = CheckpointManager(sys.argv[1])
        mgr.open()
        mgr.save(1, {"w": torch.ones(1 << 20)})
        """
    )
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", script, root], capture_output=True, text=True, timeout=60
    )
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr
    assert took < 10, took
    assert Catalog(open_storage(root)).committed_steps() == [1]
    rec = current(root).record
    assert rec is not None
    assert rec.released


@pytest.mark.parametrize("respawned", [False, True])
def test_a_daemon_whose_trainer_vanished_while_it_started_leaves_nothing_held(tmp_path, respawned):
    """The trainer sends its Hello and is gone before the daemon is ready (killed while its
    first daemon, or one replacing a dead one, starts): the daemon must release the lease it
    took or resumed, and the trainer's slabs."""
    root = str(tmp_path / "run")
    if respawned:  # the lease its dead predecessor held for this manager
        now = time.time()
        held = LeaseRecord("a trainer that vanished", "h", 1, now, now + 60, 1, 60.0)
        write_lease(root, held.encode())
    slab = f"/aiockpt-{os.getpid()}-slab-vanished{time.monotonic_ns()}"
    Segment(slab, 4096, create=True).close()  # a slab the trainer was filling
    try:
        for _ in range(3):
            parent, child = Pipe(duplex=True)
            proc = subprocess.Popen(
                [sys.executable, "-c", DAEMON_BOOT, _PKG_PARENT, str(child.fileno())],
                pass_fds=(child.fileno(),),
            )
            child.close()
            spec = LeaseSpec("a trainer that vanished", 60.0, 20.0)
            hello = Hello(url=root, storage_options={}, retention=None, lease=spec)
            parent.send(replace(hello, trainer_pid=os.getpid()))
            parent.close()  # gone before it heard READY
            assert proc.wait(30) is not None
            lease = current(root)
            assert lease.record is None or lease.record.released, lease
        assert slab[1:] not in os.listdir("/dev/shm")
    finally:
        unlink(slab)


def test_an_unclosed_sync_manager_leaves_what_it_cannot_finish_to_the_daemon(tmp_path):
    root = str(tmp_path / "run")
    script = textwrap.dedent(
        """
        import os, signal, sys, torch
        from aiockpt import CheckpointManager

        mgr = CheckpointManager(sys.argv[1], close_timeout=1.0)
        mgr.open()
        mgr.save(1, {"w": torch.ones(4)}).result()
        print(mgr.daemon_pid, flush=True)
        os.kill(mgr.daemon_pid, signal.SIGSTOP)  # step 2 cannot commit before exit
        mgr.save(2, {"w": torch.ones(4)})
        """
    )
    out, err = tmp_path / "out", tmp_path / "err"
    t0 = time.monotonic()
    with out.open("w") as o, err.open("w") as e:  # files: the stopped daemon holds them open
        code = subprocess.Popen([sys.executable, "-c", script, root], stdout=o, stderr=e).wait(60)
    took = time.monotonic() - t0
    daemon = int(out.read_text().split()[0])
    os.kill(daemon, signal.SIGCONT)
    assert code == 0, err.read_text()
    assert took < 10, took
    assert "saves of steps [2] had not committed after 1.0 s" in err.read_text()
    # The daemon, its trainer gone, still commits what was staged, then releases the lease.
    deadline = time.monotonic() + 30
    while not (current(root).record.released and os.path.exists(f"{root}/step_000000000002")):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert Catalog(open_storage(root)).committed_steps() == [1, 2]


@pytest.mark.parametrize(
    ("env", "explicit", "identity"),
    [
        ({}, None, (None, None)),
        ({"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "2"}, None, (None, None)),
        ({"TORCHELASTIC_RUN_ID": "r1", "TORCHELASTIC_RESTART_COUNT": "2"}, None, ("r1", 2)),
        ({"SLURM_JOB_ID": "991"}, None, ("991", 0)),
        ({"SLURM_JOB_ID": "991", "SLURM_RESTART_COUNT": "3"}, None, ("991", 3)),
        ({"SLURM_JOB_ID": "991", "SLURM_RESTART_COUNT": "3"}, "mine", ("mine", 3)),
        ({"SLURM_JOB_ID": "991"}, "mine", ("mine", None)),
        ({"TORCHELASTIC_RUN_ID": "r1", "TORCHELASTIC_RESTART_COUNT": "x"}, None, ("r1", None)),
    ],
)
def test_the_job_identity_comes_from_the_argument_or_the_environment(
    monkeypatch, env, explicit, identity
):
    for name in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert job_identity(explicit) == identity


def test_a_daemon_outliving_its_killed_trainer_is_waited_for(tmp_path):
    """The training process is gone but its daemon still runs (it finishes what was staged,
    then releases the lease and exits): a new writer on the host waits for it rather than
    refuse, and gets the root once it is gone."""
    root = str(tmp_path / "run")
    trainer = subprocess.Popen([sys.executable, "-c", "pass"])
    trainer.wait()
    daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lease = json.loads(lease_of(trainer.pid, 1))
        lease.update(pid=daemon.pid, daemon_start=start_ticks(daemon.pid))
        write_lease(root, json.dumps(lease).encode())
        t0 = time.monotonic()
        threading.Timer(1.0, daemon.kill).start()

        async def reopen() -> tuple[float, list]:
            events: list = []
            async with AsyncCheckpointManager(root, event_handlers=[events.append]):
                return time.monotonic() - t0, events

        opened, events = anyio.run(reopen)
    finally:
        daemon.kill()
        daemon.wait()
    assert 1.0 < opened < 10, opened
    taken = [e for e in events if e.name == "lease.takeover"]
    assert len(taken) == 1
    assert f"pid {trainer.pid}" in taken[0].detail


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP])
def test_ctrl_c_or_a_closed_terminal_costs_no_staged_save(tmp_path, sig):
    """Ctrl-C (SIGINT) and a terminal's hang-up (SIGHUP) go to the whole foreground process
    group, the daemon with its trainer: the trainer stops, and the daemon commits what it was
    given, as when its trainer dies any other way."""
    root = str(tmp_path / "run")
    first = Writer(root, ttl=60.0)
    daemon = first.ready["daemon"]
    assert first.ask("stage 1 64") == {"staged": 1}
    first.signal(sig)
    first.proc.stdin.close()  # type: ignore[union-attr]
    first.proc.wait(30)
    first.close()
    deadline = time.monotonic() + 30
    while start_ticks_or_none(daemon) is not None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert Catalog(open_storage(root)).committed_steps() == [1]


def start_ticks_or_none(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except FileNotFoundError:
        return None
    return None if stat[0] in "ZX" else int(stat[19])


def test_sigterm_to_the_whole_job_still_flushes(tmp_path):
    """Schedulers that preempt by signalling every process of the job (Slurm's scancel, a
    killpg) reach the daemon too: with on_sigterm="flush", what was staged still commits, and
    the lease is released for the restart."""
    root = str(tmp_path / "run")
    first = Writer(root, ttl=60.0, env={"LEASE_WORKER_ON_SIGTERM": "flush"})
    assert first.ask("stage 1 64") == {"staged": 1}
    first.signal(signal.SIGTERM)
    assert first.proc.wait(30) == -signal.SIGTERM
    first.close()
    assert Catalog(open_storage(root)).committed_steps() == [1]
    rec = current(root).record
    assert rec is not None
    assert rec.released


def test_a_two_rank_job_killed_whole_gets_its_root_back_at_once(tmp_path):
    """The whole job (both ranks and their daemons) SIGKILLed, then started again at once:
    every rank opens without takeover, resumes step 2 as it saved it, and no segment of the
    killed job is left in /dev/shm."""
    root, ready = str(tmp_path / "run"), str(tmp_path / "ready")
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    worker = str(Path(__file__).parent / "_lease_worker.py")
    store = tmp_path / "store-killed"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                worker,
                "saved_then_killed",
                str(rank),
                "2",
                str(store),
                root,
                str(tmp_path / f"out-{rank}"),
                json.dumps({"ready": ready}),
            ],
            env=env,
            start_new_session=True,  # a group of its own with its daemon: killed whole
        )
        for rank in range(2)
    ]
    try:
        deadline = time.monotonic() + 120
        while not all(os.path.exists(f"{ready}-{r}") for r in range(2)):
            assert time.monotonic() < deadline, "the job never saved"
            assert all(p.poll() is None for p in procs), [p.returncode for p in procs]
            time.sleep(0.05)
        killed = [json.loads(Path(f"{ready}-{r}").read_text()) for r in range(2)]
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(30)
    r0, r1 = run_ranks("_lease_worker.py", "reopened", 2, tmp_path, root, args={})
    for rank, r in enumerate((r0, r1)):
        assert r["steps"] == [2], r
        assert r["w"] == [float(2 + rank)] * 4, r
    assert r0["opened"] < 10.0, r0  # rank 0 takes the lease at once (the rest is rendezvous)
    assert len(r0["takeover"]) == 1
    assert "gone" in r0["takeover"][0]
    assert segments_of(*(k[key] for k in killed for key in ("pid", "daemon"))) == []
