"""The daemon's side of a local tier (see docs/tiers.md).

A local tier is an aiockpt root of its own on local disk, written by a second
:class:`~.writer.Writer` from the same slab: every save is committed there first (its shard,
then its manifest, last, with the same checksums), and steps with ``step % persist_every ==
0`` then go to the root by the root's writer, as without a tier. The trainer copies its
state into the slab once; the daemon writes it once per destination and hands the slab back
when the last write is durable.

A failure of the local tier never fails a save the root commits: it is a ``tier.failed``
event. A step due only in the local tier that the local tier could not commit landed
nowhere: its save fails with a :class:`CheckpointError`.

Loads and listings see the tiers through :class:`TierView`: a file the local tier holds is
read from it, else from a partner holding it, else from the root.

With ``LocalTier(replicas=k)`` on several hosts, each rank's shard is also copied into its
partners' tiers before its part of the manifest is handed over (``peers.py``), and a rank
whose own tier lacks a step its partner holds reads it from the partner over the network as
it loads (``peerview.py``): a replacement host's recovery, nothing copied to its disk.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from .._core import format as fmt
from .._core.catalog import Catalog, manifest_path
from .._core.identity import read_peer_key, read_root_id
from .._core.protocol import (
    DeleteReq,
    EventMsg,
    Hello,
    SaveDone,
    SaveReq,
    SlabFree,
)
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    InvalidStepError,
    StorageError,
)
from ..retention import LatestN
from ..storage import Storage, open_storage
from ..storage._local import LocalStorage
from ..tiers import leads_host as first_of_host
from .hostcommit import HostCoordinator, local_coordinator
from .load import Reader
from .peers import Peers, partners
from .peerview import PeerView
from .pipe import Outbox, remote_error
from .prune import Pruner
from .tie import Tie
from .writer import Writer, follow

if TYPE_CHECKING:
    from .server import Daemon

__all__ = ["LocalOutbox", "TierView", "TieredWriter", "Tiers", "attach", "open_local"]

#: The suffix of a save's uuid in the local tier's commit: its signals in the job's store
#: never meet the root commit's of the same save.
LOCAL_UUID = ".local"

#: How the tiers' reads say what they found: (event name, step, tier, detail).
Emit = Callable[[str, int | None, str, str], None]

#: What the local writer's events become: its commit and its retention, tagged as the tier's.
_RENAMED = {"save.committed": "tier.committed", "retention.delete": "tier.delete"}


def open_local(path: str) -> LocalStorage:
    """The local tier's storage at ``path``, made if missing and checked writable now, so a
    tier that cannot be written fails the manager's ``open()`` with a clear error rather
    than every save later. The ranks of a host share the directory: the probe is per
    process. ``path`` may be a URL whose registered storage is a local directory (a
    :class:`LocalStorage`, or a subclass of it); any other is a :class:`StorageError`."""
    probe = f".probe-{os.getpid()}"
    try:
        storage = _local_storage(path)
    except Exception as e:  # a plugin's factory may raise anything on options it refuses
        raise StorageError(f"the local tier {path} cannot be opened: {e}") from None
    try:
        os.makedirs(storage.root, exist_ok=True)
        storage.put_atomic(probe, b"")
        storage.delete(probe)
    except (OSError, StorageError) as e:
        storage.close()
        raise StorageError(
            f"the local tier {path} cannot be written: {e}; give LocalTier a directory on a "
            "local disk this process may write, or leave local= out"
        ) from None
    return storage


def _local_storage(path: str) -> LocalStorage:
    """The storage of the tier at ``path``: a directory, or a URL served by a registered
    storage that is a :class:`LocalStorage` (never an object store: a tier is on local disk,
    and its peer replicas are linked into place there)."""
    if "://" not in path:
        return LocalStorage(path)
    storage = open_storage(path)
    if not isinstance(storage, LocalStorage):
        storage.close()
        raise StorageError(
            f"{path} is served by {type(storage).__qualname__}, not by a local directory: a "
            "local tier is a directory on each host's own disk"
        )
    return storage


class LocalOutbox(Outbox):
    """The local writer's outbox: its slab release and its end are kept for the
    :class:`TieredWriter`, which decides what the trainer hears; its commit and retention
    events go up renamed (``tier.committed``, ``tier.delete``) under the save's own uuid."""

    def __init__(self, outbox: Outbox) -> None:
        super().__init__(outbox.pipe)
        self.outbox = outbox
        self.done: SaveDone | None = None

    def send(self, msg: object) -> None:
        if isinstance(msg, SlabFree):
            return
        if isinstance(msg, SaveDone):
            self.done = msg
            return
        if isinstance(msg, EventMsg):
            name = _RENAMED.get(msg.name)
            if name is not None:
                uuid = None if msg.uuid is None else msg.uuid.removesuffix(LOCAL_UUID)
                self.outbox.send(EventMsg(name, uuid, msg.step, {**msg.fields, "tier": "local"}))
            return
        self.outbox.send(msg)


