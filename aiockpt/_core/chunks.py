"""Boxes in a global tensor: the geometry of checkpoints of distributed tensors.

A distributed tensor (FSDP2, tensor parallel) is saved once per distinct piece. Each piece is
a :class:`Chunk`, a box of the global tensor given by per-dim offsets and sizes, stored as the
row-major (C-order) bytes of that box. A table of chunks read back from storage is checked by
:func:`check_chunks` before anything trusts it. Loading reshards: each rank wants its own box,
and for each saved chunk that overlaps it, :func:`read_plan` says which byte runs of the saved
chunk hold the overlap and where each lands in the wanted chunk's buffer; :func:`byte_span`
is the one ranged read that fetches them all, and :func:`scatter` copies them into place.

All of it is exact integer arithmetic on plain tuples, iterative, and free of torch and numpy:
the daemon and the trainer share it.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from ..errors import CorruptCheckpointError

__all__ = [
    "Chunk",
    "Run",
    "byte_span",
    "check_chunks",
    "overlap",
    "read_plan",
    "scatter",
]


class Chunk(NamedTuple):
    """A box ``[offsets[d], offsets[d] + sizes[d])`` on every dim ``d`` of a global tensor.

    A 0-dim tensor has the single chunk ``Chunk((), ())``, of one element. A chunk with a size
    of 0 on some dim holds nothing (torch gives such chunks to the last ranks of an uneven
    shard).
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def ndim(self) -> int:
        """The number of dims."""
        return len(self.sizes)

    @property
    def numel(self) -> int:
        """The number of elements in the box."""
        return math.prod(self.sizes)

    @property
    def ends(self) -> tuple[int, ...]:
        """The exclusive end of the box on every dim."""
        return tuple(o + s for o, s in zip(self.offsets, self.sizes, strict=True))


class Run(NamedTuple):
    """One contiguous copy: bytes ``[src_start, src_end)`` of the saved chunk's buffer go to
    ``dst_offset`` onward in the wanted chunk's buffer."""

    src_start: int
    src_end: int
    dst_offset: int


# ---------------------------------------------------------------------------------------------
# Validation of an untrusted chunk table


def check_chunks(
    global_shape: Sequence[int],
    chunks: Sequence[Chunk],
    *,
    where: str,
    bounds_checked: bool = False,
) -> None:
    """Check that ``chunks`` tile a tensor of ``global_shape`` exactly once.

    Every chunk must have the tensor's number of dims, non-negative int offsets and sizes,
    and lie inside the tensor; no two chunks may share an element; and their volumes must sum
    to the tensor's. In-bounds, disjoint boxes whose volumes sum to the whole cover all of it,
    so this is exactly "each element saved once". Empty chunks are allowed (they hold nothing
    and overlap nothing). Raises :class:`~aiockpt.errors.CorruptCheckpointError` whose message
    starts with ``where``.

    Cost, for ``n`` chunks in ``k`` dims. Every table a DTensor produces is a *grid*: on each
    dim the chunks' intervals form a partition of that dim, and the chunks are distinct
    products of those intervals (1-D sharding on any dim, including the common dim-0 case,
    is a grid with one interval on the other dims). A grid is recognised, and proven disjoint,
    by sorting: O(k·n log n). Any other table falls back to a sweep along the dim with the
    most distinct offsets that compares each chunk only with the chunks whose interval on that
    dim is still open: O(k·n·w + n log n), where ``w`` is the most chunks any plane across the
    sweep dim cuts, at most ``n`` (so a hostile table of ``n`` chunks costs at most about
    ``k·n²/2`` integer comparisons, and stops at the first overlap).
    """
    shape = _checked_shape(global_shape, where)
    filled: list[Chunk] = []
    for i, chunk in enumerate(chunks):
        if not bounds_checked:  # a caller that built the chunks from checked ints did
            _check_in_bounds(shape, chunk, i, where)
        if chunk.numel:
            filled.append(chunk)
    volume = sum(c.numel for c in filled)
    if volume != math.prod(shape):
        raise CorruptCheckpointError(
            f"{where}: chunks hold {volume} elements of a tensor of shape {list(shape)} "
            f"({math.prod(shape)} elements)"
        )
    if not _is_disjoint_grid(shape, filled):
        _sweep_for_overlap(filled, where)


