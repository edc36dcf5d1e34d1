"""Keeping a daemon running for the manager, and what a daemon's death means for its saves."""

from __future__ import annotations

import contextlib
import functools
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import replace

import anyio
import anyio.abc

from .._core.protocol import (
    CollectPartialsReq,
    EventMsg,
    Hello,
    LeaseGrant,
    PublishFailureReq,
    StepsReq,
    TierBindReq,
)
from ..errors import (
    CheckpointError,
    DaemonDiedError,
    DaemonStartError,
    RootLockedError,
    TierMismatchError,
)
from ..tiers import HOST_ID_ENV, leads_host, machine_id
from .client import DaemonCallbacks, DaemonClient
from .dist import Group
from .ledger import Emit, Ledger
from .mirror import DaemonMirror
from .staging import SlabPool

#: Starts a daemon from its Hello and connects to it, delivering what it sends to callbacks.
Connect = Callable[[Hello, DaemonCallbacks], Awaitable[DaemonClient]]


#: Seconds a daemon found dead waits for its reader to deliver what it sent before it died.
_READER_GRACE = 10.0


class _Life:
    """One daemon's life, as the supervisor sees it: ``over`` once its death was handled."""

    __slots__ = ("over",)

    def __init__(self) -> None:
        self.over = False


class Supervisor:
    """One live daemon at a time: the first started at open, another after each death.

    A death fails the saves the dead daemon had pending and frees their slabs. On several
    ranks the other ranks are told first, through a new daemon, so that none of them waits
    for this rank until its deadline.
    """

    def __init__(
        self,
        connect: Connect,
        *,
        pool: SlabPool,
        ledger: Ledger,
        mirror: DaemonMirror,
        emit: Emit,
        is_open: Callable[[], bool],
    ) -> None:
        self._connect = connect
        self._hello: Hello | None = None
        #: The root's lease the first daemon took (rank 0 of a writing manager), else None.
        self.lease: LeaseGrant | None = None
        #: On the other ranks of a writing manager: the generation of rank 0's lease, which
        #: their daemons check before they write (SaveReq.lease_generation).
        self.lease_generation: int | None = None
        #: The root's id, as the first daemon (rank 0's, on several ranks) found or made it.
        self.root_id: str | None = None
        self._pool = pool
        self._ledger = ledger
        self._mirror = mirror
        self._emit = emit
        self._is_open = is_open
        self._lock = anyio.Lock()
        self._tg: anyio.abc.TaskGroup | None = None
        self._group: Group | None = None
        #: The daemon started last; it may have died since.
        self.current: DaemonClient | None = None
        self._life: _Life | None = None

    async def start(self, tg: anyio.abc.TaskGroup, group: Group | None, hello: Hello) -> None:
        """Start the first daemon with ``hello`` (later ones get it too, but never collect
        partials), its reader and those of later ones in ``tg``; read the committed steps.

        Partial step directories are removed first: by the daemon as it starts on one rank;
        on several, by rank 0's once every rank has started (so none is saving yet) and
        before any of them may save.
        """
        self._tg, self._group, self._hello = tg, group, hello
        if group is None:
            d = await self._spawn(hello)
        else:
            d = await self._spawn_together(group, hello)
        self.lease = d.lease
        if group is None:
            self.root_id = d.root_id
        if group is not None:
            group.barrier()
            if hello.local is not None:
                await self._bind_tiers(group, hello)
            await self._collect_together(group, hello)
        self._ledger.committed = set(await (await self.live()).request(StepsReq))

    async def _bind_tiers(self, group: Group, hello: Hello) -> None:
        """Before any rank may save: every host's tier is tied to this root (its first rank
        ties or checks it, and leaves a probe there), and every other rank shows that its
        tier is that same directory (the tie and the probe are there). Ranks that give one
        host id must also be on one machine. Anything else fails ``open()`` on every rank
        with a :class:`TierMismatchError` naming the ranks, hosts and directories."""
        d = await self.live()
        assert self.root_id is not None, "a writer's root has an id"
        lead = leads_host(hello.hosts, group.rank)
        probe = secrets.token_hex(8) if lead else ""
        where = error = None
        if lead:
            try:
                where = await d.request(TierBindReq, root_id=self.root_id, probe=probe)
            except CheckpointError as e:
                error = str(e)
        said = (machine_id(), probe, where, error)
        told = group.all_gather(said, "the local tiers' check")
        problems = _machines(hello.hosts, [t[0] for t in told])
        problems += [f"rank {r}: {t[3]}" for r, t in enumerate(told) if t[3] is not None]
        first = hello.hosts.index(hello.hosts[group.rank])
        if not lead and not problems:
            try:
                where = await d.request(
                    TierBindReq, root_id=self.root_id, probe=told[first][1], role="check"
                )
            except CheckpointError as e:
                error = str(e)
        checked = group.all_gather((where, error), "the local tiers' check")
        if lead and where is not None:
            with contextlib.suppress(CheckpointError):
                await d.request(TierBindReq, root_id=self.root_id, probe=probe, role="done")
        for r, (there, why) in enumerate(checked):
            if why is not None and r != hello.hosts.index(hello.hosts[r]):
                lead_r = hello.hosts.index(hello.hosts[r])
                problems.append(
                    f"rank {r} (host {hello.hosts[r]}) does not share the tier of rank {lead_r}, "
                    f"its host's first rank: rank {r} uses {there or '?'}, rank {lead_r} "
                    f"{checked[lead_r][0] or told[lead_r][2]}: {why}"
                )
        if problems:
            raise TierMismatchError(
                "the local tier cannot serve this job: " + "; ".join(problems) + ". The ranks "
                f"of one host must share one tier directory, and each host needs its own "
                f"{HOST_ID_ENV} (or none)"
            )

    async def _collect_together(self, group: Group, hello: Hello) -> None:
        """Rank 0 removes the root's partial steps and its tier's, the first rank of every
        other host its tier's; before any rank goes on, every rank learns whether that
        failed anywhere, and raises then (rather than wait for the failed one at a barrier)."""
        error: CheckpointError | None = None
        try:
            if group.rank == 0 and hello.lease is not None:  # a writer, holding the root
                await (await self.live()).request(CollectPartialsReq)
            elif hello.local is not None and leads_host(hello.hosts, group.rank):
                await (await self.live()).request(CollectPartialsReq, root=False)  # its tier
        except CheckpointError as e:  # told to the others before it is raised
            error = e
        said = None if error is None else str(error)
        told = group.all_gather(said, "the removal of partial steps")
        if error is not None:
            raise error
        for rank, message in enumerate(told):
            if message is not None:
                raise DaemonStartError(
                    f"rank {rank} could not remove the partial steps of an earlier run: {message}"
                )

    async def _spawn_together(self, group: Group, hello: Hello) -> DaemonClient:
        """Start this rank's daemon; when any rank's could not start (rank 0's finding the
        root leased, say), fail on every rank with that rank's error."""
        try:
            d, problem = await self._spawn(hello), None
        except CheckpointError as e:
            d, problem = None, e
        grant = d.lease if d is not None else None
        said = (
            (type(problem).__name__, str(problem), None)
            if problem is not None
            else (None, grant.generation if grant is not None else None, d and d.root_id)
        )
        told = group.all_gather(said)
        if problem is not None:
            raise problem
        for rank, (kind, message, _) in enumerate(told):
            if kind is not None:
                cls = RootLockedError if kind == RootLockedError.__name__ else DaemonStartError
                raise cls(f"rank {rank} could not open the manager: {message}")
        if group.rank != 0:
            self.lease_generation = told[0][1]
        self.root_id = told[0][2]  # rank 0's: the one that made it, as a writer
        assert d is not None
        return d

    @property
    def hello(self) -> Hello:
        """What the daemons were started with."""
        assert self._hello is not None, "start() comes first"
        return self._hello

    async def live(self) -> DaemonClient:
        """The running daemon; after a death, a new one (which may have committed saves the
        dead one had pending, so the committed steps are read again)."""
        d = self.current
        if d is not None and d.alive:
            return d
        if d is not None and self._life is not None and not self._life.over:
            # Dead before its reader noticed (the loop was busy elsewhere). Let the reader
            # deliver what the daemon sent before it died (a save it committed), then see the
            # end of the pipe; so its death is handled before the next daemon gets any save.
            life = self._life
            with anyio.move_on_after(_READER_GRACE):
                while not life.over:
                    await anyio.sleep(0.005)
            if not life.over:  # (the reader is stuck: handle the death here)
                err = DaemonDiedError(
                    f"the checkpoint daemon (pid {d.pid}) died with exit code {d.exit_code}",
                    exit_code=d.exit_code,
                )
                await self._gone(life, err, False)
        async with self._lock:
            d = self.current
            if d is None or not d.alive:
                assert self._hello is not None, "start() comes first"
                d = await self._spawn(replace(self._hello, collect_partials=False))
                self._emit("daemon.restart", where="daemon")
                self._ledger.committed = set(await d.request(StepsReq))
            return d

    async def stop(self) -> None:
        """Stop the current daemon, letting it finish what is queued."""
        if self.current is not None:
            await self.current.stop()

    async def publish_failures(self, lost: list[tuple[int, str]], why: str) -> None:
        """Tell the other ranks that this rank's saves of these (step, uuid) failed, so they
        stop waiting for this rank now rather than at their deadline."""
        with contextlib.suppress(CheckpointError):
            for step, uuid in lost:
                d = await self.live()
                await d.request(PublishFailureReq, step=step, uuid=uuid, message=why)

    async def _spawn(self, hello: Hello) -> DaemonClient:
        assert self._tg is not None, "start() comes first"
        life = _Life()
        callbacks = DaemonCallbacks(
            # A slab a dead daemon freed is free already, and may be lent again since.
            slab_free=lambda name: None if life.over else self._pool.release(name),
            save_done=self._ledger.save_done,
            event=self._relay,
            gone=functools.partial(self._gone, life),
        )
        d = await self._connect(hello, callbacks)
        self.current, self._life = d, life
        self._mirror.new_daemon()
        self._tg.start_soon(d.serve)
        self._emit("daemon.spawn", where="daemon")
        return d

    def _relay(self, msg: EventMsg) -> None:
        self._emit(msg.name, uuid=msg.uuid, step=msg.step, **msg.fields)

    async def _gone(self, life: _Life, err: DaemonDiedError, expected: bool) -> None:
        """A daemon's death: once, whether its reader or :meth:`live` saw it first."""
        if life.over:
            return
        life.over = True
        self._emit("daemon.exit", where="daemon")
        if expected and not self._ledger.pending:
            return
        self._pool.release_all()
        pending = list(self._ledger.pending.values())
        if self._group is not None and pending and self._is_open():
            # Before anyone hears of the failure: this rank's next save() blocks in a
            # collective, so the other ranks must already know not to wait for it.
            await self.publish_failures([(h.step, h.uuid) for h in pending], str(err))
        for handle in pending:
            self._ledger.fail(handle, err)


def _machines(hosts: tuple[str, ...], machines: list[str]) -> list[str]:
    """What is wrong where ranks giving one host id are on different machines."""
    out = []
    for host in dict.fromkeys(hosts):
        ranks = [r for r, h in enumerate(hosts) if h == host]
        seen = {machines[r] for r in ranks}
        if len(seen) > 1:
            out.append(
                f"ranks {ranks} give the host id {host!r} but are on {len(seen)} machines "
                "(by their machine and boot ids)"
            )
    return out
