"""AsyncCheckpointManager: the trainer side of aiockpt.

The manager is a facade: it opens and closes, and hands each call to the part that does it.

- client.py: one daemon process and the pipe to it (DaemonClient, the seam a test fakes)
- supervisor.py: a live daemon at all times, and what a daemon's death means for saves
- ledger.py: the saves given out (SaveHandle) and the steps taken
- mirror.py: what the daemon holds of the trainer's caches
- saving.py, load/: the save and load paths; sigterm.py: on_sigterm="flush"
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import sys
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import anyio

from .._core.lease import MAX_TTL, job_identity
from .._core.protocol import (
    CheckpointInfo,
    Hello,
    LeaseGrant,
    LeaseSpec,
    LoadReply,
    RecordsReq,
    StepsReq,
    WarmReq,
)
from .._core.shm import sweep_orphans
from ..errors import DaemonError, ManagerClosedError, ReadOnlyError
from ..events import EventDispatcher, EventHandler, entry_point_handlers, logger, process_group_info
from ..retention import CheckpointRecord, RetentionPolicy, best_order
from ..tiers import LocalTier, host_id
from . import checks
from . import dist as _dist
from .client import DaemonCallbacks, DaemonClient, LoadRequest, SubprocessClient
from .dist import resolve_group
from .hfload import SafetensorsLoading
from .ledger import Ledger, SaveHandle, check_loop, loop_token
from .load import Loader, check_keys
from .mirror import DaemonMirror
from .runner import TaskRunner
from .saving import Saver
from .sigterm import SigtermFlush, require_main_thread
from .staging import LayoutCache, SlabPool
from .state import Flattener
from .storeproxy import group_store
from .supervisor import Supervisor

#: Seconds a root's lease lasts without renewal (renewed every third of it): a writer that
#: dies leaves its root free again within this.
DEFAULT_LEASE_TTL = 30.0

__all__ = ["AsyncCheckpointManager", "CheckpointInfo", "SaveHandle"]


class AsyncCheckpointManager(SafetensorsLoading):
    """Saves and loads checkpoints of a training run through a persistent daemon process.

    Use it as an async context manager; see the README for the API and docs/ for the design.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        storage_options: Mapping[str, Any] | None = None,
        max_pending: int = 1,
        staging_memory: int | float | None = None,
        retention: RetentionPolicy | None = None,
        event_handlers: Iterable[EventHandler] = (),
        process_group: Any = None,
        start_timeout: float = 60.0,
        close_timeout: float | None = None,
        dist_timeout: float = 300.0,
        on_sigterm: str | None = None,
        read_only: bool = False,
        takeover: bool = False,
        lease_ttl: float = DEFAULT_LEASE_TTL,
        dedup: bool = True,
        skip_unchanged: bool = False,
        job_id: str | None = None,
        local: LocalTier | None = None,
        persist_every: int | None = None,
    ) -> None:
        self.url = checks.root_url(root)
        self.storage_options = dict(storage_options or {})
        self.max_pending = checks.positive_int("max_pending", max_pending)
        self.retention = checks.retention_policy(retention)
        self.dist_timeout = checks.positive_float("dist_timeout", dist_timeout)
        self.start_timeout = start_timeout
        self.close_timeout = close_timeout
        self.on_sigterm = checks.sigterm_mode(on_sigterm)
        self.read_only = bool(read_only)
        self.dedup = checks.flag("dedup", dedup)
        self.takeover = bool(takeover)
        self.lease_ttl = checks.positive_float("lease_ttl", lease_ttl)
        if self.lease_ttl > MAX_TTL:
            raise ValueError(f"lease_ttl must be at most {MAX_TTL:.0f} s, not {lease_ttl!r}")
        if self.read_only and (self.takeover or self.retention is not None):
            raise ValueError(
                "a read_only manager takes no lease and deletes nothing: takeover and "
                "retention do not apply"
            )
        self.job_id = checks_job_id(job_id)  # (see lease_spec)
        self.local, self.persist_every = tiers_of(local, persist_every, read_only, staging_memory)
        #: This manager's id in the root's lease: its respawned daemons resume the lease.
        self._owner = uuid.uuid4().hex
        self.process_group = process_group
        self._hosts: tuple[str, ...] = ()
        self._group: _dist.Group | None = None
        self.rank = 0
        self.world_size = 1
        self._handlers = list(event_handlers)
        self.events = EventDispatcher(self._handlers)
        self._state = "new"
        self._loop: Any = None
        self._runner = TaskRunner()  # the daemons' readers and the SIGTERM watch
        self._sigterm: SigtermFlush | None = None
        self._pool = SlabPool(max_pending, checks.staging_memory(staging_memory))
        flattener, layouts = Flattener(), LayoutCache()
        self._ledger = Ledger(self.url, self._emit)
        self._mirror = DaemonMirror(flattener, layouts)
        self._daemons = Supervisor(
            self._connect,
            pool=self._pool,
            ledger=self._ledger,
            mirror=self._mirror,
            emit=self._emit,
            is_open=lambda: self._state == "open",
        )
        self._saver = Saver(
            self._daemons,
            self._mirror,
            self._ledger,
            self._emit,
            flattener=flattener,
            layouts=layouts,
            pool=self._pool,
            skip_unchanged=checks.flag("skip_unchanged", skip_unchanged),
        )
        self._loader = Loader(self._read, self._warm, self._emit, flattener, layouts, self._pool)

    # ----------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> AsyncCheckpointManager:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def open(self) -> None:
        """Start the daemon and learn the committed steps; ``async with`` calls this."""
        if self._state != "new":
            raise ManagerClosedError(f"the manager is {self._state}; a manager opens once")
        if self.on_sigterm is not None:
            require_main_thread()
        group_info = process_group_info(self.process_group)  # first: refuses a non-group clearly
        self._group = self._loader.group = resolve_group(self.process_group, self.dist_timeout)
        if self._group is not None:
            self.rank, self.world_size = self._group.rank, self._group.world_size
            if self.local is not None:  # which ranks share a local tier
                self._hosts = tuple(self._group.all_gather(host_id(), "the hosts' exchange"))
        self.events = EventDispatcher(
            [*self._handlers, *entry_point_handlers()],
            rank=self.rank,
            world_size=self.world_size,
            process_group=group_info,
        )
        swept = sweep_orphans()  # a job killed whole leaves its slabs: nobody unlinked them
        if swept:
            logger.info("removed shared memory left by processes that are gone: %s", list(swept))
            self.events.emit("shm.swept", nbytes=sum(swept.values()))
        try:
            await self._runner.start()
            await self._daemons.start(self._runner.tg, self._group, hello_of(self))
            lease_events(self.events, self._daemons.lease, self.url)
            if self.on_sigterm is not None:
                self._sigterm = SigtermFlush(self._flush)
                await self._sigterm.start(self._runner.tg)
        except BaseException:
            self._state = "closed"
            with anyio.CancelScope(shield=True):
                await self._daemons.stop()
            await self._shutdown()
            raise
        self._state = "open"
        self._loop = loop_token()

    async def aclose(self) -> None:
        """Wait for pending saves, stop the daemon, and free every shared-memory segment."""
        if self._state not in ("open", "preempted"):
            self._state = "closed"
            return
        self._state = "closing"
        try:
            with anyio.CancelScope(shield=True), anyio.move_on_after(self.close_timeout):
                await self._ledger.settle()
        finally:
            self._state = "closed"
            with anyio.CancelScope(shield=True):
                await self._daemons.stop()
            for handle in list(self._ledger.pending.values()):
                closed = DaemonError("the manager closed before this save committed")
                self._ledger.fail(handle, closed)
            self.events.close()  # an operation the daemon never answered still ends
            await self._shutdown()

    async def _shutdown(self) -> None:
        """End the background tasks (shielded, in any scope of the caller); free the slabs."""
        try:
            await self._runner.stop()
        finally:
            self._pool.close()
            if self._sigterm is not None:
                self._sigterm.restore()

    async def _flush(self) -> None:
        """On SIGTERM (on_sigterm="flush"): commit every staged save and stop the daemon."""
        self._state = "preempted"  # refuse new saves; those already staging finish
        with anyio.move_on_after(self.close_timeout or math.inf):
            # Saves still copying are not pending yet: wait for them too.
            while self._ledger.busy:
                await self._ledger.settle()
                await anyio.sleep(0.01)
        await self._daemons.stop()
        self._pool.close()

    def _check_writable(self, what: str) -> None:
        self._check_open()
        if self.read_only:
            raise ReadOnlyError(f"this manager of {self.url} was opened read_only=True: no {what}")

    def _check_open(self) -> None:
        check_loop(self._loop, "the manager")
        if self._state != "open":
            raise ManagerClosedError(
                "the manager is not open; use `async with AsyncCheckpointManager(...)`"
                if self._state == "new"
                else f"the manager is {self._state}"
            )

    @property
    def daemon_pid(self) -> int | None:
        """The process id of the daemon serving this manager; None before it opens, after it
        closes, and from a daemon's death until the next call starts another."""
        d = self._daemons.current
        return d.pid if d is not None and d.alive else None

    @property
    def root_id(self) -> str | None:
        """The root's id once open, however it is spelled (docs/format.md#the-roots-identity)."""
        return self._daemons.root_id

    # ----------------------------------------------------------------- the daemon

    async def _connect(self, hello: Hello, callbacks: DaemonCallbacks) -> DaemonClient:
        """Start a daemon and connect to it: the seam a test overrides to run the manager
        against a daemon of its own."""
        # On several ranks the commit signals through the job's store, relayed by this process.
        store = group_store(self._group.pg) if self._group and self.world_size > 1 else None
        return await SubprocessClient.spawn(
            hello, callbacks, start_timeout=self.start_timeout, store=store
        )

    def _emit(self, name: str, **fields: Any) -> None:
        self.events.emit(name, **fields)

    async def _warm(self, step: int | None) -> None:
        """Send this rank's :class:`WarmReq` for a load of ``step``, and return: its answer
        is not waited for, and any error it meets is the load's to raise."""
        req = {"step": step, "rank": self.rank, "world_size": self.world_size}
        await self._runner.tg.start(_warming, self._daemons, req)

    async def _read(self, kind: type[LoadRequest], **fields: Any) -> LoadReply:
        """This rank's load request ``kind`` with ``fields``, answered by the live daemon."""
        return await (await self._daemons.live()).request(kind, **fields)

    # ----------------------------------------------------------------- the API

    async def save(
        self,
        step: int,
        state: Any,
        *,
        metrics: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        overwrite: bool = False,
    ) -> SaveHandle:
        """Snapshot ``state`` and start writing it; returns once the state may be mutated.
        ``overwrite``: replace a committed ``step`` (it loads until the new one commits)."""
        self._check_writable("save")
        return await self._saver.save(self._group, step, state, metrics, metadata, overwrite)

    async def delete(self, step: int, *, allow_latest: bool = False) -> None:
        """Delete the committed ``step`` once the saves before it are done, keeping bytes a
        kept step reads; the newest only with ``allow_latest``. With a local tier, from every
        host's tier and the root, wherever it lies."""
        self._check_writable("delete")
        await self._saver.delete(self._group, step, allow_latest)

    async def wait(self) -> None:
        """Wait until every pending save has committed; raises the first failure."""
        self._check_open()
        await self._ledger.wait()

    async def steps(self) -> list[int]:
        """Committed steps, ascending. With a local tier on several ranks, those whose every
        shard is available (a collective then: every rank calls it)."""
        self._check_open()
        steps = list(await (await self._daemons.live()).request(StepsReq))
        return _dist.agreed_steps(self._group, steps) if self._hosts else steps

    async def latest_step(self) -> int | None:
        """The newest committed step, None when there is none."""
        steps = await self.steps()
        return steps[-1] if steps else None

    async def best_step(self, metric: str, mode: str = "min") -> int | None:
        """The committed step with the best ``metric`` (None when no checkpoint has it);
        ties go to the newer step, and non-finite values never count as best."""
        self._check_open()
        return await _best_step(self._daemons, metric, mode)

    async def load(
        self,
        step: int | None = None,
        *,
        into: Any = None,
        strict: bool = True,
        keys: str | Iterable[str] | None = None,
        atomic: bool = True,
    ) -> Any:
        """The state saved at ``step`` (latest committed when None). With ``into``, restore in
        place into its tensors and stateful objects and return it: checked whole first (keys,
        shapes, dtypes; with ``strict`` the saved keys and ``into``'s must be the same), so a
        load that fails leaves ``into`` as it was. ``strict=False`` restores, and reads, only
        what both hold, and logs the rest. ``keys`` (key paths such as ``"model"`` or
        ``"model/layers.3"``) reads and returns only what lies at or under them.

        ``atomic=False`` lets a load into ``into`` under ``staging_memory`` copy each window
        as soon as it is read and checked, instead of once every checksum has passed: it
        reads the bytes once instead of twice. A mismatch is still found before anything
        changes; a corrupt byte or a storage error found later leaves ``into`` partly
        restored. A load that fits its slab is atomic either way."""
        self._check_open()
        for name, flag in (("strict", strict), ("atomic", atomic)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, not {type(flag).__name__}")
        if step is None and self._hosts:  # the newest step complete on every rank
            step = await self.latest_step()
        return await self._loader.load(step, into, strict, check_keys(keys), atomic)


def hello_of(mgr: AsyncCheckpointManager) -> Hello:
    """What ``mgr``'s daemons start with."""
    return Hello(
        url=mgr.url,
        storage_options=mgr.storage_options,
        **retention_fields(mgr.retention),
        rank=mgr.rank,
        world_size=mgr.world_size,
        trainer_pid=os.getpid(),
        dedup=mgr.dedup,
        collect_partials=mgr._group is None and not mgr.read_only,
        dist_timeout=mgr.dist_timeout if mgr.world_size > 1 else None,
        lease=lease_spec(mgr),
        local=mgr.local,
        persist_every=mgr.persist_every,
        hosts=mgr._hosts,
    )


def retention_fields(policy: Any) -> dict[str, Any]:
    """The Hello fields of a retention policy: pickled apart from the Hello, with this
    process's ``sys.path``, so the daemon imports the policy's module where this process
    found it (a module beside the script, say) before it unpickles it."""
    if policy is None:
        return {"retention": None}
    path = tuple(os.path.abspath(p or os.curdir) for p in sys.path if isinstance(p, str))
    return {"retention": None, "retention_pickle": pickle.dumps(policy), "sys_path": path}


def tiers_of(
    local: Any, persist_every: Any, read_only: bool, staging_memory: Any
) -> tuple[LocalTier | None, int]:
    """``local`` and ``persist_every`` checked (see docs/tiers.md): without a local tier
    every save goes to the root, so ``persist_every`` is 1 and may not be given."""
    if local is None:
        if persist_every is not None:
            raise ValueError("persist_every needs a local tier: pass local=LocalTier(...)")
        return None, 1
    if not isinstance(local, LocalTier):
        raise TypeError(f"local must be an aiockpt.LocalTier, not {type(local).__name__}")
    if read_only:
        raise ValueError("a read_only manager writes no local tier: leave local= out")
    if staging_memory is not None:
        raise ValueError(
            "a local tier writes each save twice from one slab: it cannot be combined with "
            "staging_memory, which stages a save in windows"
        )
    every = 1 if persist_every is None else checks.positive_int("persist_every", persist_every)
    return local, every


def checks_job_id(job_id: str | None) -> str | None:
    """``job_id`` checked: None or a non-empty str of under 256 characters."""
    if job_id is not None and not (isinstance(job_id, str) and 0 < len(job_id) < 256):
        raise ValueError(f"job_id must be a non-empty str under 256 chars, not {job_id!r}")
    return job_id


def lease_spec(mgr: AsyncCheckpointManager) -> LeaseSpec | None:
    """How ``mgr`` holds its root's lease (None: it takes none, being read-only or a rank
    other than 0): renewed every third of its TTL, for its ``job_id`` or the environment's
    job (torchrun, Slurm), read as it is at open (see docs/reliability.md#restarting-a-job)."""
    if mgr.read_only or mgr.rank != 0:
        return None
    job, attempt = job_identity(mgr.job_id)
    ttl = mgr.lease_ttl
    return LeaseSpec(mgr._owner, ttl, ttl / 3, mgr.takeover, job=job, attempt=attempt)


def lease_events(events: EventDispatcher, grant: LeaseGrant | None, url: str) -> None:
    """The events of the lease the daemon took at open, if it took one."""
    if grant is None:
        return
    events.emit("lease.acquired", generation=grant.generation)
    if grant.taken_from is not None:
        events.emit("lease.takeover", generation=grant.generation, detail=grant.taken_from)
    if not grant.guaranteed:
        events.emit(
            "lease.unguarded",
            generation=grant.generation,
            detail=f"{url} cannot create files conditionally: two writers opening it at the "
            "same moment could both take its lease (see docs/reliability.md)",
        )


async def _best_step(daemons: Supervisor, metric: str, mode: str) -> int | None:
    """See AsyncCheckpointManager.best_step."""
    if not isinstance(metric, str) or not metric:
        raise ValueError(f"metric must be a non-empty str, not {metric!r}")
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', not {mode!r}")
    records = [
        CheckpointRecord(r.step, r.created_at, r.metrics)
        for r in await (await daemons.live()).request(RecordsReq)
    ]
    order = best_order(records, metric, mode)
    return records[order[0]].step if order else None


async def _warming(
    daemons: Supervisor,
    req: dict[str, Any],
    *,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Send a WarmReq of ``req``'s fields (see AsyncCheckpointManager._warm)."""
    task_status.started()  # this task runs on until it waits for the answer: sent by then
    with contextlib.suppress(Exception):
        d = await daemons.live()
        await d.request(WarmReq, **req)
