"""The reader's loads: one rank's tensors of a step, read and verified into shared memory.

A load reads the shard in chunks and checksums each chunk's finished tensors in another
thread while the next chunk is read (crc32c releases the GIL), so the check overlaps the I/O.
A load of a whole shard checksums the chunks themselves and checks the shard's crc32c (see
:func:`whole_shard`). The trainer gets a :class:`LoadReply` saying where each verified tensor
lies.
"""

from __future__ import annotations

import dataclasses
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..._core import format as fmt
from ..._core.blocks import ShardMap
from ..._core.catalog import Catalog
from ..._core.gc import no_gc
from ..._core.protocol import (
    CappedLoadReq,
    CappedWindowReq,
    CollectReq,
    LoadAsk,
    LoadReply,
    LoadReq,
    SlabRef,
    StreamReq,
    StreamWindowReq,
)
from ..._core.reshard import out_offsets
from ..._core.shm import Segment, unlink
from ...errors import (
    CheckpointError,
)
from ..shared import Slabs
from .answer import _Early
from .direct import direct_plan
from .graft import graft
from .plan import (
    NOTHING,
    _bases,
    _Plan,
    _Runs,
    _selected,
    _wanted,
    check_replicated,
    committed_step,
    deleted_under,
    shard_of,
    whole_shard,
)
from .read import assemble, read_as_image, read_whole
from .verify import _Checks, _Known
from .windows import _Stream, _Streams, _Windowed, fill_window


