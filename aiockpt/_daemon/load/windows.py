"""Loads in windows: the cut of a load's output (:func:`cut_output`), the reading of one
window (:func:`fill_window`), and streamed loads by name (:class:`_Streams`)."""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import crc32c

from ..._core import format as fmt
from ..._core.chunks import Chunk
from ..._core.protocol import LoadReply
from ..._core.shm import Segment
from ...errors import (
    CorruptCheckpointError,
    StagingMemoryError,
)
from .plan import Tensors, _Plan
from .read import assemble

if TYPE_CHECKING:
    from .reader import Reader


#: Streamed loads a daemon keeps track of at once (see Reader._streams).
MAX_STREAMS = 8


@dataclasses.dataclass
class _Stream:
    """A streamed load's windows (see StreamReq): the next one due, and the running
    crc32c of each tensor cut by the windows read so far."""

    next: int = 0
    crcs: dict[str, int] = dataclasses.field(default_factory=dict)


class _Windowed(NamedTuple):
    """A load's plan cut into windows (see cut_output), the window each box is in, the file
    offsets where each of its ranges' tensors start and end (in order: a range's tensors lie
    back to back), and a streamed load's progress."""

    plan: _Plan
    windows: tuple[tuple[int, int], ...]
    box_window: dict[str, int]
    edges: list[tuple[list[int], list[int]]]
    stream: _Stream | None = None

    @classmethod
    def of(cls, plan: _Plan, window: int, stream: _Stream | None = None) -> _Windowed:
        windows = cut_output(plan.size, window, plan.boxes, plan.out_at)
        starts = [w[0] for w in windows]
        at = {name: bisect.bisect_right(starts, plan.out_at[name]) - 1 for name, _, _ in plan.boxes}
        edges = [([r.start for _, r in run], [r.end for _, r in run]) for *_, run in plan.ranges]
        return cls(plan, windows, at, edges, stream)


def _check_split(
    seg: Segment,
    where: str,
    split: Tensors,
    shift: int,
    window: tuple[int, int],
    crcs: dict[str, int],
) -> None:
    """Fold the bytes of each tensor of ``split`` that ``window`` [a, b) holds (in ``seg`` from
    its start; a file offset minus ``shift`` is its place there) into its running crc32c in
    ``crcs``; check a tensor's once its last bytes are in."""
    a, b = window
    for name, r in split:
        lo, hi = max(r.start - shift, 0), min(r.end - shift, b - a)
        with seg.buf[lo:hi] as piece:
            crcs[name] = crc32c.crc32c(piece, crcs.get(name, 0))
        if r.end - shift <= b - a and crcs.pop(name) != r.crc32c:
            raise CorruptCheckpointError(
                f"{where}: tensor {name!r} failed its crc32c check", path=where, key=name
            )


def cut_output(
    size: int, window: int, boxes: list[tuple[str, str, Chunk]], out_at: dict[str, int]
) -> tuple[tuple[int, int], ...]:
    """The windows of a load's output of ``size`` bytes: consecutive ranges of at most
    ``window`` bytes, ending on multiples of 4096 where they can and never inside a
    distributed tensor's box (one is assembled whole); plain tensors may be cut there, at an
    element (every item size divides 4096, and a tensor starts on a multiple of its item
    size). Raises StagingMemoryError when a box is larger than ``window``."""
    spans = sorted(
        (out_at[name], out_at[name] + box.numel * fmt.DTYPE_SIZES[dtype], name)
        for name, dtype, box in boxes
    )
    if window < 4096:
        raise StagingMemoryError(
            f"a load window of {window} bytes is too small: give staging_memory at least "
            f"{4 * 4096} bytes"
        )
    for o, e, name in spans:
        if e - o > window:
            raise StagingMemoryError(
                f"{name}: its {e - o} bytes are read whole and do not fit a load window of "
                f"{window} bytes (a load under staging_memory reads through two windows of "
                f"half a save's share of it): raise staging_memory so that a window holds them"
            )
    cut: list[tuple[int, int]] = []
    pos = 0
    while pos < size:
        end = min(size, pos + window)
        if end < size:
            end = end // 4096 * 4096  # past pos: window is at least 4096
        i = bisect.bisect_right(spans, (end, end, "")) - 1
        if i >= 0 and spans[i][0] < end < spans[i][1]:
            # Never inside a box: end before it, or after it when it starts the window (it
            # fits, see above).
            end = spans[i][0] if spans[i][0] > pos else spans[i][1]
        assert end > pos
        cut.append((pos, end))
        pos = end
    return tuple(cut) or ((0, 0),)