class TieredWriter:
    """Commits each save to the local tier, then, when its step is due, to the root."""

    def __init__(
        self, root: Writer, local: Writer, box: LocalOutbox, persist_every: int, outbox: Outbox
    ) -> None:
        self.root = root
        self.local = local
        self.box = box
        self.persist_every = persist_every
        self.outbox = outbox

    def save(self, req: SaveReq) -> None:
        """Write and commit ``req`` to each tier it is due in; one :class:`SlabFree` once the
        last write is durable, then one :class:`SaveDone`, whatever happens."""
        done = self._local(req)
        if done.info is None:
            why = done.error or CheckpointError("the local tier's writer said nothing")
            self._failed(req, why)
        elif done.error is not None:  # committed; its retention pass failed
            self._failed(req, done.error)
        if req.step % self.persist_every == 0:
            self.root.save(req)  # frees the slab and ends the save, as without a tier
            return
        self._follow(req)
        self.outbox.send(SlabFree(req.slab))
        if done.info is None:
            err = CheckpointError(
                f"step {req.step} landed nowhere: it is due in the local tier only "
                f"(persist_every={self.persist_every}) and the local tier failed: {done.error}"
            )
            self.outbox.send(SaveDone(req.uuid, error=remote_error(err)))
            return
        # A step the root holds too is not gone when the local tier lets it go.
        deleted = tuple(s for s in done.deleted if s % self.persist_every != 0)
        self.outbox.send(SaveDone(req.uuid, info=done.info, deleted=deleted))

    def _local(self, req: SaveReq) -> SaveDone:
        """The local tier's commit of ``req``: its SaveDone, kept from the trainer."""
        self.box.done = None
        # The local tier has no lease; its signals are apart from the root commit's.
        local_req = replace(req, uuid=req.uuid + LOCAL_UUID, lease_generation=None)
        try:
            self.local.save(local_req)
        except BaseException as e:  # never leave the trainer's save without an end
            return SaveDone(req.uuid, error=e)
        return self.box.done or SaveDone(req.uuid)

    def _follow(self, req: SaveReq) -> None:
        """Keep the root writer's caches in step with a save it does not write: later saves
        name the layouts and fragments this one carried."""
        follow(self.root, req)

    def _failed(self, req: SaveReq, error: BaseException) -> None:
        self.outbox.event(
            "tier.failed",
            None,
            req.step,
            where="daemon",
            tier="local",
            detail=f"{type(error).__name__}: {error}",
        )


class TierView:
    """The local tier, the partners' replicas (where there are some) and the root as one
    read-only root, for loads and listings: a file the local tier holds is read from it,
    else from a partner that holds it, else from the root. Shard files are named by the
    attempt that wrote them, so a name found in a tier is that file; a step in several is
    read through the first one's manifest, which names its shards."""

    def __init__(
        self, local: Storage, root: Storage, emit: Emit | None = None, peer: PeerView | None = None
    ) -> None:
        self.local = local
        self.root = root
        self.peer = peer
        self.url = root.url
        self.emit = emit
        self._told: set[str] = set()  # the shard files whose tier this load has named
        #: The steps read from the root alone: the tiers hold them, but not every shard a
        #: load of them needs, and the root does (see TierCatalog._loadable).
        self.from_root: set[int] = set()

    def _pick(self, path: str) -> Storage | PeerView:
        storage: Storage | PeerView
        head, _, name = path.partition("/")
        if fmt.parse_step_dirname(head) in self.from_root:
            storage, tier = self.root, "root"
        elif self.local.exists(path):
            storage, tier = self.local, "local"
        elif self.peer is not None and self.peer.exists(path):
            storage, tier = self.peer, "peer"
        else:
            storage, tier = self.root, "root"
        if self.emit is not None:
            if name == fmt.MANIFEST:
                self._told.clear()  # a load reads its manifest first: a new load
            elif name.startswith("shard_") and path not in self._told:
                self._told.add(path)
                self.emit("load.tier", fmt.parse_step_dirname(head), tier, path)
        return storage

    def held(self, path: str) -> bool:
        """Whether this host's tier or a partner holds ``path``."""
        return self.local.exists(path) or (self.peer is not None and self.peer.exists(path))

    def read_range(self, path: str, start: int, end: int) -> bytes:
        return self._pick(path).read_range(path, start, end)

    def readinto(self, path: str, offset: int, out: memoryview) -> None:
        self._pick(path).readinto(path, offset, out)

    def size(self, path: str) -> int:
        return self._pick(path).size(path)

    def exists(self, path: str) -> bool:
        return self.held(path) or self.root.exists(path)

    def list_dir(self, path: str) -> list[str]:
        names = set(self.local.list_dir(path)) | set(self.root.list_dir(path))
        if self.peer is not None:
            names |= set(self.peer.list_dir(path))
        return sorted(names)

    def write_file(self, path: str, buffers: Sequence[memoryview]) -> None:
        raise StorageError("the tiers' view is read-only")

    def put_atomic(self, path: str, data: bytes) -> None:
        raise StorageError("the tiers' view is read-only")

    def makedirs(self, path: str) -> None:
        raise StorageError("the tiers' view is read-only")

    def delete(self, path: str, *, recursive: bool = False) -> None:
        raise StorageError("the tiers' view is read-only")

    def close(self) -> None:
        """Nothing: the tiers' storages are their owners' to close."""


