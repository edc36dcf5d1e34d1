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

This module holds the record, its checks and the reads (the daemon and the CLI share them);
the daemon's :class:`~aiockpt._daemon.lease.LeaseKeeper` takes, renews and checks it.
"""

from __future__ import annotations

import json
import math
import re
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
    (one more than the lease it replaced)."""

    owner: str
    host: str
    pid: int
    since: float
    expires: float
    generation: int
    ttl: float
    #: Set when the holder closed its manager: the root is free at once.
    released: bool = False

    def live(self, now: float) -> bool:
        """Whether the lease still holds the root at wall-clock time ``now``."""
        return not self.released and now < self.expires

    def describe(self) -> str:
        """The holder, for an error message: host, pid, since, expiry."""
        return (
            f"{self.host} pid {self.pid} (generation {self.generation}), holding it since "
            f"{_when(self.since)}, "
            + ("released" if self.released else f"expiring {_when(self.expires)}")
        )

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
    return LeaseRecord(owner, host, pid, since, expires, generation, ttl, released)


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
