"""The daemon: a persistent subprocess that writes, commits, applies retention and reads.

Started as a fresh interpreter running ``main([PKG_PARENT, FD])`` with one end of the pipe
inherited as FD (see _manager._DAEMON_BOOT; ``python -m aiockpt._daemon FD`` works too), so the
user's ``__main__`` is never re-imported. It imports neither torch nor the manager: tensors are
bytes in shared memory here. Saves are handled one at a time, in order, by a writer thread;
lists and loads by a reader thread, so a load never waits behind a large write.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

import crc32c

from .._core import format as fmt
from .._core.gc import no_gc
from .._core.protocol import (
    CheckpointInfo,
    CollectPartialsReq,
    EventMsg,
    Hello,
    LayoutMsg,
    LoadReply,
    LoadReq,
    ProtocolMismatch,
    PublishFailureReq,
    ReadReq,
    Ready,
    RecordsReq,
    Reply,
    SaveDone,
    SaveReq,
    SlabFree,
    SlabRef,
    StepRecord,
    StepsReq,
    Stop,
    check_protocol,
)
from .._core.shm import Segment, trainer_segments, unlink
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DistributedSaveError,
    StepExistsError,
)
from ..retention import CheckpointRecord, select_deletions
from .coord import Coordinator, Part, merge

#: Loads read this much at a time, checksumming what was read while the next chunk comes.
LOAD_CHUNK = 64 * 1024 * 1024
#: A manifest larger than this is refused before it is read.
MAX_MANIFEST_BYTES = 1 << 30


def crc(buf: memoryview, value: int = 0) -> int:
    return crc32c.crc32c(buf, value)


def remote_error(exc: BaseException) -> BaseException:
    """The exception to send up the pipe: aiockpt errors as they are, others wrapped."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    if isinstance(exc, CheckpointError):
        err: BaseException = exc
    else:
        err = CheckpointError(f"the daemon failed: {type(exc).__name__}: {exc}")
    err.remote_traceback = tb  # type: ignore[attr-defined]
    err.__traceback__ = None
    err.__cause__ = err.__context__ = None
    return err


class _Layout:
    """A layout the daemon knows, with what it caches for it."""

    def __init__(self, msg: LayoutMsg) -> None:
        self.msg = msg
        self.specs = [fmt.TensorSpec(*s) for s in msg.specs]
        self._json_parts: list[str] | None = None

    def json_parts(self) -> list[str]:
        if self._json_parts is None:
            self._json_parts = fmt.tensors_json_parts(self.specs, self.msg.data_start)
        return self._json_parts


