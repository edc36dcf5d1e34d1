"""The geometry of distributed-tensor checkpoints: chunk tables and read plans.

Checked against brute force: an element-by-element count of coverage for chunk tables, and
element-by-element copies for read plans, on byte buffers built by hand.
"""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiockpt._core.chunks import (
    Chunk,
    Run,
    byte_span,
    check_chunks,
    overlap,
    read_plan,
    scatter,
)
from aiockpt.errors import CorruptCheckpointError


def rows(*bounds: int, width: int = 3) -> list[Chunk]:
    """Dim-0 chunks of a (rows, width) tensor split at ``bounds``."""
    return [Chunk((a, 0), (b - a, width)) for a, b in itertools.pairwise(bounds)]


# ---------------------------------------------------------------------------------------------
# check_chunks: tables that tile


def test_chunk_measures_its_box():
    c = Chunk((2, 0, 1), (3, 4, 0))
    assert (c.ndim, c.numel, c.ends) == (3, 0, (5, 4, 1))
    assert Chunk((), ()).numel == 1


@pytest.mark.parametrize(
    ("shape", "chunks"),
    [
        ((5, 3), rows(0, 3, 5)),  # uneven: 5 rows on 2 ranks
        ((5, 3), [*rows(0, 2, 4, 5), Chunk((5, 0), (0, 3)), Chunk((5, 0), (0, 3))]),  # empties
        ((4, 6), [Chunk((0, c), (4, 2)) for c in (4, 0, 2)]),  # dim 1, out of order
        ((4, 6), [Chunk((r, c), (2, 3)) for r in (0, 2) for c in (0, 3)]),  # a 2-D grid
        ((), [Chunk((), ())]),  # a 0-dim tensor
        ((7,), [Chunk((0,), (7,))]),  # one chunk, the whole
        ((0, 4), []),  # an empty tensor needs no chunk
        ((0, 4), [Chunk((0, 0), (0, 4))]),
        # a brick wall: no grid (column cuts differ per row), the sweep proves it disjoint
        ((2, 4), [Chunk((0, 0), (1, 2)), Chunk((0, 2), (1, 2)), Chunk((1, 0), (1, 1)),
                  Chunk((1, 1), (1, 2)), Chunk((1, 3), (1, 1))]),
    ],
)  # fmt: skip
def test_a_table_that_tiles_the_tensor_passes(shape, chunks):
    check_chunks(shape, chunks, where="w")


# ---------------------------------------------------------------------------------------------
# check_chunks: hostile tables


@pytest.mark.parametrize(
    ("shape", "chunks", "why"),
    [
        ((5, 3), rows(0, 3), "hold 9 elements"),  # a gap
        ((5, 3), rows(0, 3, 6), "spans [3, 6) on dim 0 of size 5"),  # out of bounds
        ((5, 3), [*rows(0, 3, 5), Chunk((1, 0), (1, 3))], "hold 18 elements"),  # extra
        # overlap and gap of the same size: the volume sums right, the overlap is found
        ((4, 3), [*rows(0, 2), *rows(1, 3)], "overlap"),
        ((2, 2), [Chunk((0, 0), (1, 2))] * 2, "overlap"),  # a repeated chunk
        ((2, 4), [Chunk((0, 0), (2, 3)), Chunk((0, 2), (1, 2))], "overlap"),  # no grid: swept
        # swept: the chunk that overlaps the first comes last, long after the first began
        ((4, 2), [Chunk((0, 0), (4, 1)), *(Chunk((r, 1), (1, 1)) for r in range(3)),
                  Chunk((3, 0), (1, 1))], "overlap"),
        ((), [Chunk((), ())] * 2, "hold 2 elements"),
        ((5, 3), [Chunk((0,), (5,))], "1 offsets and 1 sizes for a tensor of 2 dims"),
        ((5,), [Chunk((0, 0), (5, 1))], "2 offsets and 2 sizes for a tensor of 1 dims"),
        ((5,), [Chunk((-1,), (6,))], "offset -1 and size 6 on dim 0"),
        ((5,), [Chunk((0,), (-5,))], "offset 0 and size -5 on dim 0"),
        ((5,), [Chunk((0,), (5.0,))], "offset 0 and size 5.0"),  # type: ignore[arg-type]
        ((2,), [Chunk((False,), (True,)), Chunk((1,), (1,))], "offset False"),
        ((5,), [((0,), (5,))], "is not a chunk"),
        ((5,), [Chunk([0], [5])], "malformed"),  # type: ignore[arg-type]
        ((-5,), [], "bad global shape"),
        ((5.0,), [Chunk((0,), (5,))], "bad global shape"),
    ],
)  # fmt: skip
def test_a_hostile_table_is_refused_naming_where(shape, chunks, why):
    with pytest.raises(CorruptCheckpointError, match="^model/w: ") as caught:
        check_chunks(shape, chunks, where="model/w")
    assert why in str(caught.value)


