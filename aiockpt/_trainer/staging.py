"""Staging: shard layouts and the pool of shared-memory slabs the trainer copies into.

A slab is one shared-memory segment holding a whole shard file: the safetensors header, then
every tensor, packed by descending item size so each stays naturally aligned and the data
section starts on a 4096-byte boundary. The daemon writes the slab as it is. Slabs are pooled:
fresh shared memory costs a page fault per page, a warm slab only the copy.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import operator
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

import anyio
import torch

from .._core import format as fmt
from .._core import windows as wn
from .._core.gc import no_gc
from .._core.protocol import DTensorEntry, LayoutMsg
from .._core.shm import Segment, unlink
from .state import _DTYPE, _SHAPE, ST_TO_TORCH, TORCH_TO_ST, Flat, StaleFlat

_layout_ids = itertools.count(1)


@dataclass(frozen=True, slots=True)
class Layout:
    """Where each tensor of a state lies in its shard file, and the file's header."""

    id: int
    header: bytes
    #: (name, dtype, shape, start, end) in file order, offsets relative to the data section.
    specs: tuple[fmt.TensorSpec, ...]
    #: For each tensor in flatten order, its index in ``specs``.
    order: tuple[int, ...]
    #: Each tensor's shape and torch dtype, in flatten order: what a copy checks sources against.
    shapes: tuple[torch.Size, ...]
    dtypes: tuple[torch.dtype, ...]
    #: The state's DTensors, as the daemon is told of them.
    dtensors: tuple[DTensorEntry, ...] = ()
    #: The sha256 of ``header``: a load whose shard has this head can read the shard into a
    #: slab of this layout as it lies in the file (LoadReq.image).
    digest: bytes = b""

    @property
    def data_start(self) -> int:
        """The data section's offset in the file: the header's length."""
        return len(self.header)

    @property
    def file_size(self) -> int:
        """The shard file's size in bytes."""
        return self.data_start + (self.specs[-1].end if self.specs else 0)

    @property
    def image(self) -> tuple[int, bytes]:
        """The header's length and sha256, as a load into a slab of this layout asks with
        (LoadReq.image)."""
        return self.data_start, self.digest

    def message(self) -> LayoutMsg:
        """The layout as the daemon is sent it."""
        return LayoutMsg(
            self.id,
            self.data_start,
            self.file_size,
            tuple((s.name, s.dtype, s.shape, s.start, s.end) for s in self.specs),
            self.dtensors,
        )


class LayoutCache:
    """Layouts by the state's shape, so a training loop computes its layout once."""

    def __init__(self, size: int = 8) -> None:
        self._cache: OrderedDict[tuple, Layout] = OrderedDict()
        self._size = size
        self._evicted: list[int] = []

    def get(self, flat: Flat) -> Layout:
        """The layout of ``flat``'s tensors, made on the first lookup of its key."""
        key = flat.key
        layout = self._cache.get(key)
        if layout is None:
            layout = self._cache[key] = make_layout(flat)
            if len(self._cache) > self._size:
                self._evicted.append(self._cache.popitem(last=False)[1].id)
        else:
            self._cache.move_to_end(key)
        return layout

    def take_evicted(self) -> list[int]:
        """Ids of layouts evicted since the last call: no later lookup returns them."""
        ids, self._evicted = self._evicted, []
        return ids


