"""The copy kernels: a state's tensors into a slab (whole, or a window at a time), and
loaded tensors out of one."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, NamedTuple

import torch

from ..._core import format as fmt
from ..._core import windows as wn
from ..._core.gc import no_gc
from ..state import _DTYPE, _SHAPE, ST_TO_TORCH, StaleFlat
from .layouts import Layout

if TYPE_CHECKING:
    from .slabs import Slab


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


def marks_of(
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
    return matches(tensors, layout.shapes, layout.dtypes, cpu_only=not cuda)


#: What typed_views cuts: (dtype, shape, start, nbytes), the start a byte offset.
Cut = tuple[torch.dtype, tuple[int, ...], int, int]


@no_gc
def typed_views(u8: torch.Tensor, items: list[Cut]) -> list[torch.Tensor]:
    """A view of ``u8`` for each item (sorted by start, none overlapping, each start a
    multiple of its item size), in their order.

    Items of one dtype that follow one another, with gaps between them (a layout's padding,
    say) that are whole elements, are cut from one typed view by a single split_with_sizes,
    the gaps cut as parts of their own: one split costs a fraction of a slice and two views
    per item.
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


def plan_pieces(layout: Layout, data: torch.Tensor) -> tuple[list[Piece], list[Piece]]:
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


def matches(run: list[torch.Tensor], shapes: tuple, dtypes: tuple, *, cpu_only: bool) -> bool:
    """Whether the sources have the layout's dtypes and shapes and are dense (and on the CPU)."""
    return (
        tuple(map(_DTYPE, run)) == dtypes
        and tuple(map(_SHAPE, run)) == shapes
        and _STRIDED.issuperset(map(_LAYOUT, run))
        and (not cpu_only or all(map(_IS_CPU, run)))
    )


def copy_pieces(pieces: list[Piece], dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for a, b, region, shapes, dtypes, sizes in pieces:
            run = srcs[a:b]
            if region is None:
                if not matches(run, shapes, dtypes, cpu_only=True):
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
                if not matches(run, shapes, dtypes, cpu_only=True):
                    raise StaleFlat from e
                raise


_helper = ThreadPoolExecutor(1, thread_name_prefix="aiockpt-copy")


def on_two_threads(fn: Callable[..., None], here: tuple, there: tuple | None) -> None:
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
    copy (small copies are Python-bound, and two threads halve that)."""
    half = len(dsts) // 2
    if len(dsts) < PIECE:  # a few large tensors: torch's intra-op threads split each copy
        torch._foreach_copy_(dsts, srcs)
    else:
        on_two_threads(torch._foreach_copy_, (dsts[:half], srcs[:half]), (dsts[half:], srcs[half:]))
