"""The root's lease: one writer at a time, and a writer whose lease was taken fenced off.

A writer holds the lease of a root while its manager is open. The lease is a small JSON file
per generation, ``_lease/g<generation, 12 digits>.json``; the highest generation present is
the lease, and it is taken by *creating* the next generation's file with the storage's
``put_if_absent`` (link(2) on local files, ``If-None-Match: *`` on S3), so of two writers
racing for a root exactly one gets it. Its holder renews it by rewriting its own file with a
later expiry; nobody else ever writes that file. A writer checks, before each commit and each
deletion, that no higher generation exists and that its own lease has not run out by its own
monotonic clock (a process paused past its TTL and then resumed knows it may have been taken
over, before it asks the storage). See docs/reliability.md.

The file names its holder: host, boot and pid namespace, the training process and its daemon
(with their start times), the job and its attempt. That is what lets a restarted job take the
root at once when the holder is provably gone (:func:`supersedes`), instead of waiting out
the TTL of a writer that was SIGKILLed.

This module holds the record, its checks and the reads (the daemon and the CLI share them);
a writer's :class:`~aiockpt._core.leasekeeper.LeaseKeeper` takes, renews and checks it.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import time
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import CheckpointError, LeaseLostError
from ..storage import Storage
from .tree import bounded_repr as _short

LEASE_DIR = "_lease"
#: A lease file larger than this is not read.
MAX_LEASE_BYTES = 64 * 1024
#: A TTL beyond a day is refused: a lease that claims to last longer is not one we wrote.
MAX_TTL = 24 * 3600.0
_NAME = re.compile(r"g(\d{12})\.json", re.ASCII)


def lease_path(generation: int) -> str:
    """The file of a generation's lease, relative to the root."""
    return f"{LEASE_DIR}/g{generation:012d}.json"


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    """What a lease file says: who holds the root, since and until when, and its generation
    (one more than the lease it replaced).

    Who: the host (``host``; ``boot_id`` and ``pid_ns`` say which boot of it and which pid
    namespace the pids are in), the training process (``trainer_pid``, ``trainer_start``: its
    start time in clock ticks since boot, which tells it from a later process given the same
    pid), its daemon (``pid``, ``daemon_start``), and the job's identity and attempt where the
    environment has one. Files written before these were recorded lack them: empty, 0, None.
    """

    owner: str
    host: str
    #: The daemon's pid (the only pid older files record).
    pid: int
    since: float
    expires: float
    generation: int
    ttl: float
    #: Set when the holder closed its manager: the root is free at once.
    released: bool = False
    trainer_pid: int = 0
    trainer_start: int = 0
    daemon_start: int = 0
    boot_id: str = ""
    pid_ns: str = ""
    job: str | None = None
    attempt: int | None = None

    def live(self, now: float) -> bool:
        """Whether the lease still holds the root at wall-clock time ``now``."""
        return not self.released and now < self.expires

    def who(self) -> str:
        """The holder in words: the training process (and its daemon) on its host, its job."""
        if self.trainer_pid:
            text = f"{self.host} pid {self.trainer_pid} (daemon pid {self.pid})"
        else:
            text = f"{self.host} pid {self.pid}"
        if self.job is not None:
            text += f", job {self.job}"
            if self.attempt is not None:
                text += f" attempt {self.attempt}"
        return text

    def describe(self) -> str:
        """The holder, for an error message: who, since, expiry."""
        return (
            f"{self.who()} (generation {self.generation}), holding it since "
            f"{_when(self.since)}, "
            + ("released" if self.released else f"expiring {_when(self.expires)}")
        )

    def holder_info(self) -> dict[str, object]:
        """The holder as a dict (``RootLockedError.holder``)."""
        return {
            "host": self.host,
            "pid": self.trainer_pid or self.pid,
            "trainer_pid": self.trainer_pid or None,
            "daemon_pid": self.pid,
            "job": self.job,
            "attempt": self.attempt,
            "since": self.since,
            "expires": self.expires,
            "generation": self.generation,
        }

    def encode(self) -> bytes:
        """The lease file's bytes."""
        return json.dumps(asdict(self), sort_keys=True).encode()


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def parse_lease(data: bytes, generation: int, now: float) -> LeaseRecord:
    """Check an untrusted lease file of ``generation``; raise ValueError saying why not."""
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ValueError("not JSON") from None
    if not isinstance(raw, dict):
        raise ValueError("not a JSON object")
    owner, host, pid = raw.get("owner"), raw.get("host"), raw.get("pid")
    if not (isinstance(owner, str) and isinstance(host, str) and len(owner) + len(host) < 512):
        raise ValueError(f"bad owner or host {_short(owner)} {_short(host)}")
    if type(pid) is not int or pid < 0:
        raise ValueError(f"bad pid {_short(pid)}")
    times: list[Any] = [raw.get(k) for k in ("since", "expires", "ttl")]
    if not all(type(t) in (int, float) and math.isfinite(t) for t in times):
        raise ValueError(f"bad times {_short(times)}")
    since, expires, ttl = (float(t) for t in times)
    if not 0 < ttl <= MAX_TTL or expires > now + MAX_TTL or expires < since:
        raise ValueError(
            f"it claims to expire at {_short(expires)} (ttl {_short(ttl)}), beyond what any "
            "writer sets"
        )
    if raw.get("generation") != generation or type(raw.get("generation")) is not int:
        raise ValueError(f"it says generation {_short(raw.get('generation'))}")
    released = raw.get("released", False)
    if type(released) is not bool:
        raise ValueError(f"bad released {_short(released)}")
    # Who holds it: optional, since files of older versions lack these.
    counts = {k: raw.get(k, 0) for k in ("trainer_pid", "trainer_start", "daemon_start")}
    if not all(type(v) is int and v >= 0 for v in counts.values()):
        raise ValueError(f"bad process ids {_short(counts)}")
    names = {k: raw.get(k, "") for k in ("boot_id", "pid_ns")}
    if not all(isinstance(v, str) and len(v) < 256 for v in names.values()):
        raise ValueError(f"bad host identity {_short(names)}")
    job, attempt = raw.get("job"), raw.get("attempt")
    if not (job is None or (isinstance(job, str) and len(job) < 512)):
        raise ValueError(f"bad job {_short(job)}")
    if not (attempt is None or (type(attempt) is int and attempt >= 0)):
        raise ValueError(f"bad attempt {_short(attempt)}")
    return LeaseRecord(
        owner, host, pid, since, expires, generation, ttl, released,
        **counts, **names, job=job, attempt=attempt,
    )  # fmt: skip


