"""The daemon's hold on its root's lease: taken at start, renewed in the background, checked
before every commit and deletion (see :mod:`aiockpt._core.lease` for the files)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from .._core.lease import LEASE_DIR, LeaseRecord, highest_generation, lease_path, read_current
from .._core.protocol import LeaseGrant, LeaseSpec
from ..errors import LeaseLostError, RootLockedError
from ..storage import Storage

#: The part of its TTL that a writer trusts its lease for, by its own clock, after each renewal:
#: a commit checked with a quarter of the TTL left (7.5 s by default) still lands before a
#: waiting writer may take the root over by expiry, host clocks in step.
_TRUSTED = 0.75


class LeaseKeeper:
    """Takes, renews, checks and releases one writer's lease.

    ``clock`` is wall-clock time (what the lease file records, for other hosts to read);
    ``monotonic`` is what this writer trusts for its own expiry: a process paused past its
    TTL (SIGSTOP, a frozen VM) finds on waking that its lease may be gone, whatever the wall
    clock did meanwhile.
    """

    def __init__(
        self,
        storage: Storage,
        spec: LeaseSpec,
        pid: int,
        *,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.storage = storage
        self.spec = spec
        self.pid = pid
        self.clock, self.monotonic = clock, monotonic
        put = getattr(storage, "put_if_absent", None)
        self._put_if_absent: Callable[[str, bytes], bool] | None = put
        self.record: LeaseRecord | None = None
        #: This writer's lease holds until then by its monotonic clock.
        self._valid_until = 0.0
        self._lost: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------- taking it

    def acquire(self) -> LeaseGrant:
        """Take the root's lease, or resume our own (a respawned daemon of the same manager).
        Raises :class:`RootLockedError` naming the holder when another writer holds it and
        ``takeover`` was not asked for."""
        now = self.clock()
        cur = read_current(self.storage, now)
        rec = cur.record
        if rec is not None and rec.owner == self.spec.owner and not rec.released:
            # Ours: a daemon of this manager died and this one replaces it.
            left = rec.expires - now - self.spec.ttl * (1 - _TRUSTED)
            if left > 0:
                self.record = replace(rec, pid=self.pid)  # the renewal names the new daemon
                self._valid_until = self.monotonic() + left
                self.renew()
                return LeaseGrant(rec.generation, self.guaranteed)
            # It ran out while no daemon renewed it; nobody took it (it is still the highest).
            self._take(cur.generation + 1, now)
            return LeaseGrant(cur.generation + 1, self.guaranteed)
        holder = cur.holder(now)
        if (holder is not None or cur.problem is not None) and not self.spec.takeover:
            raise _locked(self.storage.url, holder, cur.problem)
        taken_from = None
        if holder is not None:
            taken_from = f"forced takeover from {holder.describe()}"
        elif cur.problem is not None:
            taken_from = f"forced takeover of {cur.problem}"
        elif rec is not None and not rec.released:
            taken_from = f"expired lease of {rec.describe()}"
        self._take(cur.generation + 1, now)
        return LeaseGrant(cur.generation + 1, self.guaranteed, taken_from)

    @property
    def guaranteed(self) -> bool:
        """Whether the storage creates files conditionally: without, two writers racing for
        the lease at the same moment could both take it."""
        return self._put_if_absent is not None

    def _take(self, generation: int, now: float) -> None:
        start = self.monotonic()
        rec = LeaseRecord(
            owner=self.spec.owner,
            host=socket.gethostname(),
            pid=self.pid,
            since=now,
            expires=now + self.spec.ttl,
            generation=generation,
            ttl=self.spec.ttl,
        )
        path = lease_path(generation)
        self.storage.makedirs(LEASE_DIR)
        if self._put_if_absent is None:
            self.storage.put_atomic(path, rec.encode())
        elif not self._put_if_absent(path, rec.encode()):
            raise _locked(
                self.storage.url, None, f"another writer took generation {generation} just now"
            )
        self.record = rec
        self._valid_until = start + self.spec.ttl * _TRUSTED

    # ----------------------------------------------------------------- keeping it

    def renew(self) -> None:
        """Rewrite our lease with a later expiry, unless it was taken over."""
        with self._lock:
            rec = self.record
            if rec is None or self._lost is not None:
                return
            start, now = self.monotonic(), self.clock()
            self._fence_check("renew the lease")
            renewed = replace(rec, expires=now + self.spec.ttl)
            self.storage.put_atomic(lease_path(rec.generation), renewed.encode())
            self.record = renewed
            self._valid_until = start + self.spec.ttl * _TRUSTED

    def check(self, what: str) -> None:
        """Raise :class:`LeaseLostError` unless this writer still holds the lease: before
        ``what`` (a commit, a deletion). One listing of the lease directory."""
        with self._lock:
            self._fence_check(what)

    def _fence_check(self, what: str) -> None:
        if self._lost is None:
            if self.monotonic() >= self._valid_until:
                self._lost = (
                    "it went unrenewed for too long (the process was paused, or the storage "
                    "failed the renewals), so another writer may hold the root by now"
                )
            elif (top := highest_generation(self.storage)) > self._generation:
                self._lost = f"another writer took the root over (lease generation {top})"
        if self._lost is not None:
            raise LeaseLostError(
                f"cannot {what}: this writer's lease on {self.storage.url} (generation "
                f"{self._generation}) is lost: {self._lost}"
            )

    @property
    def _generation(self) -> int:
        return self.record.generation if self.record is not None else 0

    @property
    def lost(self) -> bool:
        """Whether the lease is known to be lost."""
        return self._lost is not None

    def start(self) -> None:
        """Renew every ``spec.renew_every`` seconds in a thread, until :meth:`close`."""
        self._thread = threading.Thread(target=self._run, name="aiockpt-lease", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.spec.renew_every):
            try:
                self.renew()
            except LeaseLostError:
                return  # checked again, and refused, before each commit and deletion
            except Exception:  # a storage hiccup: the next renewal may pass; expiry is checked
                continue

    def close(self, *, release: bool) -> None:
        """Stop renewing; with ``release``, mark the lease released so the root is free now."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if release and self.record is not None:
            with self._lock:
                try:
                    self._fence_check("release the lease")
                except LeaseLostError:
                    return
                done = replace(self.record, expires=self.clock(), released=True)
                self.storage.put_atomic(lease_path(done.generation), done.encode())


def _locked(url: str, holder: LeaseRecord | None, problem: str | None) -> RootLockedError:
    if holder is not None:
        err = RootLockedError(
            f"{url} is leased by another writer: {holder.describe()}. Wait for it to close, or "
            "pass takeover=True to take the root over (that writer then commits nothing more)"
        )
        err.holder = {
            "host": holder.host,
            "pid": holder.pid,
            "since": holder.since,
            "expires": holder.expires,
            "generation": holder.generation,
        }
        return err
    return RootLockedError(
        f"{url}: cannot take the lease: {problem}. Pass takeover=True to replace it"
    )
