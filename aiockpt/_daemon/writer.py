"""The writer: one :class:`SaveReq` at a time, the shard written, then the step committed.

The bytes come from the trainer's slab in shared memory and go to storage as they are; their
checksums are computed in another thread while they are written, so the commit only splices
text. On one rank the commit is the manifest; on several, the ranks agree through storage
(see :mod:`.coord`). After the commit comes the retention pass, then one :class:`SaveDone`.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import crc32c

from .._core import blocks as bl
from .._core import dtable
from .._core import format as fmt
from .._core.catalog import Catalog, manifest_path
from .._core.chunks import Chunk
from .._core.lease import check_generation
from .._core.protocol import CheckpointInfo, Hello, LayoutMsg, SaveDone, SaveReq, SlabFree
from .._core.shm import Segment
from .._crc import FOLD_MIN_AVERAGE, combine, concat, fold
from ..errors import CheckpointError, DistributedSaveError, LeaseLostError, StepExistsError
from ..retention import CheckpointRecord
from ..storage import CountingStorage, Storage
from .coord import Coordinator, Fence, Part, merge, no_fence, publish_manifest
from .dedup import Base, Plan, shard_fields
from .memory import SlabMemory
from .pipe import Outbox, remote_error
from .prune import Pruner
from .shared import Slabs, Windows
from .stream import ShardStream, check_storage


class Layout:
    """A shard layout the daemon knows, with what it caches for it."""

    def __init__(self, msg: LayoutMsg) -> None:
        self.msg = msg
        #: For each entry of ``msg.specs`` that is a tensor, its index in ``specs``.
        self.tensor_index = {
            j: k for k, j in enumerate(j for j, s in enumerate(msg.specs) if s[0] != fmt.PAD_NAME)
        }
        # The padding before the first DTensor chunk is in the file, not in the manifest.
        self.specs = [fmt.TensorSpec(*s) for s in msg.specs if s[0] != fmt.PAD_NAME]
        self._json_parts: list[str] | None = None
        self.dtensors = [
            dtable.RankEntry(n, d, shape, pl, mesh, None if box is None else Chunk(*box))
            for n, d, shape, pl, mesh, box in msg.dtensors
        ]
        #: The specs of the DTensor chunks this rank writes.
        written = {e.name for e in self.dtensors if e.chunk is not None}
        self.chunk_specs = [s for s in self.specs if s.name in written]

    def json_parts(self) -> list[str]:
        """The manifest text of the tensor entries, around the crcs each save fills in."""
        if self._json_parts is None:
            self._json_parts = fmt.tensors_json_parts(self.specs, self.msg.data_start)
        return self._json_parts


def tensor_checksums(data: memoryview, layout: Layout, known: dict[int, int]) -> list[int]:
    """The crc32c of each tensor of ``layout.specs``: ``known``'s, or read from ``data``."""
    base = layout.msg.data_start
    return [
        known[k] if k in known else crc32c.crc32c(data[base + s.start : base + s.end])
        for k, s in enumerate(layout.specs)
    ]


def checksums(
    data: memoryview,
    layout: Layout,
    tensor_crcs: list[int] | None = None,
    dtensors: str | None = None,
    shard_crc: int | None = None,
) -> tuple[str, int, str]:
    """The manifest's tensor entries with their crcs, the shard's crc, and this rank's
    DTensor entries with their chunks' block crcs: computed while the shard is written, so
    the commit only splices text. ``tensor_crcs``, ``dtensors``, ``shard_crc``: those
    already known."""
    base = layout.msg.data_start
    if tensor_crcs is None:
        tensor_crcs = tensor_checksums(data, layout, {})
    if shard_crc is None:
        shard_crc = shard_checksum(data, layout, tensor_crcs)
    if dtensors is None:
        dtensors = dtensor_entries(data, layout)
    tensors = fmt.tensors_json(layout.specs, base, tensor_crcs, layout.json_parts())
    return tensors, shard_crc, dtensors