# --------------------------------------------------------------------------- who holds it


@dataclass(frozen=True, slots=True)
class Claimant:
    """Where a writer runs and which job it is: what decides whether a holder of the lease is
    provably gone (see :func:`supersedes`)."""

    host: str
    boot_id: str
    pid_ns: str
    job: str | None = None
    attempt: int | None = None

    @classmethod
    def here(cls, job: str | None = None, attempt: int | None = None) -> Claimant:
        """This process's host, boot and pid namespace, claiming for ``job``."""
        return cls(
            host_id(), _read_text("/proc/sys/kernel/random/boot_id"), _pid_ns(), job, attempt
        )


def host_id() -> str:
    """The host's name in leases: ``AIOCKPT_HOST_ID`` when set, else the host name."""
    return os.environ.get("AIOCKPT_HOST_ID") or socket.gethostname()


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""  # not Linux: no pid is ever proven gone


def _pid_ns() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def process_start(pid: int) -> int | None:
    """Process ``pid``'s start time in clock ticks since boot; None when no process of that
    pid runs (none, or a zombie: killed and not yet reaped) or it cannot be told."""
    return _process(pid)[0]


#: ``PF_EXITING`` in the flags of /proc/PID/stat: the process has begun to exit.
_PF_EXITING = 0x4


