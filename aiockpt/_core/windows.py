"""Windows: a shard staged and written in pieces when staging memory is capped.

A save whose shard is larger than its share of ``staging_memory`` is not copied into one slab.
Its shard file is cut into *windows*, consecutive byte ranges that the trainer copies, one at a
time, into two slabs of half its share each; the daemon writes each window as it comes and
hands its slab back, so staging never holds more than the two.

Windows are cut at the blocks of :func:`aiockpt._core.blocks.cut_blocks` and at no other
offset. So a window never splits a block (deduplication hashes whole blocks, as for a shard
staged whole), a tensor under ``SMALL_BYTES`` is never split, and a larger one only at a
multiple of ``BLOCK_BYTES`` from its first byte, which is also a multiple of the 64 KiB blocks
a distributed-tensor chunk's crcs are kept per. Nothing about the shard file changes: it is
byte for byte the file a save staged whole would write.
"""

from __future__ import annotations

import bisect
import sys
from collections.abc import Iterable, Sequence

from .blocks import cut_blocks

_MAX = sys.maxsize

#: Windows start and end on multiples of this in their slab (page size).
ALIGN = 4096


def cut_windows(
    spans: Iterable[tuple[int, int]], data_start: int, file_size: int, capacity: int
) -> tuple[tuple[int, int], ...]:
    """The windows of a shard file of ``file_size`` bytes whose data section starts at
    ``data_start`` and whose tensors lie at ``spans`` (absolute, file order): consecutive
    ``(start, end)`` ranges of whole blocks, each at most ``capacity`` bytes, the first one
    holding the header. Raises ValueError when a block (or the header with the first block)
    is larger than ``capacity``."""
    blocks = cut_blocks(spans, data_start, file_size)
    windows: list[tuple[int, int]] = []
    lo = 0
    hi = data_start
    if hi > capacity:
        raise ValueError(
            f"the shard's header alone is {hi} bytes, more than a staging window of {capacity}"
        )
    for a, b in blocks:
        if b - lo > capacity:
            if hi == lo or b - a > capacity:
                raise ValueError(
                    f"bytes [{a}, {b}) of the shard cannot be split, and are more than a staging "
                    f"window of {capacity}"
                )
            windows.append((lo, hi))
            lo = a
        hi = b
    if hi > lo or not windows:
        windows.append((lo, hi))
    return tuple(windows)


def least_capacity(spans: Iterable[tuple[int, int]], data_start: int, file_size: int) -> int:
    """The smallest window capacity :func:`cut_windows` accepts for this shard."""
    blocks = cut_blocks(spans, data_start, file_size)
    return max([data_start, *(b - a for a, b in blocks)])


def parts(spans: Sequence[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """``(i, start, end)`` for each non-empty span ``i`` of ``spans`` (absolute, in file
    order, disjoint) that has bytes in ``[lo, hi)``: the bytes of it there."""
    i = bisect.bisect_right(spans, (lo, _MAX))
    if i and spans[i - 1][1] > lo:
        i -= 1
    out = []
    while i < len(spans) and spans[i][0] < hi:
        a, b = spans[i]
        if b > lo and a < b:
            out.append((i, max(a, lo), min(b, hi)))
        i += 1
    return out
