"""The checks of a load's bytes: each tensor's crc32c, a run of small tensors at a time,
run on a pool while the next chunk is read (:class:`_Checks`); and what a load checks once
per manifest, the rank's tree and its shard's header (:class:`_Known`)."""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import crc32c

from ..._core import format as fmt
from ..._core.blocks import ShardMap
from ..._core.shm import Segment
from ..._crc import Shifts
from ...errors import (
    CorruptCheckpointError,
)
from .plan import Tensors, _Plan

#: The first read of a shard's header: enough for the header of a few hundred tensors.
HEADER_PEEK = 64 * 1024
#: Loads read this much at a time, checksumming what was read while the next chunk comes.
LOAD_CHUNK = 64 * 1024 * 1024


#: The lengths of a state's tensors repeat from load to load: one table of their shifts for
#: the daemon's loads (see check_crcs).
_SHIFTS = Shifts()
#: Tensors under this many bytes are checked a run at a time (see check_crcs): crc32c holds
#: the GIL on a buffer under 32 KiB.
RUN_CHECK_MAX = 32 << 10
#: The fewest tensors checked as a run; and how many a length not in _SHIFTS yet must be
#: shared by (making its tables costs as much as checking many small tensors one by one).
RUN_CHECK_MIN = 64
RUN_CHECK_PER_LENGTH = 256


def check_crcs(seg: Segment, items: Tensors, lo: int, where: str, smap: ShardMap) -> None:
    """Raise for the first of ``items`` (sorted by end) whose bytes in ``seg`` (the shard
    from ``lo``) fail their crc32c, naming the files that hold them when some are another
    step's.

    Small tensors that lie back to back are checked a run at a time: one crc32c of the
    run's bytes, which releases the GIL, against the crc folded from the tensors' own by
    table (a few look-ups a tensor). One call per tensor held the GIL for each of them,
    while the reader's other threads waited for it. A run that fails is checked tensor by
    tensor, to name the first that is bad."""
    i = 0
    while i < len(items):
        j = _small_run(items, i)
        if j - i >= RUN_CHECK_MIN:
            run = items[i:j]
            lengths = [r.end - r.start for _, r in run]
            if _foldable(lengths):
                expect = _SHIFTS.concat([r.crc32c for _, r in run], lengths)
                with seg.buf[run[0][1].start - lo : run[-1][1].end - lo] as view:
                    if crc32c.crc32c(view) == expect:
                        i = j
                        continue
        j = max(j, i + 1)
        _check_each(seg, items[i:j], lo, where, smap)
        i = j


def _small_run(items: Tensors, i: int) -> int:
    """The end of the run of ``items`` from ``i`` under RUN_CHECK_MAX bytes each, each
    starting where the one before ends (``i`` itself when the first is larger)."""
    j, end = i, items[i][1].start
    while j < len(items):
        r = items[j][1]
        if r.start != end or r.end - r.start >= RUN_CHECK_MAX:
            break
        end = r.end
        j += 1
    return j


def _foldable(lengths: list[int]) -> bool:
    """Whether a run of tensors of these lengths is worth the tables its fold needs."""
    new = {n for n in lengths if n not in _SHIFTS}
    return len(new) * RUN_CHECK_PER_LENGTH <= len(lengths)


def _check_each(seg: Segment, items: Tensors, lo: int, where: str, smap: ShardMap) -> None:
    """check_crcs, one crc32c per tensor."""
    for name, r in items:
        with seg.buf[r.start - lo : r.end - lo] as view:
            if crc32c.crc32c(view) != r.crc32c:
                files = smap.describe(r.start, r.end)
                held = f" (its bytes are in {files})" if files != where else ""
                raise CorruptCheckpointError(
                    f"{where}: tensor {name!r} failed its crc32c check{held}",
                    path=where,
                    key=name,
                )


def crc_of(seg: Segment, a: int, b: int) -> int:
    """The crc32c of bytes [a, b) of ``seg``."""
    with seg.buf[a:b] as view:
        return int(crc32c.crc32c(view))