@no_gc  # 20k specs and a 2 MB JSON header: the collector tripled its time
def make_layout(flat: Flat) -> Layout:
    """The shard layout of ``flat``'s tensors as they are now.

    Raises StaleFlat when a tensor taken on trust (``flat.trusted`` False) turns out not to be
    savable: flatten afresh to have it refused with its key path.
    """
    tensors = flat.tensors
    dtypes = tuple(t.dtype for t in tensors)
    shapes = tuple(t.shape for t in tensors)
    if not flat.trusted and not all(
        d in TORCH_TO_ST and t.layout is torch.strided and (t.is_cpu or t.is_cuda)
        for d, t in zip(dtypes, tensors, strict=True)
    ):
        raise StaleFlat
    sizes = [t.element_size() for t in tensors]
    chunks = flat.chunk_names if flat.dtensors else frozenset()
    names = flat.names
    # Descending item size keeps every tensor naturally aligned with no padding (safetensors
    # allows no gaps); sorted() is stable, so equal sizes keep their tree order. DTensor
    # chunks come after the plain tensors, so that a load reads the plain ones in one range
    # and each chunk only where it needs it.
    file_order = sorted(range(len(tensors)), key=lambda i: (names[i] in chunks, -sizes[i]))
    specs = []
    pos = 0
    where = [0] * len(tensors)
    for i in file_order:
        if names[i] in chunks and pos % sizes[i]:
            # The first chunk after plain tensors of a smaller item size: a pad tensor keeps
            # it aligned (safetensors allows no gap), and no tree refers to it.
            pad = fmt.align_up(pos, sizes[i]) - pos
            specs.append(fmt.TensorSpec(fmt.PAD_NAME, "U8", (pad,), pos, pos + pad))
            pos += pad
        nbytes = math.prod(shapes[i]) * sizes[i]
        st_dtype = TORCH_TO_ST[dtypes[i]]
        where[i] = len(specs)
        specs.append(fmt.TensorSpec(names[i], st_dtype, tuple(shapes[i]), pos, pos + nbytes))
        pos += nbytes
    header = fmt.build_header(specs)
    entries = tuple(
        (
            h.name,
            TORCH_TO_ST[h.tensor.dtype],
            h.shape,
            h.placements,
            h.mesh,
            (h.chunk.offsets, h.chunk.sizes) if h.writes else None,
        )
        for h in flat.dtensors
    )
    digest = hashlib.sha256(header).digest()
    return Layout(
        next(_layout_ids), header, tuple(specs), tuple(where), shapes, dtypes, entries, digest
    )


class Slab:
    """A pooled segment, with views of it cached for the last layout copied in."""

    def __init__(self, size: int) -> None:
        # Touched from here rather than mapped in by MAP_POPULATE: measured at 1 GiB on a
        # virtual machine, the kernel's populate took 0.59-0.66 s, writing every page from
        # the process 0.32-0.38 s (resume_bench.py). The first load or save of a process
        # pays this.
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
        #: With ``skip_unchanged``: what each tensor of the last copy was (see _marks), and
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
            self.plan = _plan(layout, self.u8[base:])
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
        if not _matches(tensors, layout.shapes, layout.dtypes, cpu_only=not cuda):
            raise StaleFlat
        # Taken before the copy: a change made while it runs shows at the next save.
        held = [t.untyped_storage() for t in tensors]
        marks = _marks(tensors, held)
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
        # half of them (measured at 20k tensors: 85 ms on one thread, 47 ms on two).
        first, second = self.plan
        _on_two_threads(
            _copy_pieces,
            (first, self.views, tensors),
            (second, self.views, tensors) if second else None,
        )

    def _copy_from_cuda(self, layout: Layout, tensors: list[torch.Tensor]) -> None:
        # Device-to-host straight into the slab. Pinning (cudaHostRegister) makes the copies
        # true async DMA; each source device's stream is synchronized before we return.
        if not _matches(tensors, layout.shapes, layout.dtypes, cpu_only=False):
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


class WindowCopy(NamedTuple):
    """What staging one window of a shard copies (offsets relative to the window)."""

    lo: int
    hi: int
    #: The header's bytes when the window starts the file, else empty.
    header: bytes
    #: Padding to zero: (start, end).
    zeros: tuple[tuple[int, int], ...]
    #: Tensors that lie whole in the window: flatten index, start, end, dtype, shape.
    whole: tuple[tuple[int, int, int, torch.dtype, tuple[int, ...]], ...]
    #: Pieces of tensors cut by the window: flatten index, start, end, dtype, first element.
    pieces: tuple[tuple[int, int, int, torch.dtype, int], ...]