def _checked_shape(global_shape: Sequence[int], where: str) -> tuple[int, ...]:
    shape = tuple(global_shape)
    if not all(_is_count(n) for n in shape):
        raise CorruptCheckpointError(f"{where}: bad global shape {list(shape)!r}")
    return shape


def _is_count(value: object) -> bool:
    # An exact non-negative int: not a bool, not a float that equals one.
    return type(value) is int and value >= 0


_INT = frozenset({int})
_le, _add = operator.le, operator.add


def _check_in_bounds(shape: tuple[int, ...], chunk: object, index: int, where: str) -> None:
    if not isinstance(chunk, Chunk):
        raise CorruptCheckpointError(f"{where}: chunk {index} is not a chunk: {chunk!r}")
    offsets, sizes = chunk
    if not (isinstance(offsets, tuple) and isinstance(sizes, tuple)):
        raise CorruptCheckpointError(f"{where}: chunk {index} is malformed: {chunk!r}")
    if len(offsets) != len(shape) or len(sizes) != len(shape):
        raise CorruptCheckpointError(
            f"{where}: chunk {index} has {len(offsets)} offsets and {len(sizes)} sizes "
            f"for a tensor of {len(shape)} dims"
        )
    if (
        _INT.issuperset(map(type, offsets))
        and _INT.issuperset(map(type, sizes))
        and all(map(_le, map(_add, offsets, sizes), shape))
        and (not offsets or min(offsets) >= 0)
        and (not sizes or min(sizes) >= 0)
    ):
        return  # the common case, in C-level passes; the loop below says what is wrong
    for d, (o, s, n) in enumerate(zip(offsets, sizes, shape, strict=True)):
        if not (_is_count(o) and _is_count(s)):
            raise CorruptCheckpointError(
                f"{where}: chunk {index} has offset {o!r} and size {s!r} on dim {d}"
            )
        if o + s > n:
            raise CorruptCheckpointError(
                f"{where}: chunk {index} spans [{o}, {o + s}) on dim {d} of size {n}"
            )


def _is_disjoint_grid(shape: tuple[int, ...], filled: list[Chunk]) -> bool:
    """Whether the non-empty chunks are distinct products of a partition of every dim.

    Such chunks are disjoint: two distinct ones differ in some dim, where their intervals are
    distinct members of a partition, hence disjoint. False only says "not a grid"; the sweep
    then decides.
    """
    if len(set(filled)) != len(filled):
        return False  # a repeated chunk overlaps itself: let the sweep report it
    for d, n in enumerate(shape):
        intervals = sorted({(c.offsets[d], c.sizes[d]) for c in filled})
        end = 0
        for start, size in intervals:
            if start != end:
                return False
            end = start + size
        if filled and end != n:
            return False
    return True


def _sweep_for_overlap(filled: list[Chunk], where: str) -> None:
    """Raise on the first two chunks that share an element; O(k·n·w) as check_chunks says."""
    ndim = filled[0].ndim if filled else 0
    if ndim == 0:  # only the scalar chunk; more than one of it is an overlap
        if len(filled) > 1:
            raise _overlap_error(where, filled[0], filled[1])
        return
    axis = max(range(ndim), key=lambda d: len({c.offsets[d] for c in filled}))
    order = sorted(filled, key=lambda c: c.offsets[axis])
    active: list[Chunk] = []
    for chunk in order:
        start = chunk.offsets[axis]
        active = [a for a in active if a.offsets[axis] + a.sizes[axis] > start]
        for other in active:
            if overlap(other, chunk) is not None:
                raise _overlap_error(where, other, chunk)
        active.append(chunk)


def _overlap_error(where: str, a: Chunk, b: Chunk) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{where}: chunks at offsets {list(a.offsets)} (sizes {list(a.sizes)}) and "
        f"{list(b.offsets)} (sizes {list(b.sizes)}) overlap"
    )


# ---------------------------------------------------------------------------------------------
# Resharding: which bytes of a saved chunk a wanted chunk needs