class _Checks:
    """The crc32c checks of a load's bytes, run on ``pool`` while the next piece is read."""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self.pool = pool
        self.futures: list[Future[Any]] = []

    def read_verified(
        self,
        storage: Any,
        seg: Segment,
        plan: _Plan,
        items: Tensors,
        span: tuple[int, int],
        base: int,
    ) -> None:
        """Read bytes ``span`` [lo, hi) of ``plan``'s shard into ``seg`` at ``base`` and
        start checking the crc32c of each of ``items`` (the tensors in the range) as the read
        goes by (see wait)."""
        smap, where = plan.smap, plan.where
        lo, hi = span
        by_end = sorted(items, key=lambda item: item[1].end)
        shift = lo - base  # a file offset minus this is its place in seg
        done = 0
        for off in range(0, hi - lo, LOAD_CHUNK):
            end = min(off + LOAD_CHUNK, hi - lo)
            with seg.buf[base + off : base + end] as out:
                smap.readinto(storage, lo + off, out)
            first = done
            while done < len(by_end) and by_end[done][1].end - lo <= end:
                done += 1
            self.futures.append(
                self.pool.submit(check_crcs, seg, by_end[first:done], shift, where, smap)
            )
        if done < len(by_end):  # empty tensors past the last byte read
            rest = by_end[done:]
            self.futures.append(self.pool.submit(check_crcs, seg, rest, shift, where, smap))

    def wait(self, *, quiet: bool = False) -> None:
        """Wait for the checks started; raise the first failure (unless ``quiet``)."""
        checks, self.futures = self.futures, []
        failure = None
        for check in checks:  # every one waited for: none may run on a segment closed next
            error = check.exception()
            if failure is None and error is not None and not quiet:
                failure = error
        if failure is not None:
            raise failure


class _Known:
    """What a load learns once per manifest (as the catalog keeps it) and rank: that the
    rank's tree agrees with its shard, and the shard's header (see format.check_header_agrees).
    A manifest kept by the catalog is not checked, nor its header read, again."""

    def __init__(self, storage: Any) -> None:
        self.storage = storage
        self._tree: tuple[fmt.Manifest, int] | None = None
        self._header: tuple[fmt.Manifest, int, Any, bytes] | None = None

    def check_tree(self, m: fmt.Manifest, rank: int, shard: fmt.ShardTensors, where: str) -> None:
        """Check ``rank``'s tree of ``m`` against its shard, unless it was the last checked."""
        checked = self._tree
        if checked is None or checked[0] is not m or checked[1] != rank:
            fmt.check_tree(m.trees[rank], set(shard), path=where, dtensor_names=set(m.dtensors))
            self._tree = (m, rank)

    def check_header(
        self, m: fmt.Manifest, rank: int, records: Mapping[str, fmt.TensorRecord], where: str
    ) -> None:
        """Check that ``rank``'s shard header says of ``records`` what ``m`` does (see
        format.check_header_agrees)."""
        path = f"{fmt.step_dirname(m.step)}/{m.shard_of(rank).file}"
        header, data_start = self.header(m, rank, path, where)
        fmt.check_header_agrees(header, data_start, records, path=where)

    def header(self, m: fmt.Manifest, rank: int, path: str, where: str) -> tuple[Any, int]:
        """``rank``'s shard header of ``m`` as JSON and where its data starts. The header is
        always in the shard's own file, at its start."""
        kept = self._header
        if kept is not None and kept[0] is m and kept[1] == rank:
            return kept[2], len(kept[3])
        shard = m.shard_of(rank)
        nbytes = shard.file_size
        # Where the first tensor starts is where the header ends: read exactly that much (a
        # peek reaching into the tensors would be read twice); checked against the header.
        raw = m.tensors[shard.file].raw_entries().values()
        starts = (
            r[0] for e in raw if isinstance(e, dict) and isinstance(r := e.get("byte_range"), list)
        )
        guess = min((s for s in starts if type(s) is int and 8 < s <= nbytes), default=None)
        first = self.storage.read_range(path, 0, guess or min(nbytes, HEADER_PEEK))
        end = fmt.header_length(first, nbytes, path=where)
        if end > len(first):
            first += self.storage.read_range(path, len(first), end)
        header = fmt.header_json(first[:end], path=where)
        self._header = (m, rank, header, bytes(first[:end]))
        return header, end

    def head(self, m: fmt.Manifest) -> bytes | None:
        """The bytes of the header last read, when it is of ``m``'s shard this daemon reads."""
        kept = self._header
        return kept[3] if kept is not None and kept[0] is m else None