def test_thousands_of_chunks_are_checked_by_a_sort():
    """The common tables (1-D on dim 0 or another dim, 2-D grids) take a sort, not n² pairs:
    20 000 chunks pairwise would be 2·10⁸ comparisons, minutes in Python, past the suite's
    per-test timeout. (No wall-clock assertion here: speed belongs in benchmarks.)"""
    n = 20_000
    tables = [
        ((n * 2, 8), [Chunk((2 * i, 0), (2, 8)) for i in reversed(range(n))]),
        ((8, n), [Chunk((0, i), (8, 1)) for i in range(n)]),
        ((200, 100), [Chunk((r, c), (1, 1)) for r in range(200) for c in range(100)]),
    ]
    for shape, chunks in tables:
        check_chunks(shape, chunks, where="w")  # tiles exactly: no error
    # The hostile twin of the first: one repeated row is found as fast.
    shape, chunks = tables[0]
    with pytest.raises(CorruptCheckpointError, match="overlap"):
        check_chunks(shape, [*chunks[:-1], chunks[0]], where="w")


def covers_exactly_once(shape: tuple[int, ...], chunks: list[Chunk]) -> bool:
    """Brute force: every chunk inside the tensor (empty ones too), and a count of how many
    chunks hold each element."""
    counts = dict.fromkeys(itertools.product(*map(range, shape)), 0)
    for c in chunks:
        if any(o + s > n for o, s, n in zip(*c, shape, strict=True)):
            return False
        for index in itertools.product(*(range(o, o + s) for o, s in zip(*c, strict=True))):
            if index not in counts:
                return False
            counts[index] += 1
    return all(n == 1 for n in counts.values())


@st.composite
def small_tables(draw):
    """A small shape and chunks inside it, tiling or not: a random guillotine tiling that
    may then lose, repeat or shift a chunk."""
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=0, max_size=3)))
    boxes = [Chunk((0,) * len(shape), shape)]
    for _ in range(draw(st.integers(0, 6))):
        i = draw(st.integers(0, len(boxes) - 1))
        box = boxes[i]
        cuttable = [d for d, s in enumerate(box.sizes) if s > 1]
        if not cuttable:
            continue
        d = draw(st.sampled_from(cuttable))
        at = draw(st.integers(1, box.sizes[d] - 1))
        lo = Chunk(box.offsets, (*box.sizes[:d], at, *box.sizes[d + 1 :]))
        hi_off = (*box.offsets[:d], box.offsets[d] + at, *box.offsets[d + 1 :])
        hi = Chunk(hi_off, (*box.sizes[:d], box.sizes[d] - at, *box.sizes[d + 1 :]))
        boxes[i : i + 1] = [lo, hi]
    damage = draw(st.sampled_from(["none", "drop", "repeat", "shift"]))
    if damage == "drop" and boxes:
        boxes.pop(draw(st.integers(0, len(boxes) - 1)))
    elif damage == "repeat" and boxes:
        boxes.append(draw(st.sampled_from(boxes)))
    elif damage == "shift" and shape:
        i = draw(st.integers(0, len(boxes) - 1))
        d = draw(st.integers(0, len(shape) - 1))
        offsets = list(boxes[i].offsets)
        offsets[d] = max(0, offsets[d] + draw(st.sampled_from([-1, 1])))
        boxes[i] = Chunk(tuple(offsets), boxes[i].sizes)
    return shape, draw(st.permutations(boxes))


@settings(max_examples=60, deadline=None)
@given(small_tables())
def test_check_chunks_agrees_with_counting_every_element(table):
    shape, chunks = table
    try:
        check_chunks(shape, chunks, where="w")
    except CorruptCheckpointError:
        passed = False
    else:
        passed = True
    assert passed == covers_exactly_once(shape, chunks)


# ---------------------------------------------------------------------------------------------
# overlap and read plans


def test_overlap_is_the_common_box():
    assert overlap(Chunk((0, 0), (4, 4)), Chunk((2, 3), (5, 5))) == Chunk((2, 3), (2, 1))
    assert overlap(Chunk((0,), (4,)), Chunk((4,), (2,))) is None  # touching is not sharing
    assert overlap(Chunk((0,), (4,)), Chunk((1,), (0,))) is None  # empty
    assert overlap(Chunk((), ()), Chunk((), ())) == Chunk((), ())
    with pytest.raises(ValueError, match="dims"):
        overlap(Chunk((0,), (1,)), Chunk((0, 0), (1, 1)))


