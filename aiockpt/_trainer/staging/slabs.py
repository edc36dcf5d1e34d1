"""The pool of shared-memory slabs the trainer stages shards in."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import anyio
import torch

from ..._core import format as fmt
from ..._core.shm import Segment, unlink
from ..state import ST_TO_TORCH, StaleFlat
from .copies import (
    Cut,
    Piece,
    copy_pairs,
    copy_pieces,
    marks_of,
    matches,
    on_two_threads,
    plan_pieces,
    typed_views,
)
from .layouts import Layout


class Slab:
    """A pooled segment, with views of it cached for the last layout copied in."""

    def __init__(self, size: int) -> None:
        # Touched from here rather than mapped in by MAP_POPULATE: writing every page from
        # the process is faster than the kernel's populate (see docs/performance.md,
        # "Resuming"). The first load or save of a process pays this.
        # The segment's pages are allocated first (a /dev/shm too small for them is a
        # StagingMemoryError here, not a SIGBUS in the copy). The mapping then belongs to
        # ``u8``'s storage, which holds the segment's buffer: every view of the slab holds it
        # too, so it is unmapped when the last of them is gone, never under a view that
        # outlived the slab (one in a failed call's traceback, say).
        seg = Segment.create(size, populate=False)
        #: The shared-memory segment's name, and its size in bytes.
        self.name, self.size = seg.name, seg.size
        self.u8 = torch.frombuffer(seg.buf, dtype=torch.uint8)
        self.layout_id = 0
        #: Whether the header and padding are still to be written before a save's copy: the
        #: layout changed, or a load read over them.
        self.loaded_over = False
        self.views: list[torch.Tensor] = []
        #: The padding between the tensors of the layout of ``views``, zeroed for each save.
        self.pads: list[torch.Tensor] = []
        self.plan: tuple[list[Piece], list[Piece]] = ([], [])
        self.pinned = False
        #: Copies made into the slab so far: the daemon knows a copy by it (SaveReq.copy_gen).
        self.gen = 0
        #: With ``skip_unchanged``: what each tensor of the last copy was (see marks_of), and
        #: the storages, held so that their memory cannot be reused by another tensor.
        self.seen: list[tuple[int, int, int, tuple[int, ...]]] | None = None
        self.held: list[torch.UntypedStorage] = []
        self.u8.zero_()  # fault every page in now, not during a save's copy

    def prepare(self, layout: Layout, *, write: bool = True) -> list[torch.Tensor]:
        """Destination views in flatten order; writes the header when the layout changes, or
        when a load has read over it. With ``write`` False (a load is reading into the slab)
        only the views are made: the next save writes the header."""
        if not write:
            self.loaded_over = True
        base = layout.data_start
        if self.layout_id != layout.id:
            self.views = []
            specs = layout.specs
            at = [j for j, sp in enumerate(specs) if sp.name != fmt.PAD_NAME]
            cuts = [
                (ST_TO_TORCH[sp.dtype], sp.shape, base + sp.start, sp.end - sp.start)
                for sp in (specs[j] for j in at)
            ]
            by_file = dict(zip(at, typed_views(self.u8, cuts), strict=True))
            self.views = [by_file[j] for j in layout.order]
            pads: list[Cut] = [
                (torch.uint8, (n,), base + sp.start, n)
                for sp in specs
                if sp.name == fmt.PAD_NAME and (n := sp.end - sp.start)
            ]
            self.pads = typed_views(self.u8, pads)
            self.plan = plan_pieces(layout, self.u8[base:])
            self.layout_id = layout.id
            self.loaded_over = True
        if self.loaded_over and write:
            self.u8[:base].copy_(torch.frombuffer(bytearray(layout.header), dtype=torch.uint8))
            if self.pads:
                torch._foreach_zero_(self.pads)
            self.loaded_over = False
        return self.views

    def copy_in(
        self, layout: Layout, tensors: list[torch.Tensor], cuda: bool = False, skip: bool = False
    ) -> tuple[int, ...]:
        """The snapshot: copy every tensor into the slab (runs in a worker thread).

        Each chunk of sources is checked against the layout before it is copied (dtype, shape,
        and a dense CPU tensor, or any device when ``cuda``); a mismatch raises StaleFlat.
        Checking takes the GIL, copying releases it, so one thread checks while the other
        copies.

        With ``skip``, a tensor that is the same tensor as at this slab's last copy (same
        storage, offset and strides) with the same version counter is not copied again: its
        bytes are still here. Returns the indices (in file order) of those tensors.
        """
        seen = self.seen if skip and self.layout_id == layout.id else None
        self.seen, self.held = None, []  # until this copy is complete
        self.prepare(layout)
        if not skip:
            self._copy_all(layout, tensors, cuda)
            self.gen += 1
            return ()
        if not matches(tensors, layout.shapes, layout.dtypes, cpu_only=not cuda):
            raise StaleFlat
        # Taken before the copy: a change made while it runs shows at the next save.
        held = [t.untyped_storage() for t in tensors]
        marks = marks_of(tensors, held)
        unchanged: tuple[int, ...] = ()
        if seen is None:
            self._copy_all(layout, tensors, cuda)
        else:
            unchanged = self._copy_changed(layout, tensors, cuda, marks, seen)
        self.gen += 1
        self.held, self.seen = held, marks
        return unchanged

    def _copy_changed(
        self, layout: Layout, tensors: list[torch.Tensor], cuda: bool, marks: list, seen: list
    ) -> tuple[int, ...]:
        """Copy the tensors whose ``marks`` differ from what ``seen`` says this slab holds;
        the indices (in file order) of the others."""
        changed = [i for i, (a, b) in enumerate(zip(marks, seen, strict=True)) if a != b]
        dsts = [self.views[i] for i in changed]
        srcs = [tensors[i] for i in changed]
        with torch.no_grad():
            if cuda:
                for d, t in zip(dsts, srcs, strict=True):
                    d.copy_(t)
            elif dsts:
                copy_pairs(dsts, srcs)
        kept = set(range(len(tensors))).difference(changed)
        return tuple(sorted(layout.order[i] for i in kept))

    def _copy_all(self, layout: Layout, tensors: list[torch.Tensor], cuda: bool) -> None:
        if cuda:
            with torch.no_grad():
                self._copy_from_cuda(layout, tensors)
            return
        # Small tensors are copied one dispatch at a time on one core: the other core takes
        # half of them: small copies are Python-bound, and two threads halve that.
        first, second = self.plan
        on_two_threads(
            copy_pieces,
            (first, self.views, tensors),
            (second, self.views, tensors) if second else None,
        )

    def _copy_from_cuda(self, layout: Layout, tensors: list[torch.Tensor]) -> None:
        # Device-to-host straight into the slab. Pinning (cudaHostRegister) makes the copies
        # true async DMA; each source device's stream is synchronized before we return.
        if not matches(tensors, layout.shapes, layout.dtypes, cpu_only=False):
            raise StaleFlat
        pairs = list(zip(self.views, tensors, strict=True))
        if not self.pinned:
            rc = torch.cuda.cudart().cudaHostRegister(self.u8.data_ptr(), self.size, 0)
            self.pinned = int(rc) == 0
        devices = set()
        for d, s in pairs:
            d.copy_(s, non_blocking=self.pinned and s.is_cuda)
            if s.is_cuda:
                devices.add(s.device)
        for dev in devices:
            torch.cuda.current_stream(dev).synchronize()

    def close(self) -> None:
        """Unpin and unlink the segment, and let go of its memory: it is unmapped now, or
        when the last view of it elsewhere is gone."""
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.u8.data_ptr())
            self.pinned = False
        self.views, self.pads = [], []
        self.plan = ([], [])
        self.seen, self.held = None, []
        self.u8 = torch.empty(0, dtype=torch.uint8)
        unlink(self.name)


class SlabPool:
    """At most ``max_pending`` saves' slabs; ``acquire`` waits while all are busy
    (backpressure). With a ``capacity`` (bytes, or a fraction of the shard's size) the slabs
    never hold more than that in all: a save whose shard does not fit in its share is staged
    in windows (:meth:`acquire_windows`)."""

    def __init__(self, max_pending: int, capacity: int | float | None = None) -> None:
        self.max_pending = max_pending
        self.capacity = capacity
        self._sem = anyio.Semaphore(max_pending)
        self._free: list[Slab] = []
        self._busy: dict[str, Slab] = {}
        #: Names of slabs destroyed since the daemon was last told.
        self.forgotten: list[str] = []
        #: Bytes of every slab held, free or busy, and the most they ever were.
        self.held = 0
        self.peak = 0
        self._limit: int | None = None  # the capacity in bytes, for the last shard size asked
        self._groups: dict[str, _Group] = {}  # window slab name -> its save's windows
        self._returned = anyio.Event()  # set (and replaced) whenever a slab comes back

    def share(self, file_size: int) -> int | None:
        """The bytes one save of a shard of ``file_size`` may stage (None: no cap)."""
        if self.capacity is None:
            return None
        if isinstance(self.capacity, float):
            self._limit = math.ceil(self.capacity * file_size)
        else:
            self._limit = self.capacity
        return self._limit // self.max_pending

    def window_size(self, file_size: int) -> int | None:
        """The size of each of the two windows a save of ``file_size`` bytes is staged in,
        or None when it is staged whole."""
        share = self.share(file_size)
        if share is None or fmt.align_up(max(file_size, 1)) <= share:
            return None
        return share // 2 // fmt.ALIGN * fmt.ALIGN

    async def acquire(self, size: int, layout_id: int) -> Slab:
        """A free slab of at least ``size`` bytes, preferring one last filled with this
        layout; waits while ``max_pending`` are busy."""
        await self._sem.acquire()
        try:
            slab = self._pick(size, layout_id)
            if slab is None:
                slab = await self._make(fmt.align_up(max(size, 1)))
        except BaseException:
            self._sem.release()
            raise
        self._busy[slab.name] = slab
        return slab

    async def acquire_windows(self, size: int) -> tuple[Slab, Slab]:
        """Two slabs of ``size`` bytes for one save staged in windows; waits while
        ``max_pending`` saves are busy. Each goes back to the trainer with :meth:`release`
        (the daemon is done with its window) and out again with :meth:`lend`; the save's
        place is free once :meth:`close_windows` was called and both are back."""
        await self._sem.acquire()
        slabs: list[Slab] = []
        try:
            for _ in range(2):
                slab = self._pick(size, 0)
                if slab is None:
                    slab = await self._make(size)
                self._busy[slab.name] = slab
                slabs.append(slab)
        except BaseException:
            for slab in slabs:
                self._busy.pop(slab.name, None)
                self._free.append(slab)
            self._sem.release()
            raise
        group = _Group()
        for slab in slabs:
            self._groups[slab.name] = group
        return slabs[0], slabs[1]

    def lend(self, slab: Slab) -> None:
        """Window slab ``slab``, back from the daemon, goes out again."""
        self._groups[slab.name].home.remove(slab)
        self._busy[slab.name] = slab

    def close_windows(self, slabs: tuple[Slab, Slab], unsent: list[Slab]) -> None:
        """The save staged in ``slabs`` sends no more windows: ``unsent`` (lent, never sent
        to the daemon) are back now, the others once the daemon hands them back."""
        group = self._groups[slabs[0].name]
        group.closed = True
        for slab in unsent:
            if self._busy.pop(slab.name, None) is not None:
                group.home.append(slab)
        self._settle(group)

    def _settle(self, group: _Group) -> None:
        """A closed save whose windows are all back: they join the free slabs."""
        if group.closed and len(group.home) == 2:
            for slab in group.home:
                del self._groups[slab.name]
                self._free.append(slab)
            self._sem.release()

    async def returned(self, slab: Slab) -> None:
        """Wait until ``slab`` is back from the daemon."""
        while slab.name in self._busy:
            await self._returned.wait()

    async def _make(self, size: int) -> Slab:
        """A new slab, after destroying free ones as the capacity requires."""
        limit = self._limit if self.capacity is not None else None
        while limit is not None and self.held + size > limit and self._free:
            self._destroy(self._free.pop(0))
        if limit is not None and self.held + size > limit:
            raise RuntimeError(f"staging would hold {self.held + size} bytes, over {limit}")
        slab = await anyio.to_thread.run_sync(Slab, size)
        self.held += slab.size
        self.peak = max(self.peak, self.held)
        return slab

    def _destroy(self, slab: Slab) -> None:
        self.forgotten.append(slab.name)
        self.held -= slab.size
        slab.close()

    def _pick(self, size: int, layout_id: int) -> Slab | None:
        fits = [s for s in self._free if s.size >= size]
        if not fits:
            if self._free:  # all too small: replace one rather than grow the pool
                self._destroy(self._free.pop())
            return None
        same = [s for s in fits if s.layout_id == layout_id]
        slab = (same or sorted(fits, key=lambda s: s.size))[0]
        self._free.remove(slab)
        return slab

    def reuse_for_load(self, slab: Slab) -> None:
        """A load reads its bytes over this slab: the next save writes the header and padding
        again, and copies every tensor (the slab holds no save's copy now). Its views stay:
        they are where this layout's tensors lie whatever the bytes (making them again is work
        per tensor that a resumed run's first save would pay)."""
        slab.loaded_over = True
        slab.seen, slab.held = None, []

    def release(self, name: str) -> None:
        """Slab ``name`` may be filled again (unknown or already free: nothing happens)."""
        slab = self._busy.pop(name, None)
        if slab is None:
            return
        self._returned.set()
        self._returned = anyio.Event()
        group = self._groups.get(name)
        if group is None:
            self._free.append(slab)
            self._sem.release()
        else:
            group.home.append(slab)
            self._settle(group)

    def take_forgotten(self) -> tuple[str, ...]:
        """Names of the slabs destroyed since the last call: the daemon may unmap them."""
        names, self.forgotten = tuple(self.forgotten), []
        return names

    def release_all(self) -> None:
        """Free every busy slab (their saves will never be answered)."""
        for name in list(self._busy):
            self.release(name)

    def close(self) -> None:
        """Destroy every slab."""
        self.release_all()
        homes = {id(g): g.home for g in self._groups.values()}
        for slab in [*self._free, *itertools.chain(*homes.values())]:
            self._destroy(slab)
        self._free = []
        self._groups = {}
        self.forgotten = []

    @property
    def busy(self) -> int:
        """How many slabs are lent out."""
        return len(self._busy)


@dataclass(slots=True)
class _Group:
    """The two window slabs of one save: those back with the trainer (not free for other
    saves until this one is over), and whether it sends more."""

    home: list[Slab] = field(default_factory=list)
    closed: bool = False