def dtensor_entries(data: memoryview, layout: Layout) -> str:
    """This rank's entries of the distributed-tensor table, with its chunks' block crcs."""
    if not layout.dtensors:
        return ""
    base = layout.msg.data_start
    blocks = {
        s.name: dtable.block_crcs(data[base + s.start : base + s.end]) for s in layout.chunk_specs
    }
    return dtable.rank_json(layout.dtensors, blocks)


def _crcs_of(data: memoryview, spans: list[tuple[int, int]]) -> list[int]:
    return [crc32c.crc32c(data[a:b]) for a, b in spans]


def shard_checksum(data: memoryview, layout: Layout, tensor_crcs: list[int]) -> int:
    """The crc32c of the whole shard: the header's, then each tensor's (and any padding's)
    folded in, in file order, rather than a second pass over the bytes, unless the tensors
    are so small that reading them again is cheaper."""
    start, specs = layout.msg.data_start, layout.msg.specs
    back_to_back = all(a[4] == b[3] for a, b in itertools.pairwise(specs))
    if (
        not specs
        or len(specs) * FOLD_MIN_AVERAGE > len(data)
        or not back_to_back
        or specs[0][3] != 0
        or start + specs[-1][4] != len(data)
    ):
        return crc32c.crc32c(data)
    crcs = iter(tensor_crcs)
    crc = crc32c.crc32c(data[:start])
    for name, _dtype, _shape, begin, end in specs:
        if name == fmt.PAD_NAME:
            part = crc32c.crc32c(data[start + begin : start + end])
        else:
            part = next(crcs)
        crc = combine(crc, part, end - begin)
    return crc


def publish(storage: Storage, step: int, manifest: bytes, *, replacing: bool) -> None:
    """Commit ``step``: create its manifest (conditionally where the storage can), or, when
    it replaces a committed step (``save(overwrite=True)``), replace the manifest atomically,
    so the old step loads until this instant (see docs/format.md#replacing-a-step)."""
    if replacing:
        storage.put_atomic(manifest_path(step), manifest)
    else:
        publish_manifest(storage, manifest_path(step), manifest, step)


def read_base(storage: Storage, step: int, shard: fmt.ShardRecord) -> Base:
    """The base of a committed shard; nothing when a file it refers to cannot be sized."""
    try:
        return Base.of_shard(step, shard, storage.size)
    except CheckpointError:
        return Base.empty()


def swept(catalog: Catalog, step: int, names: list[str] | None) -> None:
    """After ``step`` was replaced by a manifest naming the shards ``names`` (read from it
    when None): remove the replaced attempt's files, but for those a kept step reads (see
    Catalog.sweep_replaced). A failure leaves them, unreferenced, for the step's next
    deletion."""
    with contextlib.suppress(Exception):
        catalog.sweep_replaced(step, names)


