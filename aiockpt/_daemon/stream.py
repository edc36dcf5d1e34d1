"""A shard staged in windows (see :mod:`aiockpt._core.windows`), written as its windows come.

The storage is handed the shard's bytes as an iterator: each window's bytes (or, with
deduplication, the pieces of its own :class:`~.dedup.Plan`) are made when the storage asks for
them, after the trainer has staged that window. When the storage asks for what follows a
window, it has taken that window's bytes, so the window's slab goes back to the trainer; its
checksums were computed meanwhile, on the pool. Only storages that say they consume a file's
pieces in order, once each (``writes_in_order``), can be handed a shard this way.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import crc32c

from .._core import blocks as bl
from .._core import dtable
from .._core import format as fmt
from .._core.protocol import SaveReq, SlabFree
from .._core.windows import parts
from .._crc import FOLD_MIN_AVERAGE, concat, fold
from ..errors import CheckpointError, StorageError
from .dedup import Base, Plan
from .pipe import Outbox
from .shared import Slabs, Windows


def writes_in_order(storage: object) -> bool:
    """Whether ``storage`` takes a file's pieces in order, each once, keeping no view of one
    once it asks for the next: what a shard staged in windows needs."""
    return bool(getattr(storage, "writes_in_order", False))


def _window_crcs(data: memoryview, segments: list[tuple[int, int]]) -> tuple[list[int], int]:
    """The crc32c of each segment of ``data`` (back to back, covering it), and of ``data``:
    folded from theirs, or read again when they are small."""
    crcs = [crc32c.crc32c(data[a:b]) for a, b in segments]
    return crcs, _fold_window(data, segments, crcs)


def _fold_window(data: memoryview, segments: list[tuple[int, int]], crcs: list[int]) -> int:
    covers = sum(b - a for a, b in segments) == len(data)
    if not covers or len(segments) * FOLD_MIN_AVERAGE > len(data):
        return crc32c.crc32c(data)
    return concat((c, b - a) for (a, b), c in zip(segments, crcs, strict=True))


def _chunk_crcs(data: memoryview, pieces: list[tuple[str, int, int]]) -> list[tuple[str, list]]:
    return [(name, dtable.block_crcs(data[a:b])) for name, a, b in pieces]


class ShardStream:
    """The bytes of one shard staged in windows, for ``storage.write_file``; once written,
    :meth:`result` gives what :func:`~.writer.checksums` gives for a shard staged whole,
    plus the block table and the next base with deduplication."""

    def __init__(
        self,
        req: SaveReq,
        msg_specs: tuple,
        data_start: int,
        chunk_names: frozenset[str],
        *,
        own: str,
        base: Base | None,
        slabs: Slabs,
        windows: Windows,
        pool: ThreadPoolExecutor,
        outbox: Outbox,
    ) -> None:
        self.req = req
        self.data_start = data_start
        #: Every tensor's (and the padding's) absolute span, in file order.
        self.names = [s[0] for s in msg_specs]
        self.spans = [(data_start + s[3], data_start + s[4]) for s in msg_specs]
        self.file_size = req.windows[-1][1]
        self.chunk_names = chunk_names
        self.own = own
        self.base = base
        self._slabs, self._windows, self._pool, self._outbox = slabs, windows, pool, outbox
        self._blocks = bl.cut_blocks(self.spans, data_start, self.file_size) if base else []
        #: Per span: the crcs of its pieces, in order.
        self.span_crcs: list[list[tuple[int, int]]] = [[] for _ in self.spans]
        self.window_crcs: list[tuple[int, int]] = []  # (crc, length) per window
        self.chunk_blocks: dict[str, list[int]] = {n: [] for n in chunk_names}
        self.table: list[bl.Block] = []
        self.stored = 0
        self.next_base: Base | None = None
        self._reads: Counter[str] = Counter()

    def __iter__(self) -> Iterator[memoryview]:
        for index, (lo, hi) in enumerate(self.req.windows):
            msg = self._windows.take(self.req.uuid)
            if msg is None:
                raise CheckpointError("the trainer went away while staging the save")
            if msg.error is not None:
                raise CheckpointError(f"the trainer stopped staging the save: {msg.error}")
            if msg.index != index:
                raise CheckpointError(f"window {msg.index} came where {index} was due")
            try:
                seg = self._slabs.get(msg.slab, msg.slab_size)
                with seg.buf[: hi - lo] as data:
                    yield from self._window(data, lo, hi)
            finally:
                self._outbox.send(SlabFree(msg.slab))

    def _window(self, data: memoryview, lo: int, hi: int) -> Iterator[memoryview]:
        """Window ``[lo, hi)`` of the shard, staged in ``data``: its pieces, then its checksums
        and block table recorded. Nothing reads ``data`` once this returns."""
        cut = parts(self.spans, lo, hi)
        segments = ([(0, self.data_start)] if lo == 0 else []) + [
            (a - lo, b - lo) for _, a, b in cut
        ]
        pieces = [
            (self.names[i], a - lo, b - lo) for i, a, b in cut if self.names[i] in self.chunk_names
        ]
        chunks: Future[list[tuple[str, list]]] = self._pool.submit(_chunk_crcs, data, pieces)
        try:
            if self.base is None:
                crcs = self._pool.submit(_window_crcs, data, segments)
                try:
                    yield data
                finally:
                    crcs.exception()
                seg_crcs, window_crc = crcs.result()
            else:
                seg_crcs, window_crc = yield from self._planned(data, lo, hi, segments)
        finally:
            chunks.exception()  # never leave the view to a running task
        head = 1 if lo == 0 else 0
        for (i, a, b), crc in zip(cut, seg_crcs[head:], strict=True):
            self.span_crcs[i].append((crc, b - a))
        self.window_crcs.append((window_crc, hi - lo))
        for name, crcs_ in chunks.result():
            self.chunk_blocks[name].extend(crcs_)

    def _planned(
        self, data: memoryview, lo: int, hi: int, segments: list[tuple[int, int]]
    ) -> Generator[memoryview, None, tuple[list[int], int]]:
        """The window's deduplicated pieces; returns its segments' crcs and its own."""
        assert self.base is not None
        blocks = [(a - lo, b - lo) for a, b in self._blocks if lo <= a and b <= hi]
        head = self.data_start if lo == 0 else 0
        plan = Plan(
            data, blocks, head, self.base, self._pool, reads=self._reads, pace=hi / self.file_size
        )
        try:
            tiles = plan.tiles(segments)
            loose = [s for s, t in zip(segments, tiles, strict=True) if t is None]
            direct = self._pool.submit(lambda: [crc32c.crc32c(data[a:b]) for a, b in loose])
            try:
                plan.hash_rest()
                yield from plan
                block_crcs = plan.block_crcs()
                table, stored, nxt = plan.table(self.own, self.req.step, block_crcs)
            finally:
                direct.exception()
                plan.wait()
            loose_crcs = iter(direct.result())
            seg_crcs = [
                next(loose_crcs) if t is None else fold(plan.blocks, block_crcs, t) for t in tiles
            ]
        finally:
            plan.release()
        self._merge(table, stored, nxt)
        return seg_crcs, _fold_window(data, segments, seg_crcs)

    def _merge(self, table: list[bl.Block], stored: int, nxt: Base) -> None:
        """Add a window's block table: its own file's offsets follow the windows' before."""
        shift = self.stored
        self.table += [
            bl.Block(b.length, b.digest, b.source, b.offset + (0 if b.source else shift))
            for b in table
        ]
        self.stored += stored
        where = {
            k: (path, off + shift if path == self.own else off)
            for k, (path, off) in nxt.where.items()
        }
        if self.next_base is None:
            self.next_base = Base(where, nxt.samples, nxt.step, dict(nxt.sizes), dict(nxt.crcs))
            return
        b = self.next_base
        for k, v in where.items():
            b.where.setdefault(k, v)
        if b.samples is not None and nxt.samples is not None:
            b.samples |= nxt.samples
        b.sizes.update(nxt.sizes)
        b.crcs.update(nxt.crcs)

    def result(
        self, specs: list[fmt.TensorSpec], json_parts: list[str], dtensors: list
    ) -> tuple[tuple[str, int, str], list[bl.Block], int, Base | None]:
        """Once every window is written: the manifest's tensor entries, the shard's crc and
        this rank's DTensor entries; the block table, the own file's size and the next base
        (deduplication only)."""
        names = {n: i for i, n in enumerate(self.names)}
        tensor_crcs = [concat(self.span_crcs[names[s.name]]) for s in specs]
        shard_crc = concat(self.window_crcs)
        tensors = fmt.tensors_json(specs, self.data_start, tensor_crcs, json_parts)
        entries = dtable.rank_json(dtensors, self.chunk_blocks) if dtensors else ""
        if self.next_base is not None:
            self.next_base.sizes[self.own] = self.stored
        return (tensors, shard_crc, entries), self.table, self.stored, self.next_base


def check_storage(storage: object, url: str) -> None:
    """Refuse a save staged in windows on a storage that cannot take it."""
    if not writes_in_order(storage):
        raise StorageError(
            f"{url}: this storage cannot write a shard from windows (it does not declare "
            "writes_in_order), so a save cannot be staged in pieces there: raise "
            "staging_memory to at least the shard's size, or use a storage that does "
            "(local paths, fsspec URLs, aiockpt-s3, aiockpt-gcs, aiockpt-azure)"
        )