class Reader:
    """Serves loads from a root: into a slab the trainer lends, or into new segments that the
    trainer takes over (their names are kept, to be unlinked when the daemon exits)."""

    def __init__(self, catalog: Catalog, slabs: Slabs, pool: ThreadPoolExecutor) -> None:
        self.catalog = catalog
        self.storage = catalog.storage
        self.slabs = slabs
        self.pool = pool
        self.load_segments: set[str] = set()
        self.checks = _Checks(pool)
        self._known = _Known(self.storage)
        #: The last capped load, by what it asks and its window: the windows the
        #: trainer then asks for one at a time are read by the same plan, not planned again
        #: (listing the steps, reading the manifest, checking the shard, for each window).
        self._windowed: tuple[tuple[Any, ...], _Windowed] | None = None
        self._streams = _Streams()
        self.early = _Early()
        self._runs = _Runs()

    @no_gc
    def load(self, req: LoadReq) -> LoadReply:
        """Read and verify what ``req.ask`` names (see :meth:`_plan`) into shared memory:
        into the trainer's ``slab`` when given and large enough, else into a new segment the
        trainer takes over. With ``early`` (a name), the reply comes before the bytes are
        read (see :class:`_Early`), and ``image`` may have them read as the file lies (see
        :func:`read_as_image`). With ``direct``, a load whose bytes all lie in local files
        reads nothing here: the reply says where they are, for the trainer to read (see
        direct_plan)."""
        plan = self._plan(req.ask)
        if req.direct and (direct := direct_plan(self.storage, plan)) is not None:
            read = sum(hi - lo for lo, hi, _ in plan.ranges)  # by the trainer, from ``direct``
            tensors = plan.placed()
            return plan.reply(
                segment=None, tensors=tensors, tree=plan.tree, read_nbytes=read, direct=direct
            )
        slab, early = req.slab, req.early
        pooled = slab is not None and slab.size >= plan.size
        if slab is not None and pooled:
            seg = self.slabs.get(slab.name, slab.size)
            if early is not None:
                plan, decide = read_as_image(plan, self.storage, req.image, slab.size)
                fill = functools.partial(self.read_all, plan, seg)
                return self.early.answer(early, plan, fill, ahead=True, decide=decide)
        else:
            seg = Segment.create(plan.size, kind="load", populate=False)
            self.load_segments.add(seg.name)
            if early is not None:  # the trainer maps it and builds its values meanwhile
                fill = functools.partial(self._read_fresh, plan, seg)
                return self.early.answer(early, plan, fill, seg.name)
        try:
            read = self.read_all(plan, seg)
        except BaseException:
            if not pooled:
                seg.close()
                seg.unlink()
                self.load_segments.discard(seg.name)
            raise
        if not pooled:
            seg.close()  # the trainer maps it and takes it over
        return plan.reply(
            segment=None if pooled else seg.name,
            tensors=plan.placed(),
            tree=plan.tree,
            read_nbytes=read,
        )

    @no_gc
    def capped(self, req: CappedLoadReq) -> LoadReply:
        """A load whose bytes pass through ``req.slab`` a window at a time (see
        :func:`cut_output`): every window read and checked, the reply saying where each
        tensor lies in the whole and what the windows are; with ``early``, that reply first
        and the windows read after it (collected by name). The plan is kept for the windows
        asked for next (see :meth:`capped_window`)."""
        windowed = self._capped(req.ask, req.window)
        if req.early is not None:  # the checking pass, after the answer

            def fill() -> int:
                return self._load_windowed(windowed, req.slab, None).read_nbytes

            plan = windowed.plan
            return self.early.answer(req.early, plan, fill, None, windows=windowed.windows)
        return self._load_windowed(windowed, req.slab, None)

    @no_gc
    def capped_window(self, req: CappedWindowReq) -> LoadReply:
        """Window ``req.part`` of a capped load, read into ``req.slab`` at its start, by the
        plan its :class:`CappedLoadReq` made when it is the last kept."""
        kept = self._windowed
        if kept is not None and kept[0] == (req.ask, req.window):
            return self._load_windowed(kept[1], req.slab, req.part)
        return self._load_windowed(self._capped(req.ask, req.window), req.slab, req.part)

    def _capped(self, ask: LoadAsk, window: int) -> _Windowed:
        """The plan of a capped load, cut into windows and kept by what it asks (its step
        as resolved)."""
        plan = self._plan(ask)
        windowed = _Windowed.of(plan, window)
        self._windowed = ((dataclasses.replace(ask, step=plan.step), window), windowed)
        return windowed

    @no_gc
    def stream(self, req: StreamReq) -> LoadReply:
        """Start streamed load ``req.name``: nothing is read, the reply says where each
        tensor lies and what the windows are, which the trainer then asks for in order (see
        :meth:`stream_window`)."""
        plan = self._plan(req.ask)
        windows = self._streams.start(req.name, _Windowed.of(plan, req.window, _Stream())).windows
        return plan.reply(segment=None, tensors=plan.placed(), tree=plan.tree, windows=windows)

    @no_gc
    def stream_window(self, req: StreamWindowReq) -> LoadReply:
        """Window ``req.part`` of streamed load ``req.name``, read into ``req.slab`` and
        checked on its own, a tensor cut by windows by its running crc32c once its last
        window is in."""
        part = req.part
        return self._streams.part(req.name, part, lambda w: self._load_windowed(w, req.slab, part))

    @no_gc
    def collect(self, req: CollectReq) -> LoadReply:
        """The end of load ``req.name``, answered early: once its bytes are in (in windows:
        every window read and checked), or what failed."""
        return self.early.collect(req.name)

    def _plan(self, ask: LoadAsk) -> _Plan:
        """What a load of ``ask`` reads, checked against the manifest: ``ask.rank``'s tensors
        of ``ask.step`` (the latest when None). Distributed tensors come after the rank's
        plain tensors: the box of each that ``wanted`` names, the whole of the others. With
        ``select`` (key paths), only the values at or under those paths are read. The key
        paths of ``select``, or else of ``asked`` (those of the target restored into), at
        which a multi-rank checkpoint's tree of the rank holds nothing are read from the
        other ranks' (see graft)."""
        select, world_size = ask.select, ask.world_size
        step, m, rank, shard, smap, where = self._shard(ask.step, ask.rank, world_size)
        tree, borrowed = m.trees[rank], NOTHING
        asked = select if select is not None else ask.asked
        if asked and m.world_size > 1:
            tree, borrowed = graft(m, rank, tree, asked)
        left_out: list[str] = []
        if select is not None:
            tree = _selected(tree, select, ask.select_required, left_out)
        records, boxes = _wanted(m, tree, shard, ask.wanted, select is not None, borrowed)
        if m.world_size != world_size:
            check_replicated(m, world_size, records)
        ranges = self._runs(records, where)
        self._known.check_header(m, rank, records, where)
        bases, pos = _bases(ranges)
        out_at, size = out_offsets(pos, boxes)
        url = self.catalog.where(fmt.step_dirname(step))
        return _Plan(
            m, step, tree, tuple(left_out), ranges, bases, boxes, out_at, size, smap, where, url
        )._replace(
            whole=whole_shard(m.shard_of(rank), ranges, boxes, of=len(shard)), borrowed=borrowed
        )

    def _shard(
        self, step: int | None, rank: int, world_size: int
    ) -> tuple[int, fmt.Manifest, int, fmt.ShardTensors, ShardMap, str]:
        """The step a load of ``step`` reads, its manifest, the rank whose shard it reads,
        that shard's records, map and URL, once the shard is there and the rank's tree
        checked against it."""
        step = committed_step(self.catalog, step)
        # Lazily: a rank checks the records it reads, not every rank's (200k at 1024 ranks).
        try:
            m = self.catalog.read_manifest(step, lazy=True)
            if m.world_size != world_size:
                rank = 0  # every rank reads rank 0's part, if it is the same on every rank
            path, shard = shard_of(self.catalog, m, step, rank)
            smap = self.catalog.shard_map(step, m.shard_of(rank))
            where = self.catalog.where(path)
            self._known.check_tree(m, rank, shard, where)
            self._known.header(m, rank, path, where)  # a warmed load reads it ahead
        except CheckpointError as e:
            if (gone := deleted_under(self.catalog, step, e)) is not e:
                raise gone from None
            raise
        return step, m, rank, shard, smap, where

    @no_gc
    def warm(self, step: int | None, rank: int, world_size: int) -> None:
        """What a load of ``step`` checks before it reads, done ahead of it (see WarmReq):
        reading and parsing the manifest and checking the shard's records and the tree, much
        of a process's first load at many tensors."""
        _, m, _, shard, _, where = self._shard(step, rank, world_size)
        if not m.dtensors:
            self._runs(shard, where)  # a plain load reads every record: see _wanted

    def _read_fresh(self, plan: _Plan, seg: Segment) -> int:
        """read_all into a new segment answered early: the trainer has its name (and unlinks
        it once mapped), so this side only unmaps it, whatever the outcome."""
        try:
            return self.read_all(plan, seg)
        finally:
            seg.close()

    def read_all(self, plan: _Plan, seg: Segment) -> int:
        """Read and verify everything ``plan`` reads into ``seg``; the bytes read."""
        head = 0
        try:
            if plan.whole is not None:
                known = self._known.head(plan.m)
                head = read_whole(self.storage, self.pool, self.checks.futures, seg, plan, known)
            else:
                for (lo, hi, items), base in zip(plan.ranges, plan.bases, strict=True):
                    self.checks.read_verified(self.storage, seg, plan, items, (lo, hi), base)
            self.checks.wait()
            assembled = assemble(self.catalog, self.pool, plan, plan.boxes, plan.out_at, seg)
        except CheckpointError as e:
            self.checks.wait(quiet=True)
            if (gone := deleted_under(self.catalog, plan.step, e)) is not e:
                raise gone from None
            raise
        except BaseException:
            self.checks.wait(quiet=True)
            raise
        read = head + sum(hi - lo for lo, hi, _ in plan.ranges)
        return read + (assembled.read_bytes if assembled else 0)

    def _load_windowed(self, windowed: _Windowed, slab: SlabRef, part: int | None) -> LoadReply:
        """A load through ``slab`` in windows (see capped): all of them read and checked when
        ``part`` is None, else window ``part`` read."""
        plan, windows, stream = windowed.plan, windowed.windows, windowed.stream
        seg = self.slabs.get(slab.name, slab.size)
        todo = range(len(windows)) if part is None else [part]
        crcs: dict[str, int] | None = {} if part is None else None
        if stream is not None:
            if part != stream.next:
                raise ValueError(
                    f"the windows of a streamed load are read in order: {stream.next} is "
                    f"next, not {part}"
                )
            stream.next += 1
            crcs = stream.crcs
        read = 0
        try:
            for i in todo:
                read += fill_window(self, seg, windowed, i, crcs)
        finally:
            self.checks.wait(quiet=True)
        whole = part is None
        return plan.reply(
            segment=None,
            tensors=plan.placed() if whole else {},
            tree=plan.tree if whole else None,
            read_nbytes=read,
            windows=windows,
        )

    def close(self) -> None:
        """Unlink the segments of every load served: the trainer maps each one it takes over
        (a mapping outlives the name), and none may outlive the daemon."""
        for name in self.load_segments:
            unlink(name)