class Writer:
    """Writes and commits this rank's shard of each save, in the order they come."""

    def __init__(
        self,
        catalog: Catalog,
        cfg: Hello,
        *,
        slabs: Slabs,
        windows: Windows,
        pool: ThreadPoolExecutor,
        coord: Coordinator | None,
        pruner: Pruner,
        outbox: Outbox,
        fence: Fence = no_fence,
    ) -> None:
        self.catalog = catalog
        #: What saves deduplicate against (see dedup.py): None until the first save reads it,
        #: and always None with deduplication off.
        self.dedup = cfg.dedup
        self.base: Base | None = None
        self.fence = fence
        self.storage = catalog.storage
        self.rank = cfg.rank
        self.slabs = slabs
        self.windows = windows
        self.pool = pool
        self.coord = coord
        self.pruner = pruner
        self.outbox = outbox
        #: Layouts by id (see SaveReq.layout), and encoded state-tree fragments by id (see
        #: SaveReq.fragments): sent once, named by later saves until they are forgotten.
        self.layouts: dict[int, Layout] = {}
        self.fragments: dict[int, str] = {}
        #: The sums of the last save written from each slab (skip_unchanged).
        self.memory = SlabMemory()

    def save(self, req: SaveReq) -> None:
        """Write, commit and prune; the trainer hears :class:`SlabFree` as soon as the slab's
        bytes are durable, then one :class:`SaveDone`, whatever happens."""
        counting = self.storage if isinstance(self.storage, CountingStorage) else None
        with counting.scope() if counting is not None else contextlib.nullcontext() as counts:
            self._save(req, counts)

    def _save(self, req: SaveReq, counts: Counter[str] | None) -> None:
        t0 = time.monotonic()
        slab_free = False
        step_dir = fmt.step_dirname(req.step)
        # The shard's name is this attempt's alone: nothing another attempt wrote (a retired
        # step's file after a rewind, a fenced writer's, a failed save's) can be overwritten,
        # and nothing this attempt leaves behind can be taken for another's.
        name = fmt.shard_filename(self.rank, fmt.new_tag())
        path = f"{step_dir}/{name}"
        written_path: str | None = None  # the file this attempt may have created
        made_dir = False
        try:
            tree, layout = self._take(req)
            if req.windows:
                check_storage(self.storage, self.storage.url)
            replacing = self.catalog.is_committed(req.step)
            if replacing and not req.overwrite:
                raise StepExistsError(f"step {req.step} is already committed in {self.storage.url}")
            self._fence(req, f"write step {req.step}")
            self.storage.makedirs(step_dir)
            # From here on the attempt's file may exist (a write that fails leaves none, and
            # removing a missing file is no error): a failure removes it.
            made_dir, written_path = True, path
            if req.windows:
                (tensors, shard_crc, dtensors), table, base = self._write_windows(req, layout, path)
            else:
                seg = self.slabs.get(req.slab, req.slab_size)
                (tensors, shard_crc, dtensors), table, base = self._write_shard(
                    req, seg, layout, path
                )
                self.outbox.send(SlabFree(req.slab))
            slab_free = True
            written = time.monotonic()
            nbytes = layout.msg.file_size
            stored = table.get("stored", nbytes)
            self._event("save.written", req, written - t0, nbytes, written_nbytes=stored)
            shard = {"file": name, "rank": self.rank, "nbytes": nbytes, "crc32c": shard_crc}
            shard.update(table)
            part = Part(self.rank, shard, tensors, tree, dtensors)
            created_at = self._commit(req, part, replacing=replacing)
            made_dir, written_path = False, None  # committed: the manifest refers to it now
            if replacing and self.rank == 0:  # on several ranks, rank 0 knows every name
                swept(self.catalog, req.step, None if self.coord is not None else [name])
            if base is not None:
                self.base = base  # the next save refers to what this one committed
            self.pruner.committed(CheckpointRecord(req.step, created_at, dict(req.metrics)))
            requests = None if counts is None else dict(counts)
            self._event(
                "save.committed", req, time.monotonic() - written, nbytes, requests=requests
            )
            info = CheckpointInfo(
                step=req.step,
                url=self.catalog.where(step_dir),
                created_at=created_at,
                nbytes=nbytes,
                metrics=req.metrics,
            )
            deleted, error = self.pruner.apply(req.uuid, req.step)
            if self.coord is not None and self.rank == 0:
                self.coord.finished(req.step, req.uuid)  # the others' handles resolve now
            self.outbox.send(SaveDone(req.uuid, info=info, deleted=tuple(deleted), error=error))
        except BaseException as e:
            self._failed(req, e, slab_free=slab_free, made_dir=made_dir, written=written_path)

    def _take(self, req: SaveReq) -> tuple[str, Layout]:
        """Update the caches as ``req`` says; its encoded tree and its layout."""
        learn(self, req)
        tree = fmt.encode_tree(req.tree, self.fragments)
        layout = self.layouts[req.layout_id]
        forget(self, req)
        return tree, layout

    def _write_shard(
        self, req: SaveReq, seg: Segment, layout: Layout, path: str
    ) -> tuple[tuple[str, int, str], dict[str, object], Base | None]:
        """Write the slab's bytes as the shard, checksumming them meanwhile; with
        deduplication, only the blocks the base does not hold (see dedup.py). Returns the
        checksums, the shard's block-table fields (none without deduplication, or without
        a byte of data) and the base the next save will use (None: unchanged)."""
        known_tensors, known_blocks = self.memory.recall(req, layout.msg, layout.tensor_index)
        with seg.buf[: layout.msg.file_size] as data:
            if not self.dedup:
                crcs = self.pool.submit(tensor_checksums, data, layout, known_tensors)
                try:
                    self.storage.write_file(path, [data])
                finally:
                    crcs.exception()  # never leave the view to a running thread
                tensor_crcs = crcs.result()
                self.memory.keep(req, tensor_crcs, [])
                return checksums(data, layout, tensor_crcs), {}, None
            start = layout.msg.data_start
            spans = sorted((start + s[3], start + s[4]) for s in layout.msg.specs)
            blocks = bl.cut_blocks(spans, start, len(data))
            known = {i: known_blocks[b] for i, b in enumerate(blocks) if b in known_blocks}
            plan = Plan(data, blocks, start, self._base(req.step), self.pool, known=known)
            # A tensor cut into whole blocks gets its crc from theirs; the others (small
            # tensors sharing blocks) are read for theirs meanwhile, unless known.
            where = [(start + s.start, start + s.end) for s in layout.specs]
            tiles = plan.tiles(where)
            loose = [
                w
                for k, (w, t) in enumerate(zip(where, tiles, strict=True))
                if t is None and k not in known_tensors
            ]
            direct = self.pool.submit(_crcs_of, data, loose)
            dtensors = self.pool.submit(dtensor_entries, data, layout)
            plan.hash_rest()
            try:
                self.storage.write_file(path, plan)
                block_crcs = plan.block_crcs()
                table, stored, base = plan.table(path, req.step, block_crcs)
                loose_crcs = iter(direct.result())
                tensor_crcs = [
                    known_tensors[k]
                    if k in known_tensors
                    else next(loose_crcs)
                    if t is None
                    else fold(plan.blocks, block_crcs, t)
                    for k, t in enumerate(tiles)
                ]
                # The blocks tile the data section: the shard's crc folds from theirs (a few
                # hundred folds) where 20,000 small tensors would make it a second read.
                sizes = [hi - lo for lo, hi in plan.blocks]
                head = (crc32c.crc32c(data[:start]), start)
                shard_crc = concat([head, *zip(block_crcs, sizes, strict=True)])
                result = checksums(data, layout, tensor_crcs, dtensors.result(), shard_crc)
                sums = list(zip(plan.hashes(), block_crcs, strict=True))
            finally:
                direct.exception()  # never leave the view to a running thread
                dtensors.exception()
                plan.wait()
                plan.release()
        self.memory.keep(req, tensor_crcs, sums)
        return result, shard_fields(table, stored), base

    def _write_windows(
        self, req: SaveReq, layout: Layout, path: str
    ) -> tuple[tuple[str, int, str], dict[str, object], Base | None]:
        """Write a shard staged in windows as they come (see stream.py); returns what
        :meth:`_write_shard` does."""
        stream = ShardStream(
            req,
            layout.msg.specs,
            layout.msg.data_start,
            frozenset(s.name for s in layout.chunk_specs),
            own=path,
            base=self._base(req.step) if self.dedup else None,
            slabs=self.slabs,
            windows=self.windows,
            pool=self.pool,
            outbox=self.outbox,
        )
        try:
            self.storage.write_file(path, stream)  # type: ignore[arg-type]  # an iterable
        finally:
            self.windows.finish(req.uuid)
        result, table, stored, base = stream.result(
            layout.specs, layout.json_parts(), layout.dtensors
        )
        return result, shard_fields(table, stored), base

    def _base(self, step: int) -> Base:
        """What a save of ``step`` deduplicates against: the blocks of this rank's shard of
        the step this writer committed last, read from the newest committed step the first
        time. Nothing when that step is gone (deleted behind the run's back: its files may
        be too) or is ``step`` itself."""
        if self.base is None:
            self.base = Base.empty()
            steps = self.catalog.committed_steps()
            if steps:
                try:
                    m = self.catalog.read_manifest(steps[-1], lazy=True)
                    shard = m.shard_of(self.rank)
                except (CheckpointError, KeyError):
                    pass  # an unreadable newest step: this save writes everything
                else:
                    self.base = read_base(self.storage, steps[-1], shard)
        gone = self.base.step is not None and (
            self.base.step == step or not self.catalog.is_committed(self.base.step)
        )
        if gone:
            self.base = Base.empty()
        return self.base

    def _fence(self, req: SaveReq, what: str) -> None:
        """Refuse ``what`` once the lease is lost: rank 0 checks the lease it holds, another
        rank the generation rank 0 held when the manager opened."""
        self.fence(what)
        if req.lease_generation is not None:
            check_generation(self.storage, req.lease_generation, what)

    def _commit(self, req: SaveReq, part: Part, *, replacing: bool = False) -> float:
        """Publish the manifest (with the other ranks' parts, on several); its commit time.
        ``replacing``: replace a committed step's manifest (see publish)."""
        if self.coord is not None:
            if self.rank != 0:
                self._fence(req, f"publish rank {self.rank}'s part of step {req.step}")
            return self.coord.commit(
                step=req.step,
                uuid=req.uuid,
                part=part,
                metrics=req.metrics,
                metadata=req.metadata,
                replacing=replacing,
            )
        created_at = time.time()
        manifest = merge(
            [part], step=req.step, created_at=created_at, metrics=req.metrics, metadata=req.metadata
        )  # one rank cannot disagree with itself: no dtable.Disagreement here
        self.fence(f"{'replace' if replacing else 'commit'} step {req.step}")
        publish(self.storage, req.step, manifest, replacing=replacing)
        self.catalog.note_refs(req.step, {b[2] for b in part.shard.get("blocks", ()) if b[2]})
        return created_at

    def _failed(
        self,
        req: SaveReq,
        exc: BaseException,
        *,
        slab_free: bool,
        made_dir: bool,
        written: str | None,
    ) -> None:
        """End a failed save: the slab back, the other ranks told, the file it wrote removed."""
        if req.windows:
            self.windows.finish(req.uuid)  # the windows still to come go back
        elif not slab_free:
            self.outbox.send(SlabFree(req.slab))
        if self.coord is not None and not isinstance(exc, DistributedSaveError):
            with contextlib.suppress(Exception):
                self.coord.publish_failure(req.step, req.uuid, f"{type(exc).__name__}: {exc}")
        if made_dir and self.coord is None and not isinstance(exc, LeaseLostError):
            # A writer fenced off writes nothing more, not even a delete: what it wrote is
            # collected by the holder (see Catalog.collect_partials). On several ranks the
            # commit may have happened without this rank hearing it: the file stays for the
            # collection, which knows what the manifests refer to.
            if getattr(exc, "errno", None) == errno.EEXIST:
                written = None  # the create was refused: what is there is not ours
            with contextlib.suppress(Exception):
                self.catalog.discard(req.step, written)
        self.outbox.send(SaveDone(req.uuid, error=remote_error(exc)))

    def _event(
        self, name: str, req: SaveReq, duration_s: float, nbytes: int, **fields: object
    ) -> None:
        self.outbox.event(
            name, req.uuid, req.step, duration_s=duration_s, nbytes=nbytes, where="daemon", **fields
        )


def learn(w: Writer, req: SaveReq) -> None:
    """The layout and fragments ``req`` brings, into ``w``'s caches."""
    if req.layout is not None:
        w.layouts[req.layout.id] = Layout(req.layout)
    for i, node in req.fragments.items():
        w.fragments[i] = fmt.encode_tree(node, {})


def forget(w: Writer, req: SaveReq) -> None:
    """What ``req`` says no later save names, out of ``w``'s caches."""
    for i in req.forget_fragments:
        w.fragments.pop(i, None)
    for i in req.forget_layouts:
        w.layouts.pop(i, None)
    w.slabs.forget(req.forget)
    w.memory.forget(req.forget)


def follow(w: Writer, req: SaveReq) -> None:
    """Keep ``w``'s caches in step with a save another writer writes (a local tier's, see
    tiers.py): later saves name the layouts and fragments it brought."""
    learn(w, req)
    forget(w, req)