def overlap(a: Chunk, b: Chunk) -> Chunk | None:
    """The box both ``a`` and ``b`` hold, or None when they share no element.

    Two 0-dim chunks overlap in the scalar, ``Chunk((), ())``.
    """
    if a.ndim != b.ndim:
        raise ValueError(f"chunks of {a.ndim} and {b.ndim} dims cannot overlap")
    offsets = tuple(max(x, y) for x, y in zip(a.offsets, b.offsets, strict=True))
    ends = tuple(min(x, y) for x, y in zip(a.ends, b.ends, strict=True))
    if any(e <= o for o, e in zip(offsets, ends, strict=True)):
        return None
    return Chunk(offsets, tuple(e - o for o, e in zip(offsets, ends, strict=True)))


def _row_major_strides(sizes: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a C-order buffer of ``sizes``."""
    strides = [1] * len(sizes)
    for d in range(len(sizes) - 2, -1, -1):
        strides[d] = strides[d + 1] * sizes[d + 1]
    return tuple(strides)


def read_plan(saved: Chunk, wanted: Chunk, itemsize: int) -> list[Run]:
    """The byte runs that copy the overlap of ``saved`` and ``wanted`` between their buffers.

    Both buffers hold their chunk's elements in row-major order, ``itemsize`` bytes each.
    Each :class:`Run` is a contiguous range of the saved buffer and where it lands in the
    wanted buffer; runs come in increasing order of both. Runs are maximal: the trailing dims
    on which the overlap spans both chunks whole merge into each run, with the one dim before
    them, so an overlap on dim 0 of two chunks with the same trailing extents is one run. No
    overlap, or an empty one, is no runs.
    """
    if itemsize <= 0:
        raise ValueError(f"itemsize must be positive, not {itemsize}")
    common = overlap(saved, wanted)
    if common is None:
        return []
    ndim = common.ndim
    # Trailing dims that the overlap covers whole in both chunks are contiguous in both.
    whole = ndim
    while (
        whole > 0 and saved.sizes[whole - 1] == common.sizes[whole - 1] == wanted.sizes[whole - 1]
    ):
        whole -= 1
    split = max(whole - 1, 0)  # dims before `split` enumerate runs; the rest is one run
    run_bytes = math.prod(common.sizes[split:]) * itemsize
    src_strides = _row_major_strides(saved.sizes)
    dst_strides = _row_major_strides(wanted.sizes)
    # Element offsets of the overlap's first element in each buffer.
    src_base = sum(
        (o - s) * st for o, s, st in zip(common.offsets, saved.offsets, src_strides, strict=True)
    )
    dst_base = sum(
        (o - w) * st for o, w, st in zip(common.offsets, wanted.offsets, dst_strides, strict=True)
    )
    runs = []
    for index in itertools.product(*(range(n) for n in common.sizes[:split])):
        src = src_base + sum(i * st for i, st in zip(index, src_strides[:split], strict=True))
        dst = dst_base + sum(i * st for i, st in zip(index, dst_strides[:split], strict=True))
        runs.append(Run(src * itemsize, src * itemsize + run_bytes, dst * itemsize))
    return runs


def byte_span(runs: Sequence[Run]) -> tuple[int, int]:
    """``(lo, hi)``: the one byte range of the saved buffer that holds every run, for a single
    ranged read; ``(0, 0)`` when there are no runs."""
    if not runs:
        return (0, 0)
    return (runs[0].src_start, runs[-1].src_end)


def scatter(
    runs: Iterable[Run], src: bytes | memoryview, dst: memoryview | bytearray, *, src_base: int = 0
) -> None:
    """Copy each run from ``src`` into ``dst``.

    ``src`` holds the saved buffer from byte ``src_base`` on: the whole buffer (0), or the
    bytes of one ranged read of :func:`byte_span` (its ``lo``). ``dst`` is the wanted chunk's
    whole buffer, writable.
    """
    view = memoryview(src).cast("B")
    out = memoryview(dst).cast("B")
    for start, end, at in runs:
        out[at : at + end - start] = view[start - src_base : end - src_base]