def _marks(
    tensors: list[torch.Tensor], storages: list[torch.UntypedStorage]
) -> list[tuple[int, int, int, tuple[int, ...]]]:
    """What makes a tensor the same as before: its storage (held by the caller, so that no
    other tensor can take its memory), version counter, first byte and strides."""
    return [
        (st._cdata, t._version, t.data_ptr(), t.stride())
        for t, st in zip(tensors, storages, strict=True)
    ]


def window_copies(layout: Layout, windows: tuple[tuple[int, int], ...]) -> list[WindowCopy]:
    """How each window of ``layout``'s shard is staged."""
    base = layout.data_start
    spans = [(base + s.start, base + s.end) for s in layout.specs]
    index = {j: i for i, j in enumerate(layout.order)}
    out = []
    for lo, hi in windows:
        zeros, whole, pieces = [], [], []
        for j, a, b in wn.parts(spans, lo, hi):
            spec = layout.specs[j]
            if spec.name == fmt.PAD_NAME:
                zeros.append((a - lo, b - lo))
                continue
            dtype = ST_TO_TORCH[spec.dtype]
            if (a, b) == spans[j]:
                whole.append((index[j], a - lo, b - lo, dtype, spec.shape))
            else:
                first = (a - spans[j][0]) // dtype.itemsize
                pieces.append((index[j], a - lo, b - lo, dtype, first))
        header = layout.header if lo == 0 else b""
        out.append(WindowCopy(lo, hi, header, tuple(zeros), tuple(whole), tuple(pieces)))
    return out


def copy_window(
    slab: Slab, job: WindowCopy, tensors: list[torch.Tensor], flats: dict[int, torch.Tensor]
) -> None:
    """Stage one window into ``slab`` (runs in a worker thread): the sources were checked
    against the layout before the first window. ``flats``: the 1-D form of each tensor cut
    by a window, made once per save (a copy only for a non-contiguous tensor)."""
    u8 = slab.u8
    slab.layout_id, slab.views, slab.seen, slab.held = 0, [], None, []  # no longer a layout's
    with torch.no_grad():
        if job.header:
            u8[: len(job.header)].copy_(torch.frombuffer(bytearray(job.header), dtype=torch.uint8))
        for a, b in job.zeros:
            u8[a:b].zero_()
        if job.whole:
            dsts = [u8[a:b].view(dtype).view(shape) for _, a, b, dtype, shape in job.whole]
            srcs = [tensors[i] for i, *_ in job.whole]
            if any(t.is_cuda for t in srcs):
                for d, t in zip(dsts, srcs, strict=True):
                    d.copy_(t)
            else:
                copy_pairs(dsts, srcs)
        for i, a, b, dtype, first in job.pieces:
            flat = flats.get(i)
            if flat is None:
                flat = flats[i] = tensors[i].reshape(-1)
            dst = u8[a:b].view(dtype)
            dst.copy_(flat[first : first + dst.numel()])


def sources_match(layout: Layout, tensors: list[torch.Tensor], cuda: bool) -> bool:
    """Whether ``tensors`` still have ``layout``'s dtypes and shapes (dense; on the CPU
    unless ``cuda``): checked before a save staged in windows copies its first."""
    return _matches(tensors, layout.shapes, layout.dtypes, cpu_only=not cuda)


#: What typed_views cuts: (dtype, shape, start, nbytes), the start a byte offset.
Cut = tuple[torch.dtype, tuple[int, ...], int, int]