class _Streams:
    """Streamed loads by name (see StreamReq), from their first request to their last
    window or a failure; beyond MAX_STREAMS the oldest goes first (a trainer that gave up on
    one, say when its target did not match)."""

    def __init__(self) -> None:
        self._by_name: dict[str, _Windowed] = {}

    def start(self, name: str, windowed: _Windowed) -> _Windowed:
        while len(self._by_name) >= MAX_STREAMS:
            del self._by_name[next(iter(self._by_name))]
        self._by_name[name] = windowed
        return windowed

    def part(self, name: str, part: int, read: Callable[[_Windowed], LoadReply]) -> LoadReply:
        """``read`` of stream ``name`` for its window ``part``; the stream is dropped after
        its last window, or once one fails."""
        windowed = self._by_name.get(name)
        if windowed is None:
            raise ValueError(f"window {part} of streamed load {name!r}, which was not started")
        try:
            reply = read(windowed)
        except BaseException:
            del self._by_name[name]
            raise
        if part == len(windowed.windows) - 1:
            del self._by_name[name]
        return reply


def fill_window(
    reader: Reader, seg: Segment, windowed: _Windowed, index: int, crcs: dict[str, int] | None
) -> int:
    """Read window ``index`` of a windowed load's output into ``seg`` from its start and
    check them: each tensor wholly in the window by its crc32c, each distributed box
    as it is assembled. A tensor split between windows is checked when ``crcs`` (its
    running crc32c by name, the windows filled in order) is given, that is in the pass
    that reads them all, or in a streamed load; the bytes read."""
    plan = windowed.plan
    a, b = windowed.windows[index]
    read = 0
    ranges = zip(plan.ranges, plan.bases, windowed.edges, strict=True)
    for (lo, hi, items), base, (starts, ends) in ranges:
        x, y = max(a, base), min(b, base + hi - lo)
        if x > y or (x == y and hi > lo):
            continue  # no byte of the range here (an empty one is checked where it lies)
        whole: Tensors = []
        split: Tensors = []
        # Only the tensors that end at a or later and start at b or sooner can lie in the
        # window: looking at every one would cost Python work per tensor in every window.
        first = bisect.bisect_left(ends, a - base + lo)
        for name, r in items[first : bisect.bisect_right(starts, b - base + lo)]:
            o, e = r.start - lo + base, r.end - lo + base
            if a <= o and e <= b:
                whole.append((name, r))
            elif o < b and e > a:
                split.append((name, r))
        # Read in chunks, each one's whole tensors checked while the next is read.
        span = (lo + x - base, lo + y - base)
        reader.checks.read_verified(reader.storage, seg, plan, whole, span, x - a)
        read += y - x
        if crcs is not None:
            _check_split(seg, plan.where, split, lo - base + a, (a, b), crcs)
    inside = [
        (name, dtype, box) for name, dtype, box in plan.boxes if windowed.box_window[name] == index
    ]
    if inside:
        shifted = {name: plan.out_at[name] - a for name, _, _ in inside}
        assembled = assemble(reader.catalog, reader.pool, plan, inside, shifted, seg)
        read += assembled.read_bytes if assembled else 0
    reader.checks.wait()
    return read