class Tiers:
    """What a daemon with a local tier holds beyond a plain one."""

    def __init__(
        self,
        storage: LocalStorage,
        catalog: Catalog,
        writer: Writer,
        peers: Peers | None,
        peer_view: PeerView | None = None,
        say: Callable[[str, str], None] = lambda name, detail: None,
    ) -> None:
        #: The tier's tie to its root (see tie.py).
        self.tie = Tie(storage, catalog, say)
        self.storage = storage
        self.catalog = catalog
        self.writer = writer
        self.peers = peers
        self.peer_view = peer_view

    def delete(self, req: DeleteReq, root: Pruner) -> bool:
        """``delete(step)`` where there is a tier: the step goes from the tier and the root,
        wherever it lies, or it would come back from the one it was left in; whether it was
        in either. The checks are of both: a step in neither is not committed, and the
        newest of either is the one a resume loads (of one rank: several agree first)."""
        step, tier = req.step, self.writer.pruner
        if req.root:
            root.fence(f"delete step {step}")
        here = self.catalog.committed_steps()
        there = root.catalog.committed_steps() if req.root else []
        if step not in here and step not in there:
            if req.missing_ok:
                return False
            raise CheckpointNotFoundError(
                f"step {step} is not a committed checkpoint in {root.catalog.storage.url} "
                f"nor in its local tier {self.storage.root}"
            )
        if step == max(here + there) and not req.allow_latest:
            raise InvalidStepError(
                f"step {step} is the newest committed checkpoint, which a resume loads; pass "
                "allow_latest=True to delete it"
            )
        if step in there:  # a crash between the two leaves it in one: delete() again ends it
            root.delete(step, allow_latest=True)
        if step in here:
            tier.delete(step, allow_latest=True)
        return True

    def collect_partials(self, busy: Callable[[], Collection[int]]) -> list[int]:
        """Remove the local tier's partial steps, as the root's are."""
        return self.catalog.collect_partials(busy)

    def close(self) -> None:
        if self.peer_view is not None:
            self.peer_view.close()
        if self.peers is not None:
            self.peers.close()
        self.storage.close()


def leads_host(cfg: Hello) -> bool:
    """Whether this rank is its host's first: the one that commits and prunes its tier."""
    return first_of_host(cfg.hosts, cfg.rank)


