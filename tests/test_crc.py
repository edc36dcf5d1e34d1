"""A shard's crc32c folded from its tensors' equals the crc32c of its bytes."""

from __future__ import annotations

import os

import crc32c
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiockpt._core import format as fmt
from aiockpt._core.protocol import LayoutMsg
from aiockpt._crc import Shifts, combine, concat
from aiockpt._daemon.writer import FOLD_MIN_AVERAGE, Layout, checksums, shard_checksum


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=5000), st.binary(max_size=5000))
def test_combining_two_crcs_is_the_crc_of_both(a, b):
    assert combine(crc32c.crc32c(a), crc32c.crc32c(b), len(b)) == crc32c.crc32c(a + b)


def test_combining_across_large_lengths():
    a, b = os.urandom(1000), bytes(3 << 20)  # a length whose shift takes many squarings
    assert combine(crc32c.crc32c(a), crc32c.crc32c(b), len(b)) == crc32c.crc32c(a + b)
    with pytest.raises(ValueError, match="negative"):
        combine(1, 2, -1)


def layout_of(sizes: list[int], pad_before: int | None = None, header: int = 4096) -> Layout:
    """A layout of tensors of these byte sizes back to back, with a padding entry of 8 bytes
    before tensor ``pad_before`` if given (as before a DTensor chunk)."""
    specs, pos = [], 0
    for i, n in enumerate(sizes):
        if i == pad_before:
            specs.append((fmt.PAD_NAME, "U8", (8,), pos, pos + 8))
            pos += 8
        specs.append((f"t{i}", "U8", (n,), pos, pos + n))
        pos += n
    return Layout(LayoutMsg(1, header, header + pos, tuple(specs)))


@pytest.mark.parametrize(
    ("sizes", "pad_before"),
    [
        ([1 << 20, 3 << 18, 100_000], None),  # folded
        ([1 << 20, 1 << 20, 70_000], 2),  # folded, with the padding read
        ([10] * 500, None),  # tiny tensors: read again instead
        ([1 << 20, 0, 1 << 19], None),  # an empty tensor folds as nothing
    ],
)
def test_the_shard_crc_is_the_crc_of_the_shard(sizes, pad_before):
    layout = layout_of(sizes, pad_before)
    data = memoryview(os.urandom(layout.msg.file_size))
    tensor_crcs = [
        crc32c.crc32c(data[layout.msg.data_start + s.start : layout.msg.data_start + s.end])
        for s in layout.specs
    ]
    assert shard_checksum(data, layout, tensor_crcs) == crc32c.crc32c(data)
    assert checksums(data, layout)[1] == crc32c.crc32c(data)
    folded = len(layout.msg.specs) * FOLD_MIN_AVERAGE <= len(data)
    assert folded == (sizes[0] >= 1 << 20)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=12), st.integers(1, 4))
def test_folding_by_tables_is_the_crc_of_the_pieces(pieces, keep):
    shifts = Shifts(keep=keep)  # a small cache, so that tables are dropped and made again
    crcs, lengths = [crc32c.crc32c(p) for p in pieces], [len(p) for p in pieces]
    whole = crc32c.crc32c(b"".join(pieces))
    assert shifts.concat(crcs, lengths) == whole
    assert shifts.concat(crcs, lengths) == concat(zip(crcs, lengths, strict=True))


def test_folding_by_tables_across_large_lengths():
    pieces = [os.urandom(1000), bytes(3 << 20), os.urandom(13420), os.urandom(13420)]
    crcs, lengths = [crc32c.crc32c(p) for p in pieces], [len(p) for p in pieces]
    assert Shifts().concat(crcs, lengths) == crc32c.crc32c(b"".join(pieces))


# ----------------------------------------------------------------- a load's checks by runs


def check_both_ways(sizes: list[int], flips: list[tuple[int, int]]) -> tuple[str | None, ...]:
    """The tensor named by check_crcs and by _check_each (None: all passed) for tensors of
    ``sizes`` back to back, after flipping a byte of tensor i at ``offset`` for each of
    ``flips``."""
    from aiockpt._core.blocks import ShardMap
    from aiockpt._core.format import TensorRecord
    from aiockpt._core.shm import Segment
    from aiockpt._daemon.load import verify
    from aiockpt.errors import CorruptCheckpointError

    total = sum(sizes)
    seg = Segment.create(max(total, 1), kind="load", populate=False)
    try:
        data = os.urandom(total)
        items, pos = [], 0
        for i, n in enumerate(sizes):
            crc = crc32c.crc32c(data[pos : pos + n])
            items.append((f"t{i}", TensorRecord("f", "U8", (n,), 100 + pos, 100 + pos + n, crc)))
            pos += n
        seg.buf[:total] = data
        for i, offset in flips:
            at = items[i][1].start - 100 + offset % sizes[i]
            seg.buf[at] ^= 0x40
        smap = ShardMap("step_000000000001", "f", 100 + total, [], str)
        named: list[str | None] = []
        for check in (verify.check_crcs, verify._check_each):
            try:
                check(seg, items, 100, "f", smap)
                named.append(None)
            except CorruptCheckpointError as e:
                named.append(e.key)
        return tuple(named)
    finally:
        seg.close()
        seg.unlink()


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    sizes=st.lists(st.sampled_from([0, 4, 12, 12, 12, 40, 200]), min_size=1, max_size=40),
    flips=st.lists(st.tuples(st.integers(0, 39), st.integers(0, 1000)), max_size=3),
)
def test_checking_small_tensors_by_runs_names_what_checking_each_names(monkeypatch, sizes, flips):
    from aiockpt._daemon.load import verify

    # Runs of a few tensors under 100 bytes, so that small examples take every path: runs
    # folded, runs broken by a larger tensor, lengths never seen before.
    monkeypatch.setattr(verify, "RUN_CHECK_MAX", 100)
    monkeypatch.setattr(verify, "RUN_CHECK_MIN", 3)
    monkeypatch.setattr(verify, "RUN_CHECK_PER_LENGTH", 2)
    flips = [(i % len(sizes), offset) for i, offset in flips if sizes[i % len(sizes)]]
    by_runs, each = check_both_ways(sizes, flips)
    assert by_runs == each
    # Up to 3 flipped bits in a few KiB: crc32c misses none (its Hamming distance there is
    # at least 4), so a check fails exactly when the flips do not undo one another.
    assert (each is None) == _cancel(flips, sizes)


def _cancel(flips: list[tuple[int, int]], sizes: list[int]) -> bool:
    """Whether the flips undo one another (the same byte flipped an even number of times)."""
    counts: dict[tuple[int, int], int] = {}
    for i, offset in flips:
        key = (i, offset % sizes[i])
        counts[key] = counts.get(key, 0) + 1
    return all(c % 2 == 0 for c in counts.values())


def test_a_run_of_small_tensors_is_checked_whole_and_one_by_one_only_when_it_fails(
    monkeypatch,
):
    from aiockpt._daemon.load import verify

    each = verify._check_each
    one_by_one: list[int] = []

    def counted(seg, items, *args):
        one_by_one.append(len(items))
        return each(seg, items, *args)

    sizes = [64] * 2000
    monkeypatch.setattr(verify, "_check_each", counted)
    assert check_both_ways(sizes, []) == (None, None)
    assert one_by_one == [2000]  # check_both_ways' own call, none by check_crcs
    one_by_one.clear()
    assert check_both_ways(sizes, [(1234, 7)]) == ("t1234", "t1234")
    assert one_by_one == [2000, 2000]  # check_crcs' run failed and was checked one by one