def test_a_dim0_overlap_of_chunks_with_the_same_rows_is_one_run():
    # Saved rows 2..6, wanted rows 4..9 of a (10, 3) tensor of 4-byte elements.
    runs = read_plan(Chunk((2, 0), (4, 3)), Chunk((4, 0), (5, 3)), 4)
    assert runs == [Run(2 * 12, 4 * 12, 0)]
    assert byte_span(runs) == (24, 48)


def test_identical_chunks_are_one_run_of_everything():
    c = Chunk((1, 2, 3), (2, 3, 4))
    assert read_plan(c, c, 2) == [Run(0, 48, 0)]


def test_a_column_overlap_is_one_run_per_row():
    # Saved: rows 0..1, all 6 columns. Wanted: columns 2..5 of every row 0..3.
    runs = read_plan(Chunk((0, 0), (2, 6)), Chunk((0, 2), (4, 4)), 1)
    assert runs == [Run(2, 6, 0), Run(8, 12, 4)]
    assert byte_span(runs) == (2, 12)


def test_whole_trailing_dims_merge_into_the_run_of_the_dim_before():
    # (4, 4, 5): saved rows 1..2, cols 0..3; wanted rows 0..3, cols 1..2; the last dim whole.
    runs = read_plan(Chunk((1, 0, 0), (2, 4, 5)), Chunk((0, 1, 0), (4, 2, 5)), 1)
    assert runs == [Run(5, 15, 10), Run(25, 35, 20)]


def test_scalars_empties_and_strangers_have_the_runs_they_should():
    assert read_plan(Chunk((), ()), Chunk((), ()), 8) == [Run(0, 8, 0)]
    assert read_plan(Chunk((0, 0), (0, 3)), Chunk((0, 0), (5, 3)), 4) == []
    assert read_plan(Chunk((0,), (3,)), Chunk((3,), (2,)), 4) == []
    assert byte_span([]) == (0, 0)
    with pytest.raises(ValueError, match="itemsize"):
        read_plan(Chunk((0,), (3,)), Chunk((0,), (3,)), 0)


def element_bytes(index: int, itemsize: int) -> bytes:
    """A distinct value per global element, so any misplaced byte shows."""
    return ((index * 131 + 7) % 256**itemsize).to_bytes(itemsize, "little")


def box_buffer(shape: tuple[int, ...], box: Chunk, itemsize: int) -> bytes:
    """The row-major bytes of ``box`` of a tensor whose elements are ``element_bytes``."""
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    cells = itertools.product(*(range(o, o + s) for o, s in zip(*box, strict=True)))
    return b"".join(
        element_bytes(sum(i * s for i, s in zip(c, strides, strict=True)), itemsize) for c in cells
    )


@st.composite
def box_pairs(draw):
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))

    def box() -> Chunk:
        bounds = [sorted(draw(st.lists(st.integers(0, n), min_size=2, max_size=2))) for n in shape]
        return Chunk(tuple(a for a, _ in bounds), tuple(b - a for a, b in bounds))

    return shape, box(), box(), draw(st.sampled_from([1, 2, 4, 8]))


@settings(max_examples=60, deadline=None)
@given(box_pairs())
def test_a_read_plan_copies_the_overlap_and_nothing_else(case):
    shape, saved, wanted, itemsize = case
    src = box_buffer(shape, saved, itemsize)
    runs = read_plan(saved, wanted, itemsize)
    common = overlap(saved, wanted)
    # Element by element: the overlap's elements at their places, the rest untouched.
    expected = bytearray(b"\xee" * (wanted.numel * itemsize))
    if common is not None:
        w_strides = [math.prod(wanted.sizes[d + 1 :]) for d in range(wanted.ndim)]
        cells = itertools.product(*(range(o, o + s) for o, s in zip(*common, strict=True)))
        for cell in cells:
            at = sum((i - o) * s for i, o, s in zip(cell, wanted.offsets, w_strides, strict=True))
            one = Chunk(cell, (1,) * len(cell))
            expected[at * itemsize : (at + 1) * itemsize] = box_buffer(shape, one, itemsize)
    whole, ranged = bytearray(b"\xee" * len(expected)), bytearray(b"\xee" * len(expected))
    scatter(runs, src, whole)
    lo, hi = byte_span(runs)
    scatter(runs, src[lo:hi], ranged, src_base=lo)  # one ranged read, then scatter
    assert whole == expected
    assert ranged == expected
    # Runs: increasing, inside the span, adding up to the overlap, and none could merge.
    assert sum(e - s for s, e, _ in runs) == (common.numel * itemsize if common else 0)
    for (s0, e0, d0), (s1, _, d1) in itertools.pairwise(runs):
        assert e0 <= s1
        assert d0 < d1
        assert not (e0 == s1 and d0 + (e0 - s0) == d1)
    assert all(lo <= s < e <= hi for s, e, _ in runs)
