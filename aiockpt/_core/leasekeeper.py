"""A writer's hold on its root's lease: taken at start, renewed in the background, checked
before every commit and deletion (see :mod:`aiockpt._core.lease` for the files). The daemon
holds one for its manager's run; ``aiockpt copy`` one for the destination, while it writes."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from ..errors import CheckpointError, LeaseLostError, RootLockedError
from ..storage import Storage
from .lease import (
    DRAINING,
    GONE,
    LEASE_DIR,
    LIVE,
    Claimant,
    LeaseRecord,
    highest_generation,
    lease_path,
    process_start,
    read_current,
    supersedes,
)
from .protocol import LeaseGrant, LeaseSpec

#: The part of its TTL that a writer trusts its lease for, by its own clock, after each renewal:
#: a commit checked with a quarter of the TTL left (7.5 s by default) still lands before a
#: waiting writer may take the root over by expiry, host clocks in step.
_TRUSTED = 0.75


#: How long a new writer waits for the daemon of a training process that is gone from this
#: host: it finishes the saves that were staged, then releases the lease and exits.
_DRAIN_WAIT = 10.0

#: ``emit(name, **fields)``: an event for the trainer (``lease.lapsed``, ``lease.regained``).
Emit = Callable[..., None]


class LeaseKeeper:
    """Takes, renews, checks and releases one writer's lease.

    ``clock`` is wall-clock time (what the lease file records, for other hosts to read);
    ``monotonic`` is what this writer trusts for its own expiry: a process paused past its
    TTL (SIGSTOP, a frozen VM) finds on waking that its lease may be gone, whatever the wall
    clock did meanwhile.

    A lease that went unrenewed past the trusted part of its TTL has *lapsed*: the writer
    commits and deletes nothing while it is, but it is not lost. As soon as a renewal goes
    through (the renewal thread's, or the one each check tries first) while its generation is
    still the highest and its file still its own, it is *regained* and saves commit again.
    Only a higher generation, another writer's takeover, ends a writer for good.
    """

    def __init__(
        self,
        storage: Storage,
        spec: LeaseSpec,
        pid: int,
        *,
        trainer_pid: int = 0,
        emit: Emit | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.storage = storage
        self.spec = spec
        self.pid = pid
        self.trainer_pid = trainer_pid
        self._emit = emit
        self.clock, self.monotonic = clock, monotonic
        put = getattr(storage, "put_if_absent", None)
        self._put_if_absent: Callable[[str, bytes], bool] | None = put
        self.record: LeaseRecord | None = None
        #: This writer's lease holds until then by its monotonic clock.
        self._valid_until = 0.0
        #: Why the lease is lost for good (taken over), else None.
        self._lost: str | None = None
        #: Whether a lapse was reported and not yet followed by a renewal.
        self._lapsed = False
        #: What failed the last renewal, while renewals fail.
        self._failure: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------- taking it

    def acquire(self) -> LeaseGrant:
        """Take the root's lease, or resume our own (a respawned daemon of the same manager).
        Raises :class:`RootLockedError` naming the holder when another writer holds it, is
        not provably gone (see :func:`~aiockpt._core.lease.supersedes`) and ``takeover`` was
        not asked for."""
        me = Claimant.here(self.spec.job, self.spec.attempt)
        patience = self.monotonic() + _DRAIN_WAIT
        while True:
            now = self.clock()
            cur = read_current(self.storage, now)
            rec = cur.record
            if rec is not None and rec.owner == self.spec.owner and not rec.released:
                return self._resume(rec)
            holder = cur.holder(now)
            verdict, why = supersedes(me, holder) if holder is not None else (LIVE, "")
            if verdict == DRAINING and self.monotonic() < patience:
                time.sleep(0.05)  # it releases the lease as it exits, in a moment
                continue
            break
        if holder is not None and verdict == GONE:
            taken_from = f"lease of {holder.describe()}: {why}"
        elif (holder is not None or cur.problem is not None) and not self.spec.takeover:
            own = holder is not None and self._own_process(me, holder)
            raise _locked(self.storage.url, holder, cur.problem, why, own=own)
        elif holder is not None:
            taken_from = f"forced takeover from {holder.describe()}"
        elif cur.problem is not None:
            taken_from = f"forced takeover of {cur.problem}"
        elif rec is not None and not rec.released:
            taken_from = f"expired lease of {rec.describe()}"
        else:
            taken_from = None
        self._take(me, cur.generation + 1, now)
        return LeaseGrant(cur.generation + 1, self.guaranteed, taken_from)

    def _own_process(self, me: Claimant, holder: LeaseRecord) -> bool:
        """Whether ``holder`` is this writer's own training process (another manager of it,
        still open): its pid, started at the same time, on this host, boot and pid namespace."""
        return (
            self.trainer_pid != 0
            and holder.trainer_pid == self.trainer_pid
            and me.boot_id != ""
            and (holder.host, holder.boot_id, holder.pid_ns) == (me.host, me.boot_id, me.pid_ns)
            and holder.trainer_start in (0, process_start(self.trainer_pid))
        )

    def _resume(self, rec: LeaseRecord) -> LeaseGrant:
        """Our own lease: a daemon of this manager died and this one replaces it."""
        # Whether or not it ran out while no daemon renewed it, nobody took it: it is still
        # the highest generation, and ours. The renewal makes it hold again.
        self.record = replace(rec, pid=self.pid, daemon_start=process_start(self.pid) or 0)
        self._valid_until = math.inf  # (not a lapse to report: nothing was refused meanwhile)
        self.renew()
        return LeaseGrant(rec.generation, self.guaranteed)

    @property
    def guaranteed(self) -> bool:
        """Whether the storage creates files conditionally: without, two writers racing for
        the lease at the same moment could both take it."""
        return self._put_if_absent is not None

    def _take(self, me: Claimant, generation: int, now: float) -> None:
        start = self.monotonic()
        rec = LeaseRecord(
            owner=self.spec.owner,
            host=me.host,
            pid=self.pid,
            since=now,
            expires=now + self.spec.ttl,
            generation=generation,
            ttl=self.spec.ttl,
            trainer_pid=self.trainer_pid,
            trainer_start=process_start(self.trainer_pid) or 0 if self.trainer_pid else 0,
            daemon_start=process_start(self.pid) or 0,
            boot_id=me.boot_id,
            pid_ns=me.pid_ns,
            job=me.job,
            attempt=me.attempt,
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
        """Rewrite our lease with a later expiry, unless it was taken over (then raise
        :class:`LeaseLostError`); raise what the storage raised when it cannot be written."""
        with self._lock:
            self._renew()

    def _renew(self) -> None:
        rec = self.record
        if rec is None:
            return
        if self._lost is not None:
            raise self._error("renew the lease")
        start, now = self.monotonic(), self.clock()
        lapsed = self._lapsed or start >= self._valid_until
        try:
            top = highest_generation(self.storage)
            if top > rec.generation:
                self._lost = f"another writer took the root over (lease generation {top})"
                raise self._error("renew the lease")
            if lapsed:
                # Unrenewed for a while: before we rewrite it, make sure the file there is
                # still ours (a writer that found the directory gone may have started over).
                cur = read_current(self.storage, now)
                if cur.generation < rec.generation:  # the storage lost it, or hides it
                    raise CheckpointError(
                        f"{self.storage.url}: the lease file {lease_path(rec.generation)} "
                        "is missing"
                    )
                if cur.record is None or cur.record.owner != rec.owner:
                    self._lost = f"another writer holds the root ({cur.problem or 'its lease'})"
                    raise self._error("renew the lease")
            renewed = replace(rec, expires=now + self.spec.ttl)
            self.storage.put_atomic(lease_path(rec.generation), renewed.encode())
        except LeaseLostError:
            raise
        except Exception as e:
            self._failure = str(e) or type(e).__name__
            if lapsed:
                self._lapse()
            raise
        self.record = renewed
        self._valid_until = start + self.spec.ttl * _TRUSTED
        self._failure = None
        if lapsed:
            self._lapse()  # reported first, if nobody saw it happen (a paused process)
            self._lapsed = False
            self._event("lease.regained", "renewed again: saves commit again")

    def _lapse(self) -> None:
        if not self._lapsed:
            self._lapsed = True
            self._event("lease.lapsed", self._failure or "no renewal for a while")

    def _event(self, name: str, detail: str) -> None:
        if self._emit is not None and self.record is not None:
            with contextlib.suppress(Exception):
                self._emit(name, generation=self.record.generation, detail=detail)

    def check(self, what: str) -> None:
        """Raise :class:`LeaseLostError` unless this writer holds the lease now: before
        ``what`` (a commit, a deletion). One listing of the lease directory; after a lapse,
        a renewal first, which regains the lease if the storage answers and nobody took it."""
        with self._lock:
            if self._lost is None and self.monotonic() >= self._valid_until:
                try:
                    self._renew()
                except LeaseLostError:
                    raise self._error(what) from None
                except Exception:
                    self._lapse()
                    raise LeaseLostError(
                        f"cannot {what}: this writer's lease on {self.storage.url} "
                        f"(generation {self._generation}) lapsed: it could not be renewed "
                        f"({self._failure}). Saves fail until a renewal goes through; the "
                        "lease is then regained, unless another writer took the root meanwhile"
                    ) from None
                return
            if self._lost is None and (top := highest_generation(self.storage)) > self._generation:
                self._lost = f"another writer took the root over (lease generation {top})"
            if self._lost is not None:
                raise self._error(what)

    def _error(self, what: str) -> LeaseLostError:
        return LeaseLostError(
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
            except Exception:  # the storage failed: the next renewal may pass (see check)
                continue

    def close(self, *, release: bool) -> None:
        """Stop renewing; with ``release``, mark the lease released so the root is free now
        (unless another writer took it over)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if release and self.record is not None:
            with self._lock:
                if self._lost is not None:
                    return
                if highest_generation(self.storage) > self.record.generation:
                    return
                done = replace(self.record, expires=self.clock(), released=True)
                self.storage.put_atomic(lease_path(done.generation), done.encode())


def _locked(
    url: str, holder: LeaseRecord | None, problem: str | None, why: str = "", *, own: bool = False
) -> RootLockedError:
    if holder is not None and own:
        err = RootLockedError(
            f"{url} is leased by this process (pid {holder.trainer_pid}): a manager opened on "
            f"it earlier in this process is still open (not closed?): {holder.describe()}. "
            "Close that manager, or save through it, before opening a second writer on this "
            "root; pass takeover=True if it can no longer be reached (it then commits nothing "
            "more); read_only=True opens a reader beside it"
        )
        err.holder = holder.holder_info()
        return err
    if holder is not None:
        note = f" ({why})" if why else ""
        err = RootLockedError(
            f"{url} is leased by another writer: {holder.describe()}{note}. Wait for it to "
            "close, or pass takeover=True to take the root over (that writer then commits "
            "nothing more)"
        )
        err.holder = holder.holder_info()
        return err
    return RootLockedError(
        f"{url}: cannot take the lease: {problem}. Pass takeover=True to replace it"
    )