def _process(pid: int) -> tuple[int | None, bool]:
    """Process ``pid``'s start time (None: no such process runs) and whether it is exiting."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None, False
    fields = stat.rpartition(")")[2].split()  # the name, in parentheses, may hold spaces
    if len(fields) < 20 or not fields[19].isdigit() or not fields[6].isdigit():
        return None, False
    start, exiting = int(fields[19]), bool(int(fields[6]) & _PF_EXITING)
    if fields[0] in ("Z", "X", "x"):
        # Killed. Its main thread is a zombie as soon as it exits, but the process is not
        # gone (not a single syscall of it left running) until every other thread is too.
        try:
            return (None, False) if len(os.listdir(f"/proc/{pid}/task")) <= 1 else (start, True)
        except OSError:
            return None, False
    return start, exiting


def _state(pid: int, start: int) -> str:
    """Whether the process that was ``pid``, started at ``start`` (0: unknown), is gone, is
    exiting (killed, its teardown under way: a large process takes seconds) or runs."""
    now, exiting = _process(pid)
    if now is None or (start != 0 and now != start):
        return "gone"
    return "exiting" if exiting else "running"


#: What :func:`supersedes` decides about a live holder: taken at once, waited for a moment
#: (its training process is exiting, or gone while its daemon still finishes staged saves),
#: or refused.
GONE, DRAINING, LIVE = "gone", "draining", "live"


def supersedes(me: Claimant, rec: LeaseRecord) -> tuple[str, str]:
    """Whether ``me`` may take ``rec``'s live lease without ``takeover=True``, and why.

    Only when its holder is provably gone: on this very host (same host id, boot and pid
    namespace) its training process and daemon no longer run, or their pids now belong to
    processes started at other times; or, on any host, it is an earlier attempt of the job
    ``me`` is a later attempt of (a restarted torchrun or Slurm job).
    """
    if (
        me.job is not None
        and me.attempt is not None
        and rec.job == me.job
        and rec.attempt is not None
        and rec.attempt < me.attempt
    ):
        return GONE, f"job {me.job} attempt {rec.attempt} was superseded by attempt {me.attempt}"
    same_host = (
        me.boot_id != ""
        and me.pid_ns != ""
        and (rec.host, rec.boot_id, rec.pid_ns) == (me.host, me.boot_id, me.pid_ns)
    )
    if not same_host or rec.trainer_pid == 0:
        return LIVE, ""
    trainer = _state(rec.trainer_pid, rec.trainer_start)
    if trainer == "running":
        return LIVE, ""
    if trainer == "exiting":
        return DRAINING, f"its training process (pid {rec.trainer_pid} on this host) is exiting"
    why = f"its training process (pid {rec.trainer_pid} on this host) is gone"
    if _state(rec.pid, rec.daemon_start) != "gone":
        return DRAINING, f"{why}; its daemon (pid {rec.pid}) is still finishing its saves"
    return GONE, why


def job_identity(explicit: str | None = None) -> tuple[str | None, int | None]:
    """The job a writer belongs to and its attempt, where the environment says: an explicit
    ``job_id``, torchrun's run id and restart count, or Slurm's job id and restart count (a
    requeued job keeps its id). None where unknown."""
    env = os.environ
    te_run = env.get("TORCHELASTIC_RUN_ID")
    te_run = te_run if te_run and te_run != "none" else None  # torchrun's default: no id
    te_count = _count(env.get("TORCHELASTIC_RESTART_COUNT"))
    slurm_count = _count(env.get("SLURM_RESTART_COUNT", "0"))
    if explicit is not None:
        return explicit, te_count if te_count is not None else _count(
            env.get("SLURM_RESTART_COUNT")
        )
    if te_run is not None:
        return te_run, te_count
    if env.get("SLURM_JOB_ID"):
        return env["SLURM_JOB_ID"], slurm_count
    return None, None


def _count(text: str | None) -> int | None:
    return int(text) if text is not None and text.isascii() and text.isdigit() else None


@dataclass(frozen=True, slots=True)
class Current:
    """The lease of a root as found: its generation (0: never leased), its record, or why
    the file there is not a lease (``problem``)."""

    generation: int
    record: LeaseRecord | None
    problem: str | None = None

    def holder(self, now: float) -> LeaseRecord | None:
        """The record while it holds the root, else None."""
        return self.record if self.record is not None and self.record.live(now) else None


def highest_generation(storage: Storage) -> int:
    """The highest lease generation in the root (0 when never leased): one listing."""
    names = storage.list_dir(LEASE_DIR)
    return max((int(m.group(1)) for n in names if (m := _NAME.fullmatch(n))), default=0)


def read_current(storage: Storage, now: float | None = None) -> Current:
    """The root's lease: a listing and one bounded read."""
    now = time.time() if now is None else now
    generation = highest_generation(storage)
    if generation == 0:
        return Current(0, None)
    path = lease_path(generation)
    where = f"{storage.url.rstrip('/')}/{path}"
    try:
        size = storage.size(path)
        if size > MAX_LEASE_BYTES:
            return Current(generation, None, f"{where}: {size} bytes, too large for a lease")
        data = storage.read_range(path, 0, size)
    except CheckpointError as e:
        return Current(generation, None, f"{where}: unreadable: {e}")
    try:
        return Current(generation, parse_lease(data, generation, now))
    except ValueError as e:
        return Current(generation, None, f"{where} is not a lease aiockpt wrote: {e}")


def check_generation(storage: Storage, generation: int, what: str) -> None:
    """Raise LeaseLostError unless ``generation`` is still the root's lease: what a rank that
    does not hold its job's lease checks before it writes (one listing)."""
    top = highest_generation(storage)
    if top != generation:
        raise LeaseLostError(
            f"cannot {what}: the job's lease on {storage.url} (generation {generation}) was "
            f"taken over by another writer (generation {top})"
        )
