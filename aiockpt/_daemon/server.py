"""The daemon: a persistent subprocess that writes, commits, applies retention and reads.

Started by the trainer side as a fresh interpreter running ``main([PKG_PARENT, FD])`` with one
end of the pipe inherited as FD (``python -m aiockpt._daemon PKG_PARENT FD`` works too), so the
user's ``__main__`` is never re-imported. It imports neither torch nor the manager: tensors are
bytes in shared memory here.

Three threads: the main one receives and dispatches each message by its type; saves are
handled one at a time, in order, by the writer thread (:mod:`.writer`, then :mod:`.prune`);
lists and loads by the reader thread (:mod:`.reader` and the catalog), so a load never waits
behind a large write.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import signal
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any

from .._core.catalog import Catalog
from .._core.identity import claim_root, read_root_id
from .._core.leasekeeper import LeaseKeeper
from .._core.pipe import PipeEnd
from .._core.protocol import (
    CappedLoadReq,
    CappedWindowReq,
    CollectPartialsReq,
    CollectReq,
    DeleteReq,
    Hello,
    LeaseGrant,
    LoadReq,
    ProtocolMismatch,
    PublishFailureReq,
    ReadReq,
    Ready,
    RecordsReq,
    Reply,
    SafetensorsReq,
    SaveReq,
    SlabFree,
    StepRecord,
    StepsReq,
    Stop,
    StreamReq,
    StreamWindowReq,
    TierBindReq,
    WarmReq,
    WindowReady,
    check_protocol,
)
from .._core.shm import trainer_segments, unlink
from .._core.storeops import PipeStoreOps
from ..errors import DaemonStartError
from ..storage import CountingStorage, Storage, open_storage
from . import hfread, tiers
from .coord import Coordinator, no_fence
from .load import Reader
from .pipe import Outbox, remote_error
from .prune import Pruner
from .rendezvous import StoreRendezvous
from .shared import InFlight, Slabs, Windows
from .writer import Writer

__all__ = ["Daemon", "PipeEnd", "main"]


class Daemon:
    """One trainer's daemon: its root, its threads and their queues.

    ``storage`` is the root to serve; when None it is opened from ``cfg``."""

    def __init__(self, pipe: PipeEnd, cfg: Hello, storage: Storage | None = None) -> None:
        self.pipe = pipe
        self.cfg = cfg
        self.outbox = Outbox(pipe)
        opened = open_storage(cfg.url, cfg.storage_options) if storage is None else storage
        #: Every operation on the root is counted, per save too (see storage/_counting.py).
        self.storage = CountingStorage(opened)
        self.catalog = Catalog(self.storage)
        self.slabs = Slabs()
        self.windows = Windows(lambda name: self.outbox.send(SlabFree(name)))
        self.in_flight = InFlight()
        #: Checksums, next to the writer's writes and the reader's reads.
        self.pool = ThreadPoolExecutor(2, thread_name_prefix="aiockpt-crc")
        #: The root's lease, held by the daemon of rank 0 of a writing manager.
        self.lease = (
            LeaseKeeper(
                self.storage,
                cfg.lease,
                os.getpid(),
                trainer_pid=cfg.trainer_pid,
                emit=lambda name, **f: self.outbox.event(name, None, None, where="daemon", **f),
            )
            if cfg.lease
            else None
        )
        fence = self.lease.check if self.lease is not None else no_fence
        self.coord: Coordinator | None = None
        self.store_ops: PipeStoreOps | None = None
        if cfg.world_size > 1:
            assert cfg.dist_timeout is not None
            via = None
            if cfg.store_fd is not None:
                self.store_ops = PipeStoreOps(Connection(cfg.store_fd))
                via = StoreRendezvous(
                    self.store_ops, self.storage, cfg.rank, cfg.world_size, cfg.dist_timeout
                )
            self.coord = Coordinator(
                self.storage, cfg.rank, cfg.world_size, cfg.dist_timeout, fence=fence, via=via
            )
        policy = cfg.retention if cfg.rank == 0 else None  # decided once, by rank 0
        self.pruner = Pruner(self.catalog, policy, self.in_flight, self.outbox, fence=fence)
        self.writer: Writer | tiers.TieredWriter = Writer(
            self.catalog,
            cfg,
            slabs=self.slabs,
            windows=self.windows,
            pool=self.pool,
            coord=self.coord,
            pruner=self.pruner,
            outbox=self.outbox,
            fence=fence,
        )
        self.reader = Reader(self.catalog, self.slabs, self.pool)
        #: What steps() and best_step() list: the root, and the local tier where there is one.
        self.listing: Catalog = self.catalog
        self.tiers = tiers.attach(self)  # may put a tiered writer and reader in place
        #: Saves, and deletions (after the saves sent before them), for the writer thread.
        self.save_q: queue.Queue[SaveReq | DeleteReq | None] = queue.Queue()
        self.read_q: queue.Queue[ReadReq | None] = queue.Queue()
        self._handlers: dict[type[ReadReq], Callable[[Any], Any]] = {
            LoadReq: self.reader.load,
            CappedLoadReq: self.reader.capped,
            CappedWindowReq: self.reader.capped_window,
            StreamReq: self.reader.stream,
            StreamWindowReq: self.reader.stream_window,
            CollectReq: self.reader.collect,
            WarmReq: self._warm,
            StepsReq: self._steps,
            RecordsReq: self._records,
            CollectPartialsReq: self._collect_partials,
            PublishFailureReq: self._publish_failure,
            DeleteReq: self._delete,
            SafetensorsReq: self._safetensors,
            TierBindReq: self._bind_tier,
        }

    def start(self) -> LeaseGrant | None:
        """What is done before the daemon says it is ready: the lease taken (RootLockedError
        when another writer holds it), then the partial steps of earlier runs removed; the
        lease taken, if any."""
        grant = None
        if self.lease is not None:
            grant = self.lease.acquire()
            self.lease.start()
            self.root_id = claim_root(self.storage)
            if self.tiers is not None and not self.cfg.hosts:  # one process: its tier is its own
                self.tiers.tie.claim(self.root_id, self.storage.url)
        else:
            self.root_id = read_root_id(self.storage)
        if self.cfg.collect_partials:
            self.catalog.collect_partials(self.in_flight.snapshot)
            if self.tiers is not None:
                self.tiers.collect_partials(self.in_flight.snapshot)
        return grant

    #: The root's id, once :meth:`start` has read it (or made it, as the lease's holder).
    root_id: str | None = None

    # ----------------------------------------------------------------- reads

    def handle(self, req: ReadReq) -> Any:
        """Answer one read-side request: the value of its :class:`Reply`."""
        handler = self._handlers.get(type(req))
        if handler is None:
            raise TypeError(f"the daemon has no handler for {type(req).__name__}")
        return handler(req)

    def _warm(self, req: WarmReq) -> None:
        self.reader.warm(req.step, req.rank, req.world_size)

    def _safetensors(self, req: SafetensorsReq) -> Any:
        # A Hugging Face safetensors source, opened for this request alone (see hfread).
        source = hfread.Source(req.source, req.storage_options)
        try:
            if req.read is None:
                return hfread.describe(source)
            return hfread.read(source, list(req.read), self.reader.load_segments, self.pool)
        finally:
            source.close()

    def _steps(self, req: StepsReq) -> tuple[int, ...]:
        return tuple(self.listing.committed_steps())

    def _records(self, req: RecordsReq) -> tuple[StepRecord, ...]:
        return tuple(StepRecord(r.step, r.time, r.metrics) for r in self.listing.records())

    def _collect_partials(self, req: CollectPartialsReq) -> tuple[int, ...]:
        if self.lease is not None:
            self.lease.check("remove partial steps")
        removed = self.catalog.collect_partials(self.in_flight.snapshot) if req.root else []
        if self.tiers is not None:
            self.tiers.collect_partials(self.in_flight.snapshot)
        return tuple(removed)

    def _delete(self, req: DeleteReq) -> bool:
        if self.tiers is not None:
            return self.tiers.delete(req, self.pruner)
        self.pruner.delete(req.step, req.allow_latest)
        return True

    def _bind_tier(self, req: TierBindReq) -> str:
        if self.tiers is None:
            raise TypeError("this daemon has no local tier")
        return self.tiers.tie.bind(req, self.storage.url)

    def _publish_failure(self, req: PublishFailureReq) -> None:
        # A respawned daemon tells the other ranks that its predecessor's save failed.
        if self.coord is not None:
            self.coord.publish_failure(req.step, req.uuid, req.message)

    # ----------------------------------------------------------------- threads

    def save_loop(self) -> None:
        """The writer thread: each save in order, until the None that ends the queue."""
        while (req := self.save_q.get()) is not None:
            if isinstance(req, DeleteReq):
                self.answer(req)
                continue
            try:
                self.writer.save(req)
            finally:
                self.in_flight.discard(req.step)

    def answer(self, req: ReadReq) -> None:
        """Handle ``req`` and send its :class:`Reply`, whatever happens."""
        try:
            reply = Reply(req.id, value=self.handle(req))
        except BaseException as e:
            reply = Reply(req.id, error=remote_error(e))
        try:
            self.outbox.send(reply)
        except Exception as e:  # e.g. a reply that cannot be pickled: never hang the caller
            self.reader.early.drop()  # nor read into a slab it takes back on hearing this
            self.outbox.send(Reply(req.id, error=remote_error(e)))

    def read_loop(self) -> None:
        """The reader thread: each request answered, until the None that ends the queue."""
        while (req := self.read_q.get()) is not None:
            self.answer(req)
            self.reader.early.read()  # a load answered early reads its bytes now

    def serve(self) -> int:
        """Receive and dispatch until asked to stop or the trainer is gone; then finish what
        is queued, clean up and return the exit code."""
        writer = threading.Thread(target=self.save_loop, name="aiockpt-writer")
        reader = threading.Thread(target=self.read_loop, name="aiockpt-reader")
        writer.start()
        reader.start()
        trainer_gone = False
        while True:
            try:
                msg = self.pipe.recv()
            except (EOFError, OSError):
                trainer_gone = True
                break
            if isinstance(msg, SaveReq):
                self.in_flight.add(msg.step)  # before the writer sees it: see InFlight
                self.save_q.put(msg)
            elif isinstance(msg, DeleteReq):
                self.save_q.put(msg)
            elif isinstance(msg, WindowReady):
                self.windows.put(msg)
            elif isinstance(msg, ReadReq):
                self.read_q.put(msg)
            elif isinstance(msg, Stop):
                break
        # Staged saves still commit, whether we were asked to stop or the trainer died; one
        # still being staged in windows can never be finished.
        self.windows.close()
        self.save_q.put(None)
        self.read_q.put(None)
        writer.join()
        reader.join()
        self.close(trainer_gone=trainer_gone)
        return 0

    def close(self, *, trainer_gone: bool = False) -> None:
        """Release what the daemon holds, once its threads are done."""
        if self.lease is not None:
            with contextlib.suppress(Exception):  # not released: it expires by its TTL
                self.lease.close(release=True)
        self.pool.shutdown()
        self.slabs.close()
        if trainer_gone:
            # Nobody else will unlink the trainer's segments now: those we attached, and any
            # it was still filling (never announced to us), found by the creator's pid.
            for name in self.slabs.names():
                unlink(name)
            for name in trainer_segments(self.cfg.trainer_pid):
                unlink(name)
        self.reader.close()
        self.storage.close()
        if self.tiers is not None:
            self.tiers.close()
        if self.store_ops is not None:
            self.store_ops.close()


def with_retention(hello: Hello) -> Hello:
    """``hello`` with its retention policy unpickled (Hello.retention_pickle), its module
    imported from the trainer's ``sys.path``: after aiockpt's own folder (first on the path,
    so aiockpt is the trainer's), in the trainer's order, then what the daemon had besides.
    A policy whose module cannot be imported fails the start, naming it."""
    if hello.retention_pickle is None:
        return hello
    own = sys.path[1:]
    sys.path[1:] = [*hello.sys_path, *(p for p in own if p not in hello.sys_path)]
    try:
        policy = pickle.loads(hello.retention_pickle)
    except Exception as e:
        raise DaemonStartError(
            f"the daemon could not import the retention policy: {type(e).__name__}: {e}; "
            "its module must be importable from the trainer's sys.path, and import without "
            "the trainer's __main__"
        ) from None
    return replace(hello, retention=policy, retention_pickle=None)


def main(argv: list[str]) -> int:
    """Serve the trainer at the other end of the pipe inherited as file descriptor argv[1]."""
    pipe = PipeEnd(Connection(int(argv[1])))
    with contextlib.suppress(AttributeError, OSError):
        os.nice(10)  # the trainer comes first when the two contend for a core
    # The daemon shares its trainer's process group and job, so Ctrl-C, a terminal's hang-up
    # and a scheduler's SIGTERM to every process of the job (Slurm's scancel, a killpg) reach
    # it too. Its life is its pipe's: it ends when the trainer stops it (on_sigterm="flush"
    # does, once what was staged has committed) or is gone (it first commits what it was
    # given), never in the middle of a save on their account. SIGKILL still ends it.
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    daemon = None
    try:
        hello = pipe.recv()
        check_protocol(getattr(hello, "protocol", None), "trainer")
        if not isinstance(hello, Hello):
            raise ProtocolMismatch(f"the trainer sent {type(hello).__name__} instead of Hello")
        daemon = Daemon(pipe, with_retention(hello))
        grant = daemon.start()
    except BaseException as e:
        with contextlib.suppress(Exception):
            pipe.send(Ready(os.getpid(), error=remote_error(e)))
        if daemon is not None:  # it may hold the lease (partials failed to go, say)
            daemon.close()
        return 1
    try:
        pipe.send(Ready(os.getpid(), lease=grant, root_id=daemon.root_id))
    except (OSError, EOFError, ValueError):
        # The trainer is gone before it heard we were ready (killed, or its open() was
        # cancelled): nobody will ever stop us, so leave nothing held, lease nor slabs.
        daemon.close(trainer_gone=True)
        return 1
    return daemon.serve()