class TierCatalog(Catalog):
    """The steps this rank can load: the root's, and those of its host's tier or of its
    partners' replicas whose manifest and every shard a load needs are there: its own, or
    every rank's where the step was saved by another number of ranks (a reshard reads from
    all of them). On several hosts a tier holds only the shards written there and its
    partners' copies; one process may open a tier several ranks wrote."""

    def __init__(
        self, view: TierView, rank: int, world_size: int, emit: Emit | None = None
    ) -> None:
        super().__init__(view)
        self.view = view
        self.rank = rank
        self.world_size = world_size
        self.emit = emit

    def where(self, path: str = "") -> str:
        """The URL of ``path`` where a load reads it: this host's tier, a partner's, the root."""
        if fmt.parse_step_dirname(path.partition("/")[0]) in self.view.from_root:
            return super().where(path)
        if path and self.view.local.exists(path):
            return f"{self.view.local.url.rstrip('/')}/{path}"
        if path and self.view.peer is not None and self.view.peer.exists(path):
            return self.view.peer.where(path)
        return super().where(path)

    def committed_steps(self) -> list[int]:
        if self.view.peer is not None:
            self.view.peer.refresh()  # what the partners hold now: they prune as they save
        steps = super().committed_steps()
        return [s for s in steps if self._loadable(s)]

    def _loadable(self, step: int) -> bool:
        """Whether a load of ``step`` here finds every shard it reads: through a tier's
        manifest, where a tier holds one, else through the root's (loaded as without a
        tier). A tier's step that lacks one, when the root has the step, is read from the
        root alone."""
        self.view.from_root.discard(step)
        if not self.view.held(manifest_path(step)):
            return True  # the root's
        try:
            m = self.read_manifest(step, lazy=True)
            needed = m.shards if m.world_size != self.world_size else [m.shard_of(self.rank)]
            why = ""
        except (CheckpointError, KeyError) as e:
            needed, why = [], f"its manifest does not read: {e}"
        head = fmt.step_dirname(step)
        lacking = [s.file for s in needed if not self.view.held(f"{head}/{s.file}")]
        if lacking and not why:
            where = "this host's tier" + ("" if self.view.peer is None else " and partners")
            why = f"{where} lack the shard(s) {', '.join(lacking)}"
        if not why:
            return True
        if self.view.root.exists(manifest_path(step)):
            self.view.from_root.add(step)
            return True
        self._incomplete(step, why)
        return False

    def _incomplete(self, step: int, why: str) -> None:
        if self.emit is not None:
            self.emit("tier.incomplete", step, "local", f"step {step} cannot load here: {why}")


def attach(d: Daemon) -> Tiers | None:
    """Give daemon ``d`` its local tier, when its Hello names one: a writer for the tier
    under a :class:`TieredWriter`, and loads and listings through a :class:`TierView`."""
    cfg: Hello = d.cfg
    tier: Any = cfg.local
    if tier is None:
        return None
    storage = open_local(tier.path)
    catalog = Catalog(storage)
    box = LocalOutbox(d.outbox)
    policy = LatestN(tier.keep) if leads_host(cfg) else None  # decided once a host
    pruner = Pruner(catalog, policy, d.in_flight, box)
    coord = local_coordinator(d, storage)
    local = Writer(
        catalog,
        replace(cfg, dedup=False),  # the local disk is fast: whole shards, no hashing
        slabs=d.slabs,
        windows=d.windows,
        pool=d.pool,
        coord=coord,
        pruner=pruner,
        outbox=box,
    )
    root = d.writer
    assert isinstance(root, Writer)
    d.writer = TieredWriter(root, local, box, cfg.persist_every, d.outbox)

    def emit(name: str, step: int | None, tier: str, detail: str) -> None:
        d.outbox.event(name, None, step, where="daemon", tier=tier, detail=detail)

    peers = replicas(d, storage, emit)
    if isinstance(coord, HostCoordinator):
        coord.peers = peers
    theirs = None
    if peers is not None:
        theirs = PeerView(peers, lambda name, step, detail: emit(name, step, "peer", detail))
    tiers_view = TierView(storage, d.storage, emit, theirs)
    view = TierCatalog(tiers_view, cfg.rank, cfg.world_size, emit)
    d.reader = Reader(view, d.slabs, d.pool)
    d.listing = view
    return Tiers(
        storage, catalog, local, peers, theirs, lambda n, detail: emit(n, None, "local", detail)
    )


def replicas(d: Daemon, storage: LocalStorage, emit: Emit) -> Peers | None:
    """This daemon's peer replicas, where its tier asks for some and there are other hosts
    (none on one host): its server up and its address in the job's store before the first
    save, listing or load."""
    cfg: Hello = d.cfg
    tier: Any = cfg.local
    targets = partners(cfg.hosts, cfg.rank, tier.replicas) if cfg.hosts else []
    if not targets or d.store_ops is None:
        return None
    assert cfg.dist_timeout is not None

    def say(name: str, step: int | None, detail: str) -> None:
        emit(name, step, "peer", detail)

    def credentials() -> tuple[bytes, str]:
        root_id = read_root_id(d.storage)
        if root_id is None:
            raise StorageError(f"{d.storage.url} has no id yet: its writer has not opened it")
        return read_peer_key(d.storage), root_id

    # The ranks whose partner this rank is: the only ones whose copies it takes.
    senders = [
        r for r in range(cfg.world_size) if cfg.rank in partners(cfg.hosts, r, tier.replicas)
    ]
    try:
        peers = Peers(
            storage, d.store_ops, cfg.rank, targets, cfg.dist_timeout, say, credentials, senders
        )
    except Exception as e:  # the tier goes on without this rank's replicas
        say("tier.failed", None, f"no peer replicas from rank {cfg.rank}: {e}")
        Peers.unreachable(d.store_ops, cfg.rank)
        return None
    return peers
