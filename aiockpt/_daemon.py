"""The daemon: a persistent subprocess that writes, commits, applies retention and reads.

Started as ``python -m aiockpt._daemon FD`` with one end of the pipe inherited as FD, so the
user's ``__main__`` is never re-imported. It imports neither torch nor the manager: tensors are
bytes in shared memory here. Saves are handled one at a time, in order, by a writer thread;
lists and loads by a reader thread, so a load never waits behind a large write.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

import crc32c

from . import _format as fmt
from ._channel import (
    Channel,
    DaemonConfig,
    EventMsg,
    LayoutMsg,
    Ready,
    Reply,
    Request,
    SaveDone,
    SaveReq,
    SlabFree,
    Stop,
)
from ._shm import Segment, unlink
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StepExistsError,
)
from .retention import CheckpointRecord, select_deletions

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


class Daemon:
    def __init__(self, chan: Channel, cfg: DaemonConfig) -> None:
        self.chan = chan
        self.cfg = cfg
        self.slabs: dict[str, Segment] = {}
        self.layouts: dict[int, _Layout] = {}
        self.load_segments: set[str] = set()
        self.index: dict[int, CheckpointRecord] = {}
        self.in_flight: set[int] = set()
        self.lock = threading.Lock()  # guards index and in_flight
        self.peer_gone = False
        self.save_q: queue.Queue[SaveReq | None] = queue.Queue()
        self.read_q: queue.Queue[Request | None] = queue.Queue()
        self.pool = ThreadPoolExecutor(2, thread_name_prefix="aiockpt-crc")
        self.shard = fmt.shard_filename(cfg.rank)
        from .storage import open_storage

        self.storage = open_storage(cfg.url, cfg.storage_options)

    # ----------------------------------------------------------------- plumbing

    def send(self, msg: object) -> None:
        if self.peer_gone:
            return
        try:
            self.chan.send(msg)
        except (OSError, EOFError, ValueError):
            self.peer_gone = True  # the trainer died: finish what is staged, quietly

    def event(self, name: str, uuid: str | None, step: int | None, **fields: Any) -> None:
        fields.setdefault("time", time.time())
        self.send(EventMsg(name, uuid, step, fields))

    # ----------------------------------------------------------------- start-up

    def start(self) -> None:
        self.scan_index()
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
        path = f"{fmt.step_dirname(step)}/{fmt.MANIFEST}"
        size = self.storage.size(path)
        where = f"{self.storage.url.rstrip('/')}/{path}"
        if size > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(
                f"{where}: manifest of {size} bytes is too large", path=where
            )
        return fmt.parse_manifest(self.storage.read_range(path, 0, size), path=where, step=step)

    def scan_index(self) -> None:
        """What retention sees of earlier runs: every readable committed checkpoint."""
        for step in self.committed_steps():
            with contextlib.suppress(CorruptCheckpointError):
                m = self.read_manifest(step)
                self.index[step] = CheckpointRecord(step, m.created_at, dict(m.metrics))

    def collect_partials(self) -> list[int]:
        """Remove step directories without a manifest (a crash mid-save), except in-flight ones."""
        removed = []
        for name in self.storage.list_dir(""):
            step = fmt.parse_step_dirname(name)
            if step is None or step in self.in_flight:
                continue
            if not self.storage.exists(f"{name}/{fmt.MANIFEST}"):
                self.storage.delete(name, recursive=True)
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
            self.forget(req.forget)
            layout = self.layouts[req.layout_id]
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
                    tensor_crcs, shard_crc = crcs.result()
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
            created_at = time.time()
            tensors = fmt.tensors_json(layout.specs, layout.msg.data_start, tensor_crcs)
            tree = json.dumps(req.tree, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
            manifest = fmt.manifest_json(
                step=req.step,
                created_at=created_at,
                world_size=1,
                shards=[
                    {
                        "file": self.shard,
                        "rank": self.cfg.rank,
                        "nbytes": nbytes,
                        "crc32c": shard_crc,
                    }
                ],
                tensors_json=f'{{"{self.shard}":{tensors}}}',
                trees_json=f'{{"{self.cfg.rank}":{tree}}}',
                metrics=req.metrics,
                metadata=req.metadata,
            )
            self.storage.put_atomic(f"{step_dir}/{fmt.MANIFEST}", manifest)
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
            info = {
                "step": req.step,
                "url": f"{self.storage.url.rstrip('/')}/{step_dir}",
                "created_at": created_at,
                "nbytes": nbytes,
                "metrics": req.metrics,
            }
            deleted, error = self.apply_retention(req.uuid, req.step)
            self.send(SaveDone(req.uuid, info=info, deleted=tuple(deleted), error=error))
        except BaseException as e:
            if not slab_free:
                self.send(SlabFree(req.slab))
            if created_dir:
                with contextlib.suppress(Exception):
                    self.storage.delete(step_dir, recursive=True)
            self.send(SaveDone(req.uuid, error=remote_error(e)))

    @staticmethod
    def checksums(data: memoryview, layout: _Layout) -> tuple[list[int], int]:
        base = layout.msg.data_start
        tensor_crcs = [crc(data[base + s.start : base + s.end]) for s in layout.specs]
        return tensor_crcs, crc(data)

    def apply_retention(self, uuid: str, step: int) -> tuple[list[int], BaseException | None]:
        """Delete what the policy lets go, manifest first. Runs only after a commit."""
        policy = self.cfg.retention
        if policy is None:
            return [], None
        with self.lock:
            records = list(self.index.values())
            protected = set(self.in_flight)
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
        except CheckpointError as e:
            err = CheckpointError(f"step {step} was committed, but retention failed to delete: {e}")
            return deleted, remote_error(err)
        return deleted, None

    # ----------------------------------------------------------------- reads

    def read_loop(self) -> None:
        while (req := self.read_q.get()) is not None:
            try:
                value = getattr(self, f"op_{req.op}")(**req.args)
            except BaseException as e:
                self.send(Reply(req.id, error=remote_error(e)))
            else:
                self.send(Reply(req.id, value=value))

    def op_steps(self) -> list[int]:
        return self.committed_steps()

    def op_records(self) -> list[tuple[int, float, dict[str, Any]]]:
        """(step, commit time, metrics) of every readable committed checkpoint."""
        out = []
        for step in self.committed_steps():
            with contextlib.suppress(CorruptCheckpointError):
                m = self.read_manifest(step)
                out.append((step, m.created_at, dict(m.metrics)))
        return out

    def op_collect_partials(self) -> list[int]:
        return self.collect_partials()

    def op_load(self, step: int | None, rank: int) -> dict[str, Any]:
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
        if rank not in m.trees:
            raise CheckpointNotFoundError(
                f"step {step} was saved by {m.world_size} ranks; rank {rank} has no shard in it"
            )
        shard = m.shard_of(rank)
        records = m.tensors[shard.file]
        path = f"{fmt.step_dirname(step)}/{shard.file}"
        where = f"{self.storage.url.rstrip('/')}/{path}"
        actual = self.storage.size(path)
        if actual != shard.nbytes:
            raise CorruptCheckpointError(
                f"{where}: {actual} bytes on storage, the manifest says {shard.nbytes}", path=where
            )
        fmt.check_tree(m.trees[rank], set(records), path=where)
        lo = min((r.start for r in records.values()), default=0)
        hi = max((r.end for r in records.values()), default=0)
        seg = Segment.create(hi - lo, kind="load")
        self.load_segments.add(seg.name)
        try:
            if hi > lo:
                self.storage.readinto(path, lo, seg.buf[: hi - lo])
            tensors = {}
            for name, r in records.items():
                with seg.buf[r.start - lo : r.end - lo] as view:
                    if crc(view) != r.crc32c:
                        raise CorruptCheckpointError(
                            f"{where}: tensor {name!r} failed its crc32c check",
                            path=where,
                            key=name,
                        )
                tensors[name] = (r.dtype, r.shape, r.start - lo)
        except BaseException:
            seg.close()
            seg.unlink()
            self.load_segments.discard(seg.name)
            raise
        seg.close()
        return {
            "step": step,
            "segment": seg.name,
            "size": hi - lo,
            "tensors": tensors,
            "tree": m.trees[rank],
            "metrics": m.metrics,
            "metadata": m.metadata,
            "created_at": m.created_at,
            "nbytes": m.nbytes,
            "url": f"{self.storage.url.rstrip('/')}/{fmt.step_dirname(step)}",
        }

    # ----------------------------------------------------------------- main loop

    def serve(self) -> int:
        writer = threading.Thread(target=self.save_loop, name="aiockpt-writer")
        reader = threading.Thread(target=self.read_loop, name="aiockpt-reader")
        writer.start()
        reader.start()
        trainer_gone = False
        conn = self.chan.conn
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                trainer_gone = True
                break
            if isinstance(msg, SaveReq):
                with self.lock:
                    self.in_flight.add(msg.step)
                self.save_q.put(msg)
            elif isinstance(msg, Request):
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
            # Nobody else will unlink the trainer's slabs now.
            for name in self.slabs:
                unlink(name)
        for name in self.load_segments:
            unlink(name)
        self.storage.close()
        return 0


def _ranges(steps: list[int]) -> str:
    shown = ", ".join(map(str, steps[-10:]))
    return shown if len(steps) <= 10 else f"…, {shown}"


def main(argv: list[str]) -> int:
    conn = Connection(int(argv[1]))
    chan = Channel(conn)
    with contextlib.suppress(AttributeError, OSError):
        os.nice(10)  # the trainer comes first; measured: trainer CPU share up when contended
    try:
        cfg = conn.recv()
        daemon = Daemon(chan, cfg)
        daemon.start()
    except BaseException as e:
        with contextlib.suppress(Exception):
            chan.send(Ready(os.getpid(), error=remote_error(e)))
        return 1
    chan.send(Ready(os.getpid()))
    return daemon.serve()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