class PipeEnd:
    """The daemon's end of the pipe: ``send`` from any thread, ``recv`` from the main one."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, msg: object) -> None:
        with self._lock:
            self.conn.send(msg)

    def recv(self) -> object:
        return self.conn.recv()


class Daemon:
    def __init__(self, pipe: PipeEnd, cfg: Hello) -> None:
        self.pipe = pipe
        self.cfg = cfg
        self.slabs: dict[str, Segment] = {}
        self.layouts: dict[int, _Layout] = {}
        #: Encoded state-tree fragments by id (see SaveReq.fragments).
        self.fragments: dict[int, str] = {}
        self.load_segments: set[str] = set()
        #: Retention's records of committed steps; filled by the first retention pass.
        self.index: dict[int, CheckpointRecord] = {}
        self.indexed = False
        self.in_flight: set[int] = set()
        self.lock = threading.Lock()  # guards index and in_flight
        self.peer_gone = False
        self.save_q: queue.Queue[SaveReq | None] = queue.Queue()
        self.read_q: queue.Queue[ReadReq | None] = queue.Queue()
        self.pool = ThreadPoolExecutor(2, thread_name_prefix="aiockpt-crc")
        self.shard = fmt.shard_filename(cfg.rank)
        self.coord: Coordinator | None = None
        from ..storage import open_storage

        self.storage = open_storage(cfg.url, cfg.storage_options)
        if cfg.world_size > 1:
            assert cfg.dist_timeout is not None
            self.coord = Coordinator(self.storage, cfg.rank, cfg.world_size, cfg.dist_timeout)

    # ----------------------------------------------------------------- plumbing

    def send(self, msg: object) -> None:
        if self.peer_gone:
            return
        try:
            self.pipe.send(msg)
        except (OSError, EOFError, ValueError):
            self.peer_gone = True  # the trainer died: finish what is staged, quietly

    def event(self, name: str, uuid: str | None, step: int | None, **fields: Any) -> None:
        fields.setdefault("time", time.time())
        self.send(EventMsg(name, uuid, step, fields))

    # ----------------------------------------------------------------- start-up

    def start(self) -> None:
        if self.cfg.collect_partials:
            self.collect_partials()

    def committed_steps(self) -> list[int]:
        """Steps whose manifest exists, fresh from storage."""
        steps = []
        for name in self.storage.list_dir(""):
            step = fmt.parse_step_dirname(name)
            if step is not None and self.storage.exists(f"{name}/{fmt.MANIFEST}"):
                steps.append(step)
        return sorted(steps)

    def read_manifest(self, step: int) -> fmt.Manifest:
        data, where = self._manifest_bytes(step)
        return fmt.parse_manifest(data, path=where, step=step)

    def read_record(self, step: int) -> CheckpointRecord:
        """The step's commit time and metrics, without checking the rest of its manifest."""
        data, where = self._manifest_bytes(step)
        created_at, metrics = fmt.parse_manifest_record(data, path=where, step=step)
        return CheckpointRecord(step, created_at, dict(metrics))

    def _manifest_bytes(self, step: int) -> tuple[bytes, str]:
        path = f"{fmt.step_dirname(step)}/{fmt.MANIFEST}"
        size = self.storage.size(path)
        where = f"{self.storage.url.rstrip('/')}/{path}"
        if size > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(
                f"{where}: manifest of {size} bytes is too large", path=where
            )
        return self.storage.read_range(path, 0, size), where

    def scan_index(self) -> None:
        """What retention sees of earlier runs: every committed checkpoint whose record reads.
        Done by the first retention pass, not at start-up: a run may hold hundreds of
        checkpoints, and a manager must open without reading each one."""
        for step in self.committed_steps():
            if step not in self.index:
                with contextlib.suppress(CorruptCheckpointError):
                    record = self.read_record(step)
                    with self.lock:
                        self.index.setdefault(step, record)
        self.indexed = True

    def collect_partials(self) -> list[int]:
        """Remove step directories without a manifest (a crash mid-save) below the newest
        committed step; see :func:`collectable_partials` for why newer ones stay."""
        from ..retention import collectable_partials

        step_dirs = {}
        for name in self.storage.list_dir(""):
            step = fmt.parse_step_dirname(name)
            if step is not None:
                step_dirs[step] = self.storage.exists(f"{name}/{fmt.MANIFEST}")
        with self.lock:
            busy = set(self.in_flight)
        removed = []
        for step in collectable_partials(step_dirs, busy):
            self.storage.delete(fmt.step_dirname(step), recursive=True)
            removed.append(step)
        return removed

    # ----------------------------------------------------------------- saves

    def slab(self, name: str, size: int) -> Segment:
        seg = self.slabs.get(name)
        if seg is None or seg.size < size:
            if seg is not None:
                seg.close()
            seg = self.slabs[name] = Segment.attach(name, size)
        return seg

    def forget(self, names: tuple[str, ...]) -> None:
        for name in names:
            seg = self.slabs.pop(name, None)
            if seg is not None:
                seg.close()

    def save_loop(self) -> None:
        while (req := self.save_q.get()) is not None:
            try:
                self.save(req)
            finally:
                with self.lock:
                    self.in_flight.discard(req.step)

    def save(self, req: SaveReq) -> None:
        t0 = time.monotonic()
        slab_free = False
        step_dir = fmt.step_dirname(req.step)
        created_dir = False
        try:
            if req.layout is not None:
                self.layouts[req.layout.id] = _Layout(req.layout)
            for i, node in req.fragments.items():
                self.fragments[i] = fmt.encode_tree(node, {})
            tree = fmt.encode_tree(req.tree, self.fragments)
            layout = self.layouts[req.layout_id]
            for i in req.forget_fragments:
                self.fragments.pop(i, None)
            for i in req.forget_layouts:
                self.layouts.pop(i, None)
            self.forget(req.forget)
            seg = self.slab(req.slab, req.slab_size)
            if self.storage.exists(f"{step_dir}/{fmt.MANIFEST}"):
                raise StepExistsError(f"step {req.step} is already committed in {self.storage.url}")
            self.storage.makedirs(step_dir)
            created_dir = True
            with seg.buf[: layout.msg.file_size] as data:
                crcs = self.pool.submit(self.checksums, data, layout)
                try:
                    self.storage.write_file(f"{step_dir}/{self.shard}", [data])
                finally:
                    tensors, shard_crc = crcs.result()
            self.send(SlabFree(req.slab))
            slab_free = True
            written = time.monotonic()
            nbytes = layout.msg.file_size
            self.event(
                "save.written",
                req.uuid,
                req.step,
                duration_s=written - t0,
                nbytes=nbytes,
                where="daemon",
            )
            shard = {
                "file": self.shard,
                "rank": self.cfg.rank,
                "nbytes": nbytes,
                "crc32c": shard_crc,
            }
            part = Part(self.cfg.rank, shard, tensors, tree)
            if self.coord is None:
                created_at = time.time()
                manifest = merge(
                    [part],
                    step=req.step,
                    created_at=created_at,
                    metrics=req.metrics,
                    metadata=req.metadata,
                )
                self.storage.put_atomic(f"{step_dir}/{fmt.MANIFEST}", manifest)
            else:
                created_dir = False  # other ranks write here too: never removed by one of them
                created_at = self.coord.commit(
                    step=req.step,
                    uuid=req.uuid,
                    part=part,
                    metrics=req.metrics,
                    metadata=req.metadata,
                )
            created_dir = False  # committed: never cleaned up as a partial
            with self.lock:
                self.index[req.step] = CheckpointRecord(req.step, created_at, dict(req.metrics))
            self.event(
                "save.committed",
                req.uuid,
                req.step,
                duration_s=time.monotonic() - written,
                nbytes=nbytes,
                where="daemon",
            )
            info = CheckpointInfo(
                step=req.step,
                url=f"{self.storage.url.rstrip('/')}/{step_dir}",
                created_at=created_at,
                nbytes=nbytes,
                metrics=req.metrics,
            )
            deleted, error = self.apply_retention(req.uuid, req.step)
            if self.coord is not None and self.cfg.rank == 0:
                self.coord.finished(req.step, req.uuid)  # the others' handles resolve now
            self.send(SaveDone(req.uuid, info=info, deleted=tuple(deleted), error=error))
        except BaseException as e:
            if not slab_free:
                self.send(SlabFree(req.slab))
            if self.coord is not None and not isinstance(e, DistributedSaveError):
                with contextlib.suppress(Exception):
                    self.coord.publish_failure(req.step, req.uuid, f"{type(e).__name__}: {e}")
            if created_dir:
                with contextlib.suppress(Exception):
                    self.storage.delete(step_dir, recursive=True)
            self.send(SaveDone(req.uuid, error=remote_error(e)))

    @staticmethod
    def checksums(data: memoryview, layout: _Layout) -> tuple[str, int]:
        """The manifest's tensor entries with their crcs, and the shard's crc: computed while
        the shard is written, so the commit only splices text."""
        base = layout.msg.data_start
        tensor_crcs = [crc(data[base + s.start : base + s.end]) for s in layout.specs]
        shard_crc = crc(data)
        return fmt.tensors_json(layout.specs, base, tensor_crcs, layout.json_parts()), shard_crc

    def apply_retention(self, uuid: str, step: int) -> tuple[list[int], BaseException | None]:
        """Delete what the policy lets go, manifest first. Runs only after the commit of
        ``step``, which it never deletes (nor the newest step, nor one in flight)."""
        policy = self.cfg.retention
        if policy is None or self.cfg.rank != 0:  # decided once, by rank 0
            return [], None
        try:
            if not self.indexed:
                self.scan_index()
            # Steps deleted behind our back (``aiockpt prune``) must not count for the policy.
            # A stale listing can only hide steps, and a hidden step is never deleted.
            present = {fmt.parse_step_dirname(name) for name in self.storage.list_dir("")}
        except Exception as e:
            err = CheckpointError(
                f"step {step} was committed, but retention could not list {self.storage.url}: "
                f"{e}; nothing was deleted"
            )
            return [], remote_error(err)
        with self.lock:
            for gone in [s for s in self.index if s not in present and s != step]:
                del self.index[gone]
            records = list(self.index.values())
            protected = {step, *self.in_flight}
        try:
            doomed = select_deletions(policy, records, protected)
        except Exception as e:
            err = CheckpointError(
                f"step {step} was committed, but the retention policy {policy!r} failed: "
                f"{type(e).__name__}: {e}; nothing was deleted"
            )
            return [], remote_error(err)
        deleted = []
        try:
            for old in doomed:
                name = fmt.step_dirname(old)
                self.storage.delete(f"{name}/{fmt.MANIFEST}")  # uncommit first
                with self.lock:
                    self.index.pop(old, None)
                deleted.append(old)
                self.storage.delete(name, recursive=True)
                self.event("retention.delete", uuid, old, where="daemon")
        except Exception as e:  # whatever it is, the commit stands and the caller must hear it
            err = CheckpointError(f"step {step} was committed, but retention failed to delete: {e}")
            return deleted, remote_error(err)
        return deleted, None

    # ----------------------------------------------------------------- reads

    def handle(self, req: ReadReq) -> Any:
        """Answer one read-side request: the value of its :class:`Reply`."""
        if isinstance(req, LoadReq):
            return self.op_load(req.step, req.rank, req.world_size, req.slab)
        if isinstance(req, StepsReq):
            return tuple(self.op_steps())
        if isinstance(req, RecordsReq):
            return tuple(self.op_records())
        if isinstance(req, CollectPartialsReq):
            return tuple(self.op_collect_partials())
        if isinstance(req, PublishFailureReq):
            return self.op_publish_failure(req.step, req.uuid, req.message)
        raise TypeError(f"the daemon has no handler for {type(req).__name__}")

    def read_loop(self) -> None:
        while (req := self.read_q.get()) is not None:
            try:
                reply = Reply(req.id, value=self.handle(req))
            except BaseException as e:
                reply = Reply(req.id, error=remote_error(e))
            try:
                self.send(reply)
            except Exception as e:  # e.g. a reply that cannot be pickled: never hang the caller
                self.send(Reply(req.id, error=remote_error(e)))

    def op_steps(self) -> list[int]:
        return self.committed_steps()

    def op_records(self) -> list[StepRecord]:
        """The record of every readable committed checkpoint."""
        out = []
        for step in self.committed_steps():
            with contextlib.suppress(CorruptCheckpointError):
                r = self.read_record(step)
                out.append(StepRecord(r.step, r.time, r.metrics))
        return out

    def op_collect_partials(self) -> list[int]:
        return self.collect_partials()

    def op_publish_failure(self, step: int, uuid: str, message: str) -> None:
        """A respawned daemon tells the other ranks that its predecessor's save failed."""
        if self.coord is not None:
            self.coord.publish_failure(step, uuid, message)

    @staticmethod
    def _check_crcs(
        seg: Segment, items: list[tuple[str, fmt.TensorRecord]], lo: int, where: str
    ) -> None:
        for name, r in items:
            with seg.buf[r.start - lo : r.end - lo] as view:
                if crc(view) != r.crc32c:
                    raise CorruptCheckpointError(
                        f"{where}: tensor {name!r} failed its crc32c check", path=where, key=name
                    )

    @staticmethod
    def check_replicated(m: fmt.Manifest, world_size: int) -> None:
        """On another world size only state that every rank saved identically can be loaded."""
        first = m.tensors[m.shard_of(0).file]
        differ = sorted(
            name
            for name, r in first.items()
            if any(
                (o := others.get(name)) is None
                or (o.crc32c, o.dtype, o.shape) != (r.crc32c, r.dtype, r.shape)
                for others in m.tensors.values()
            )
        )
        if differ:
            shown = ", ".join(differ[:8]) + (", …" if len(differ) > 8 else "")
            raise CheckpointError(
                f"step {m.step} was saved by {m.world_size} ranks and cannot be loaded by "
                f"{world_size}: these tensors differ between ranks (only state every rank saved "
                f"identically, such as DDP-replicated weights, can be): {shown}"
            )

    @no_gc
    def op_load(
        self,
        step: int | None,
        rank: int,
        world_size: int = 1,
        slab: SlabRef | None = None,
    ) -> LoadReply:
        """Read and verify a rank's tensors into shared memory: into the trainer's ``slab``
        when given and large enough, else into a new segment the trainer takes over."""
        steps = self.committed_steps()
        if not steps:
            raise CheckpointNotFoundError(f"no committed checkpoint in {self.storage.url}")
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise CheckpointNotFoundError(
                f"step {step} is not a committed checkpoint in {self.storage.url} (committed: "
                f"{_ranges(steps)})"
            )
        m = self.read_manifest(step)
        if m.world_size != world_size:
            rank = 0  # every rank reads rank 0's part, if it is the same on every rank
            self.check_replicated(m, world_size)
        shard = m.shard_of(rank)
        records = m.tensors[shard.file]
        path = f"{fmt.step_dirname(step)}/{shard.file}"
        where = f"{self.storage.url.rstrip('/')}/{path}"
        if not self.storage.exists(path):
            raise CorruptCheckpointError(f"{where}: the shard is missing", path=where)
        actual = self.storage.size(path)
        if actual != shard.nbytes:
            raise CorruptCheckpointError(
                f"{where}: {actual} bytes on storage, the manifest says {shard.nbytes}", path=where
            )
        fmt.check_tree(m.trees[rank], set(records), path=where)
        lo = min((r.start for r in records.values()), default=0)
        hi = max((r.end for r in records.values()), default=0)
        pooled = slab is not None and slab.size >= hi - lo
        if pooled:
            assert slab is not None
            seg = self.slab(slab.name, slab.size)
        else:
            seg = Segment.create(hi - lo, kind="load", populate=False)
            self.load_segments.add(seg.name)
        try:
            # Read in chunks and checksum each chunk's finished tensors in another thread
            # while the next chunk is read (crc32c releases the GIL): the check overlaps I/O.
            by_end = sorted(records.items(), key=lambda item: item[1].end)
            checks, done = [], 0
            for off in range(0, hi - lo, LOAD_CHUNK):
                end = min(off + LOAD_CHUNK, hi - lo)
                self.storage.readinto(path, lo + off, seg.buf[off:end])
                first = done
                while done < len(by_end) and by_end[done][1].end - lo <= end:
                    done += 1
                checks.append(
                    self.pool.submit(self._check_crcs, seg, by_end[first:done], lo, where)
                )
            if done < len(by_end):  # empty tensors past the last byte read
                checks.append(self.pool.submit(self._check_crcs, seg, by_end[done:], lo, where))
            for check in checks:
                check.result()
            tensors = {name: (r.dtype, r.shape, r.start - lo) for name, r in records.items()}
        except BaseException:
            if not pooled:
                seg.close()
                seg.unlink()
                self.load_segments.discard(seg.name)
            raise
        if not pooled:
            seg.close()  # the trainer maps it and takes it over
        return LoadReply(
            step=step,
            segment=None if pooled else seg.name,
            size=hi - lo,
            tensors=tensors,
            tree=m.trees[rank],
            metrics=m.metrics,
            metadata=m.metadata,
            created_at=m.created_at,
            nbytes=m.nbytes,
            url=f"{self.storage.url.rstrip('/')}/{fmt.step_dirname(step)}",
        )

    # ----------------------------------------------------------------- main loop

    def serve(self) -> int:
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
                with self.lock:
                    self.in_flight.add(msg.step)
                self.save_q.put(msg)
            elif isinstance(msg, ReadReq):
                self.read_q.put(msg)
            elif isinstance(msg, Stop):
                break
        # Staged saves still commit, whether we were asked to stop or the trainer died.
        self.save_q.put(None)
        self.read_q.put(None)
        writer.join()
        reader.join()
        self.pool.shutdown()
        for seg in self.slabs.values():
            seg.close()
        if trainer_gone:
            # Nobody else will unlink the trainer's segments now: those we attached, and any
            # it was still filling (never announced to us), found by the creator's pid.
            for name in self.slabs:
                unlink(name)
            for name in trainer_segments(self.cfg.trainer_pid):
                unlink(name)
        for name in self.load_segments:
            unlink(name)
        self.storage.close()
        return 0


def _ranges(steps: list[int]) -> str:
    shown = ", ".join(map(str, steps[-10:]))
    return shown if len(steps) <= 10 else f"…, {shown}"


def main(argv: list[str]) -> int:
    """Serve the trainer at the other end of the pipe inherited as file descriptor argv[1]."""
    pipe = PipeEnd(Connection(int(argv[1])))
    with contextlib.suppress(AttributeError, OSError):
        os.nice(10)  # the trainer comes first; measured: trainer CPU share up when contended
    try:
        hello = pipe.recv()
        check_protocol(getattr(hello, "protocol", None), "trainer")
        if not isinstance(hello, Hello):
            raise ProtocolMismatch(f"the trainer sent {type(hello).__name__} instead of Hello")
        daemon = Daemon(pipe, hello)
        daemon.start()
    except BaseException as e:
        with contextlib.suppress(Exception):
            pipe.send(Ready(os.getpid(), error=remote_error(e)))
        return 1
    pipe.send(Ready(os.getpid()))
    return daemon.serve()