@no_gc
def typed_views(u8: torch.Tensor, items: list[Cut]) -> list[torch.Tensor]:
    """A view of ``u8`` for each item (sorted by start, none overlapping, each start a
    multiple of its item size), in their order.

    Items of one dtype that follow one another, with gaps between them (a layout's padding,
    say) that are whole elements, are cut from one typed view by a single split_with_sizes,
    the gaps cut as parts of their own: at 20k tensors a slice and two views each took 80 ms,
    one split 20 ms.
    """
    out: list[torch.Tensor] = []
    i, n = 0, len(items)
    while i < n:
        dtype, _, first, _ = items[i]
        size = dtype.itemsize
        sizes: list[int] = []
        keep: list[int] = []
        end = first
        j = i
        while j < n:
            kind, _, start, nbytes = items[j]
            if kind != dtype or start < end or (start - end) % size:
                break
            if start > end:
                sizes.append((start - end) // size)
            keep.append(len(sizes))
            sizes.append(nbytes // size)
            end = start + nbytes
            j += 1
        parts = u8[first:end].view(dtype).split_with_sizes(sizes)
        for k, (_, shape, _, _) in zip(keep, items[i:j], strict=True):
            part = parts[k]
            out.append(part if len(shape) == 1 else part.view(shape))
        i = j
    return out


def _runs(layout: Layout, data: torch.Tensor) -> list[tuple[int, int, torch.Tensor]]:
    """(first, end, destination) for each run of two or more tensors, consecutive in flatten
    order, of one dtype and one shape but for the first dimension, and back to back in the
    slab: torch.cat along dim 0 copies a run at once into its region, viewed as rows."""
    runs = []
    order, specs = layout.order, layout.specs

    def row(i: int) -> tuple[str, tuple[int, ...]] | None:
        """What tensors of a run share: dtype and trailing shape (None: never in a run)."""
        s = specs[order[i]]
        if not s.shape or math.prod(s.shape[1:]) == 0:
            return None  # 0-dim, or rows of no bytes
        return s.dtype, s.shape[1:]

    i, n = 0, len(order)
    while i < n:
        j = i
        kind = row(i)
        while (
            kind is not None and j + 1 < n and order[j + 1] == order[j] + 1 and row(j + 1) == kind
        ):
            j += 1
        if j > i:
            assert kind is not None
            first, last = specs[order[i]], specs[order[j]]
            region = data[first.start : last.end].view(ST_TO_TORCH[first.dtype])
            runs.append((i, j + 1, region.view(-1, *kind[1])))
        i = j + 1
    return runs


class Piece(NamedTuple):
    """A range of the copy: tensors ``first`` to ``end`` (exclusive) in flatten order.

    A plain tuple underneath, so the copy loop unpacks it as fast as one.
    """

    first: int
    end: int
    #: The slab region to torch.cat the range into when it is a run (see _runs), else None.
    region: torch.Tensor | None
    #: The shapes and dtypes the sources must have.
    shapes: tuple[torch.Size, ...]
    dtypes: tuple[torch.dtype, ...]
    #: For a 1-D run, the sources' sizes (checked instead of their shapes); else empty.
    sizes: tuple[int, ...]


#: Tensors per piece: one thread checks a piece (holding the GIL) while the other copies.
PIECE = 256


def _plan(layout: Layout, data: torch.Tensor) -> tuple[list[Piece], list[Piece]]:
    """The copy as pieces of at most PIECE tensors, in two halves of about equal bytes for two
    threads (a few large tensors are copied by torch's own intra-op threads: one half)."""
    order, specs, n = layout.order, layout.specs, len(layout.order)
    spans: list[tuple[int, int, torch.Tensor | None]] = []
    done = 0
    for a, b, region in _runs(layout, data):
        if a > done:
            spans.append((done, a, None))
        spans.append((a, b, region))
        done = b
    if done < n:
        spans.append((done, n, None))
    pieces: list[Piece] = []
    for a, b, span_region in spans:
        for c in range(a, b, PIECE):
            d = min(b, c + PIECE)
            sub = None
            shapes = layout.shapes[c:d]
            sizes: tuple[int, ...] = ()
            if span_region is not None:
                base = specs[order[a]].start
                row_bytes = span_region.element_size() * math.prod(span_region.shape[1:])
                lo = (specs[order[c]].start - base) // row_bytes
                hi = (specs[order[d - 1]].end - base) // row_bytes
                sub = span_region[lo:hi]
                if span_region.dim() == 1:
                    sizes = tuple(s[0] for s in shapes)
            pieces.append(Piece(c, d, sub, shapes, layout.dtypes[c:d], sizes))
    total = sum(s.nbytes for s in specs)
    if n < PIECE or total < (1 << 20):
        return pieces, []
    half, acc, h = total // 2, 0, 0
    while h < len(pieces) and acc < half:
        acc += sum(specs[order[i]].nbytes for i in range(pieces[h].first, pieces[h].end))
        h += 1
    return pieces[:h], pieces[h:]


_LAYOUT = operator.attrgetter("layout")
_IS_CPU = operator.attrgetter("is_cpu")
_STRIDED = frozenset({torch.strided})
_DIM = torch.Tensor.dim
_NUMEL = torch.Tensor.numel
_ONE = frozenset({1})


def _matches(run: list[torch.Tensor], shapes: tuple, dtypes: tuple, *, cpu_only: bool) -> bool:
    """Whether the sources have the layout's dtypes and shapes and are dense (and on the CPU)."""
    return (
        tuple(map(_DTYPE, run)) == dtypes
        and tuple(map(_SHAPE, run)) == shapes
        and _STRIDED.issuperset(map(_LAYOUT, run))
        and (not cpu_only or all(map(_IS_CPU, run)))
    )


def _copy_pieces(pieces: list[Piece], dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for a, b, region, shapes, dtypes, sizes in pieces:
            run = srcs[a:b]
            if region is None:
                if not _matches(run, shapes, dtypes, cpu_only=True):
                    raise StaleFlat
                torch._foreach_copy_(dsts[a:b], run)
                continue
            # A run, copied by one torch.cat instead of b - a dispatches; torch.cat itself
            # refuses other devices and layouts. 1-D runs are checked by dtype, dims and sizes
            # (half the cost of comparing shapes), others by dtype and shape.
            if tuple(map(_DTYPE, run)) != dtypes:
                raise StaleFlat
            if sizes:
                if not _ONE.issuperset(map(_DIM, run)) or tuple(map(_NUMEL, run)) != sizes:
                    raise StaleFlat
            elif tuple(map(_SHAPE, run)) != shapes:
                raise StaleFlat
            try:
                torch.cat(run, out=region)
            except (RuntimeError, NotImplementedError) as e:
                if not _matches(run, shapes, dtypes, cpu_only=True):
                    raise StaleFlat from e
                raise


_helper = ThreadPoolExecutor(1, thread_name_prefix="aiockpt-copy")


def _on_two_threads(fn: Callable[..., None], here: tuple, there: tuple | None) -> None:
    """``fn(*here)`` in this thread while ``fn(*there)`` runs on the helper thread (copies
    release the GIL); returns when both are done, raising the first error."""
    other = _helper.submit(fn, *there) if there is not None else None
    try:
        fn(*here)
    finally:
        if other is not None:
            other.result()


def copy_pairs(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dsts[i].copy_(srcs[i])`` for every i; many small tensors on two threads, as a save's
    copy (a load restoring 20k tensors in place: 64 ms on one thread, 38 ms on two)."""
    half = len(dsts) // 2
    if len(dsts) < PIECE:  # a few large tensors: torch's intra-op threads split each copy
        torch._foreach_copy_(dsts, srcs)
    else:
        _on_two_threads(
            torch._foreach_copy_, (dsts[:half], srcs[:half]), (dsts[half:], srcs[half:])
        )


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
        they are where this layout's tensors lie whatever the bytes (at 20k tensors, making
        them again took 0.1 s of a resumed run's first save)."""
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
