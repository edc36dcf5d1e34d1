"""The reader's loads: one rank's tensors of a step, read and verified into shared memory.

A load reads the shard in chunks and checksums each chunk's finished tensors in another
thread while the next chunk is read (crc32c releases the GIL), so the check overlaps the I/O.
A load of a whole shard checksums the chunks themselves and checks the shard's crc32c (see
:func:`whole_shard`). The trainer gets a :class:`LoadReply` saying where each verified tensor
lies.
"""

from __future__ import annotations

import bisect
import dataclasses
import difflib
import functools
import hashlib
import types
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import crc32c

from .._core import format as fmt
from .._core.blocks import ShardMap
from .._core.catalog import Catalog
from .._core.chunks import Chunk
from .._core.gc import no_gc
from .._core.protocol import LoadReply, SlabRef, TensorAt, Wanted
from .._core.reshard import OUT_ALIGN, Assembler, out_offsets, wanted_box
from .._core.shm import Segment, unlink
from .._core.tree import select_paths, tensor_references, walk
from .._crc import Shifts, combine
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    SavedKeyNotFoundError,
    StagingMemoryError,
)
from .graft import Borrowed, graft
from .shared import Slabs

#: The first read of a shard's header: enough for the header of a few hundred tensors.
HEADER_PEEK = 64 * 1024
#: Loads read this much at a time, checksumming what was read while the next chunk comes.
LOAD_CHUNK = 64 * 1024 * 1024

#: No tensors borrowed from other ranks' shards (see graft).
NOTHING: Mapping[str, Borrowed] = types.MappingProxyType({})

#: A shard's tensors: (name, record) pairs.
Tensors = list[tuple[str, fmt.TensorRecord]]

#: A load of every tensor of a shard reads its head too, for the shard's crc32c, when the head
#: is at most this part of the tensors' bytes (see whole_shard).
HEAD_PART = 16


def whole_shard(
    shard: fmt.ShardRecord,
    ranges: list[tuple[int, int, Tensors]],
    boxes: list[tuple[str, str, Chunk]],
    *,
    of: int,
) -> fmt.ShardRecord | None:
    """``shard`` when a load of ``ranges`` and ``boxes`` of it (which holds ``of`` records)
    is to be checked by the shard's own crc32c, else None (each tensor's is checked).

    Checking each tensor costs the daemon Python work per tensor (3 us, the crc32c of a small
    tensor included), with the GIL held while its reads wait for it: 60 ms at 20k tensors,
    against 22 ms for one crc32c of the whole 256 MiB, which releases it. A load of every
    record and nothing else, one run of bytes [lo, nbytes), checks the chunks it reads and the
    head [0, lo), read as well while it is small, by folding their crc32c into the shard's
    (see read_whole)."""
    if len(ranges) != 1 or boxes:
        return None
    lo, hi, items = ranges[0]
    if len(items) != of or hi != shard.nbytes or lo * HEAD_PART > hi - lo:
        return None
    return shard


def check_replicated(m: fmt.Manifest, world_size: int, names: Iterable[str]) -> None:
    """On another world size only state that every rank saved identically can be loaded;
    distributed tensors are resharded, so their chunks need not be. ``names``: the tensors
    the load reads (of rank 0's shard), so a value per rank that a load does not select
    (say, each rank's RNG state) does not stop it."""
    shards = sorted(m.shards, key=lambda s: s.rank)
    first = m.tensors[shards[0].file]
    differ: dict[str, list[int]] = {}
    for name in sorted(n for n in names if n not in m.dtensors):
        r = first[name]
        ranks = [
            s.rank
            for s in shards[1:]
            if (o := m.tensors[s.file].get(name)) is None
            or (o.crc32c, o.dtype, o.shape) != (r.crc32c, r.dtype, r.shape)
        ]
        if ranks:
            differ[name] = ranks
    if differ:
        shown = "; ".join(
            f"{name} (ranks {', '.join(map(str, ranks))} saved other values than rank 0)"
            for name, ranks in list(differ.items())[:8]
        ) + ("; …" if len(differ) > 8 else "")
        raise CheckpointError(
            f"step {m.step} was saved by {m.world_size} ranks and cannot be loaded by "
            f"{world_size} as asked: these tensors differ between ranks (only state every rank "
            f"saved identically, such as DDP-replicated weights, and distributed tensors "
            f"(DTensor), which are resharded, can be; select what you need with keys= or "
            f"strict=False): {shown}"
        )


#: The lengths of a state's tensors repeat from load to load: one table of their shifts for
#: the daemon's loads (see check_crcs).
_SHIFTS = Shifts()
#: Tensors under this many bytes are checked a run at a time (see check_crcs): crc32c holds
#: the GIL on a buffer under 32 KiB.
RUN_CHECK_MAX = 32 << 10
#: The fewest tensors checked as a run; and how many a length not in _SHIFTS yet must be
#: shared by (its tables cost 0.5 ms, the checks of 150 small tensors).
RUN_CHECK_MIN = 64
RUN_CHECK_PER_LENGTH = 256


def check_crcs(seg: Segment, items: Tensors, lo: int, where: str, smap: ShardMap) -> None:
    """Raise for the first of ``items`` (sorted by end) whose bytes in ``seg`` (the shard
    from ``lo``) fail their crc32c, naming the files that hold them when some are another
    step's.

    Small tensors that lie back to back are checked a run at a time: one crc32c of the
    run's bytes, which releases the GIL, against the crc folded from the tensors' own by
    table (0.8 us a tensor). One call per tensor held the GIL 3.4 us for each of 20k
    tensors of 13 KB, while the reader's other threads waited for it. A run that fails is
    checked tensor by tensor, to name the first that is bad."""
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


def contiguous(
    records: Mapping[str, fmt.TensorRecord], where: str
) -> list[tuple[int, int, Tensors]]:
    """The records as runs of back-to-back byte ranges: (start, end, the records in it), in
    file order. All of a shard's plain tensors are one run; a selection may be several.
    Records that overlap (their loaded views would alias) are a CorruptCheckpointError."""
    runs: list[tuple[int, int, Tensors]] = []
    items: Tensors | None = None
    lo = hi = 0
    for name, r in sorted(records.items(), key=lambda item: (item[1].start, item[1].end)):
        if items is not None:
            if r.start == hi:
                items.append((name, r))
                hi = r.end
                continue
            if r.start < hi:
                raise CorruptCheckpointError(
                    f"{where}: tensors {items[-1][0]!r} and {name!r} overlap",
                    path=where,
                    key=name,
                )
            runs.append((lo, hi, items))
        lo, hi, items = r.start, r.end, [(name, r)]
    if items is not None:
        runs.append((lo, hi, items))
    return runs


class _Runs:
    """contiguous() of the records a load read last, kept while they are the same object
    (the catalog keeps a manifest parsed while its bytes stay the same): the load after a
    WarmReq, or a second load of a step, does not sort them again (at 20k tensors 4-6 ms,
    before the read starts)."""

    def __init__(self) -> None:
        self._last: tuple[Mapping[str, fmt.TensorRecord], list[tuple[int, int, Tensors]]]
        self._last = ({}, [])

    def __call__(
        self, records: Mapping[str, fmt.TensorRecord], where: str
    ) -> list[tuple[int, int, Tensors]]:
        if self._last[0] is not records:
            self._last = (records, contiguous(records, where))
        return self._last[1]


def _selected(tree: Any, select: tuple[str, ...], required: bool, left_out: list[str]) -> Any:
    """``tree`` cut down to the key paths ``select`` names (see tree.select_paths), the key
    paths left out added to ``left_out``; when ``required``, a key that names nothing is a
    LoadMismatchError."""
    pruned, unmatched = select_paths(tree, select, left_out)
    if unmatched and required:
        missing = sorted(unmatched)
        saved = [path for path, _, _, _ in walk(tree) if path]
        hints = [
            f"{k!r}: did you mean " + " or ".join(map(repr, close))
            for k in missing
            if (close := difflib.get_close_matches(k, saved, n=3))
        ]
        raise SavedKeyNotFoundError(
            "no saved value at "
            + ", ".join(map(repr, missing))
            + (f" ({'; '.join(hints)})" if hints else "")
        )
    return pruned


def _wanted(
    m: fmt.Manifest,
    tree: Any,
    records: Mapping[str, fmt.TensorRecord],
    wanted: dict[str, Wanted] | None,
    selected: bool,
    borrowed: Mapping[str, Borrowed],
) -> tuple[Mapping[str, fmt.TensorRecord], list[tuple[str, str, Chunk]]]:
    """What a load of ``tree`` reads: the shard's records it refers to, and (name, dtype, box)
    of each distributed tensor, the box ``wanted`` gives it or the whole, and of each tensor
    ``borrowed`` from another rank's shard (see graft), the whole."""
    boxes: list[tuple[str, str, Chunk]] = []
    if not m.dtensors and not selected and not borrowed:
        return records, boxes  # every record of the shard, as in version 1
    plain, distributed = tensor_references(tree)
    for name in sorted(distributed):
        rec = m.dtensors[name]
        box = wanted_box(rec, (wanted or {}).get(name))
        if box is not None:
            boxes.append((name, rec.dtype, box))
    boxes.extend((name, b.dtype, b.box) for name, b in borrowed.items())
    return {name: records[name] for name in plain if name not in borrowed}, boxes


def _bases(ranges: list[tuple[int, int, Tensors]]) -> tuple[list[int], int]:
    """Where each range goes in a load's output (aligned to OUT_ALIGN), and where they end."""
    bases, pos = [], 0
    for lo, hi, _ in ranges:
        pos = (pos + OUT_ALIGN - 1) // OUT_ALIGN * OUT_ALIGN
        bases.append(pos)
        pos += hi - lo
    return bases, pos


def _placed(
    ranges: list[tuple[int, int, Tensors]],
    bases: list[int],
    boxes: list[tuple[str, str, Chunk]],
    out_at: dict[str, int],
) -> dict[str, TensorAt]:
    """Where each loaded tensor lies in the load's segment."""
    tensors: dict[str, TensorAt] = {}
    for (lo, _, items), base in zip(ranges, bases, strict=True):
        for name, r in items:
            tensors[name] = (r.dtype, r.shape, r.start - lo + base)
    for name, dtype, box in boxes:
        tensors[name] = (dtype, box.sizes, out_at[name])
    return tensors


class _Plan(NamedTuple):
    """What a load of ``step`` reads, and where it puts it in its output of ``size`` bytes:
    its plain ranges (the shard's bytes [lo, hi) at ``bases``), then its distributed boxes at
    ``out_at``."""

    m: fmt.Manifest
    step: int
    tree: Any
    left_out: tuple[str, ...]
    ranges: list[tuple[int, int, Tensors]]
    bases: list[int]
    boxes: list[tuple[str, str, Chunk]]
    out_at: dict[str, int]
    size: int
    smap: ShardMap
    where: str
    url: str
    #: Set when the load is checked by the shard's crc32c (see whole_shard).
    whole: fmt.ShardRecord | None = None
    #: The tensors lie where the file has them, as the trainer's layout has them (as_image).
    image: bool = False
    #: Tensors of other ranks' shards the load reads (see graft), by name.
    borrowed: Mapping[str, Borrowed] = NOTHING

    def placed(self) -> dict[str, TensorAt]:
        """Where each tensor this load reads lies in its output (nothing to say of a load
        into the file's image: the trainer's layout has it)."""
        if self.image:
            return {}
        return _placed(self.ranges, self.bases, self.boxes, self.out_at)

    def reply(self, **fields: Any) -> LoadReply:
        """The reply to this load, with ``fields`` (where the bytes are, and what was read)."""
        m = self.m
        return LoadReply(
            step=self.step,
            size=self.size,
            metrics=m.metrics,
            metadata=m.metadata,
            created_at=m.created_at,
            nbytes=m.nbytes,
            url=self.url,
            left_out=self.left_out,
            image=self.image,
            **fields,
        )


#: Streamed loads a daemon keeps track of at once (see Reader._streams).
MAX_STREAMS = 8


@dataclasses.dataclass
class _Stream:
    """A streamed load's windows (see LoadReq.stream): the next one due, and the running
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
    seg: Segment, where: str, split: Tensors, shift: int, a: int, b: int, crcs: dict[str, int]
) -> None:
    """Fold the bytes of each tensor of ``split`` that window [a, b) holds (in ``seg`` from
    its start; a file offset minus ``shift`` is its place there) into its running crc32c in
    ``crcs``; check a tensor's once its last bytes are in."""
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


class _Early:
    """The loads answered before their bytes are read (see LoadReq.early), by name: their
    plan and how to read them until read, then their plan, the bytes read and what failed, until the
    trainer collects them. The reader thread reads them, or waits for a read started ahead,
    once their answers are sent (see Daemon.read_loop): the trainer plans its restore
    meanwhile (at 20k tensors the reply's decoding, the views and the walk of the target,
    0.1 s no longer after the read).

    A read into a lent slab starts sooner, on a thread of its own, before its answer is built
    and sent: at 20k tensors the answer's entries take tens of milliseconds to make and pickle,
    and the read's requests release the GIL (later loads at 20k tensors: 324 ms against
    352 ms, the mean of six runs' medians, alternating with the tree before). A read into a new
    segment still waits for its answer, so that the trainer, which maps the segment once it
    has the name, faults the fresh pages in alongside it rather than after it."""

    def __init__(self) -> None:
        self._pending: dict[str, tuple[_Plan, Callable[[], int] | Future[int]]] = {}
        self._outcomes: dict[str, tuple[_Plan, int, BaseException | None]] = {}
        self._ahead = ThreadPoolExecutor(1, thread_name_prefix="aiockpt-early-read")

    def answer(
        self,
        name: str,
        plan: _Plan,
        read: Callable[[], int],
        segment: str | None = None,
        *,
        ahead: bool = False,
        decide: Callable[[_Plan], _Plan] | None = None,
        **fields: Any,
    ) -> LoadReply:
        """The early answer to load ``name`` (its bytes to be in the slab lent, or in
        ``segment``, with ``fields``): ``read`` reads and verifies them (the bytes read).
        With ``ahead``, the read starts now, and ``decide`` (the plan as the answer tells
        it, see as_image) runs meanwhile."""
        job = self._ahead.submit(read) if ahead else read
        self._pending[name] = (plan, job)
        try:
            if decide is not None:
                plan = decide(plan)
                self._pending[name] = (plan, job)
            return plan.reply(
                segment=segment, tensors=plan.placed(), tree=plan.tree, pending=True, **fields
            )
        except BaseException:
            self.drop()
            raise

    def drop(self) -> None:
        """Forget the loads whose answers could not be sent: a read started ahead is waited
        for (the trainer takes its slab back once it hears of the failure), the others are
        never made."""
        while self._pending:
            _, (_, job) = self._pending.popitem()
            if isinstance(job, Future):
                job.exception()

    def read(self) -> None:
        """Read the loads answered, keeping how each went."""
        while self._pending:
            name, (plan, job) = self._pending.popitem()
            try:
                self._outcomes[name] = (
                    plan,
                    job.result() if isinstance(job, Future) else job(),
                    None,
                )
            except BaseException as e:  # the trainer hears of it when it collects
                self._outcomes[name] = (plan, 0, e)

    def collect(self, name: str) -> LoadReply:
        """The end of load ``name``: its bytes are in, or the error."""
        outcome = self._outcomes.pop(name, None)
        if outcome is None:
            raise CheckpointError(
                f"no load named {name!r} was answered early here (was the daemon restarted?)"
            )
        plan, read, error = outcome
        if error is not None:
            raise error
        return plan.reply(segment=None, tensors={}, tree=None, read_nbytes=read)


def read_as_image(
    plan: _Plan, storage: Any, image: tuple[int, bytes] | None, room: int
) -> tuple[_Plan, Callable[[_Plan], _Plan] | None]:
    """A load into a lent slab of ``room`` bytes asked to read the file's ``image`` (see
    LoadReq.image): ``plan`` reading a whole shard's tensors (see whole_shard) where the
    file has them, when the slab holds the whole file, and how to tell, while they are read,
    whether they are the image asked for (see as_image); else ``plan`` as it was, and None."""
    if image is None or plan.whole is None:
        return plan, None
    ((lo, hi, _),) = plan.ranges
    if hi > room:
        return plan, None
    return plan._replace(bases=[lo], size=hi), functools.partial(
        as_image, storage=storage, image=image
    )


def as_image(plan: _Plan, storage: Any, image: tuple[int, bytes]) -> _Plan:
    """``plan``, read at file offsets (see read_as_image), marked as the file's image when
    the shard's head is the header ``image`` describes (its length and sha256: LoadReq.image),
    which says where every tensor lies. The head is read for it, while the tensors are.

    The trainer's views of the slab for that layout are then the loaded tensors: at 20k
    tensors the reply's 20k places (pickled, sent, unpickled) and the trainer's views of
    them, 50-90 ms, are not made."""
    length, digest = image
    if length != plan.bases[0]:
        return plan
    head = bytearray(length)
    with memoryview(head) as out:
        plan.smap.readinto(storage, 0, out)
    return plan._replace(image=hashlib.sha256(head).digest() == digest)


def read_whole(
    storage: Any,
    pool: ThreadPoolExecutor,
    checks: list[Future[Any]],
    seg: Segment,
    plan: _Plan,
    known_head: bytes | None = None,
) -> int:
    """Read the one range of ``plan``, a shard's bytes [lo, nbytes), into ``seg``, taking the
    crc32c of each chunk on ``pool`` while the next is read (the futures added to ``checks``,
    for the caller to wait for); then read the head [0, lo) and check the shard's crc32c. Only
    if that fails are the tensors checked one by one, to name the first that is bad (when
    none is, the damage is in the head, which the load does not use). The bytes of the head
    read (``known_head``: the head as this load's header check read it, not read again)."""
    assert plan.whole is not None
    ((lo, hi, items),) = plan.ranges
    (base,) = plan.bases
    parts: list[tuple[Future[int], int]] = []
    for off in range(0, hi - lo, LOAD_CHUNK):
        end = min(off + LOAD_CHUNK, hi - lo)
        with seg.buf[base + off : base + end] as out:
            plan.smap.readinto(storage, lo + off, out)
        crc = pool.submit(crc_of, seg, base + off, base + end)
        checks.append(crc)
        parts.append((crc, end - off))
    head: bytes | bytearray
    if known_head is not None and len(known_head) == lo:
        head = known_head  # read by this load's header check: not again
    else:
        head = bytearray(lo)
        with memoryview(head) as out:
            plan.smap.readinto(storage, 0, out)
    total = crc32c.crc32c(head)
    for crc, n in parts:
        total = combine(total, crc.result(), n)
    if total != plan.whole.crc32c:
        check_crcs(seg, items, lo - base, plan.where, plan.smap)
    return lo


def _ranges(steps: list[int]) -> str:
    shown = ", ".join(map(str, steps[-10:]))
    return shown if len(steps) <= 10 else f"…, {shown}"


def committed_step(catalog: Catalog, step: int | None) -> int:
    """``step``, or the latest when None, once it is known to be committed."""
    steps = catalog.committed_steps()
    if not steps:
        raise CheckpointNotFoundError(f"no committed checkpoint in {catalog.storage.url}")
    if step is None:
        return steps[-1]
    if step not in steps:
        raise CheckpointNotFoundError(
            f"step {step} is not a committed checkpoint in {catalog.storage.url} (committed: "
            f"{_ranges(steps)})"
        )
    return step


def deleted_under(catalog: Catalog, step: int, error: CheckpointError) -> CheckpointError:
    """What a load of ``step`` that failed with ``error`` raises: CheckpointNotFoundError when
    the step is no longer committed (retention or ``aiockpt prune`` deleted it while it was
    read), else ``error`` itself."""
    if isinstance(error, CheckpointNotFoundError):
        return error
    try:
        gone = not catalog.is_committed(step)
    except CheckpointError:
        return error  # the storage cannot say: its own error stands
    if not gone:
        return error
    return CheckpointNotFoundError(
        f"step {step} was deleted from {catalog.storage.url} while it was being loaded "
        f"(by retention, or aiockpt prune): {error}"
    )


def shard_of(
    catalog: Catalog, m: fmt.Manifest, step: int, rank: int
) -> tuple[str, fmt.ShardTensors]:
    """The path of ``rank``'s shard of ``step`` and its tensors, once the shard is there at
    the size the manifest says (a claimed size is never trusted before it is checked)."""
    shard = m.shard_of(rank)
    path = f"{fmt.step_dirname(step)}/{shard.file}"
    where = catalog.where(path)
    if not catalog.storage.exists(path):
        raise CorruptCheckpointError(f"{where}: the shard is missing", path=where)
    actual = catalog.storage.size(path)
    if actual != shard.file_size:
        raise CorruptCheckpointError(
            f"{where}: {actual} bytes on storage, the manifest says {shard.file_size}",
            path=where,
        )
    return path, m.tensors[shard.file]


def assemble(
    catalog: Catalog,
    pool: ThreadPoolExecutor,
    m: fmt.Manifest,
    step: int,
    boxes: list[tuple[str, str, Chunk]],
    out_at: dict[str, int],
    seg: Segment,
    borrowed: Mapping[str, Borrowed],
) -> Assembler | None:
    """Fill each wanted box of a distributed tensor, or tensor ``borrowed`` from another
    rank's shard, into ``seg`` at ``out_at``."""
    if not boxes:
        return None
    maps: dict[str, ShardMap] = {}

    def read(shard: str, offset: int, out: memoryview) -> None:
        smap = maps.get(shard)
        if smap is None:
            record = next(s for s in m.shards if s.file == shard)
            shard_of(catalog, m, step, record.rank)  # there, at its size
            smap = maps[shard] = catalog.shard_map(step, record)
        smap.readinto(catalog.storage, offset, out)

    def where(shard: str) -> str:
        return catalog.where(f"{fmt.step_dirname(step)}/{shard}")

    assembler = Assembler(read, pool, m.block_bytes, where)
    try:
        for name, dtype, box in boxes:
            n = box.numel * fmt.DTYPE_SIZES[dtype]
            with seg.buf[out_at[name] : out_at[name] + n] as out:
                assembler.fill(borrowed.get(name) or m.dtensors[name], box, out)
    finally:
        assembler.wait()
    return assembler


class _Streams:
    """Streamed loads by name (see LoadReq.stream), from their first request to their last
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


class _Checks:
    """The crc32c checks of a load's bytes, run on ``pool`` while the next piece is read."""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self.pool = pool
        self.futures: list[Future[Any]] = []

    def read_verified(
        self,
        storage: Any,
        seg: Segment,
        smap: ShardMap,
        items: Tensors,
        span: tuple[int, int],
        base: int,
        where: str,
    ) -> None:
        """Read bytes ``span`` [lo, hi) of the shard into ``seg`` at ``base`` and start
        checking the crc32c of each of ``items`` (the tensors in the range) as the read goes
        by (see wait)."""
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
        #: The last load in windows checked whole, by its request's fields: the windows the
        #: trainer then asks for one at a time are read by the same plan, not planned again
        #: (listing the steps, reading the manifest, checking the shard, for each window).
        self._windowed: tuple[tuple[Any, ...], _Windowed] | None = None
        self._streams = _Streams()
        self.early = _Early()
        self._runs = _Runs()

    @no_gc
    def load(
        self,
        step: int | None,
        rank: int,
        world_size: int = 1,
        slab: SlabRef | None = None,
        wanted: dict[str, Wanted] | None = None,
        select: tuple[str, ...] | None = None,
        *,
        select_required: bool = True,
        window: int = 0,
        part: int | None = None,
        early: str | None = None,
        collect: str | None = None,
        image: tuple[int, bytes] | None = None,
        stream: str | None = None,
        asked: tuple[str, ...] | None = None,
    ) -> LoadReply:
        """Read and verify a rank's tensors of ``step`` (the latest when None) into shared
        memory: into the trainer's ``slab`` when given and large enough, else into a new
        segment the trainer takes over. Distributed tensors come after the rank's plain
        tensors: the box of each that ``wanted`` names, the whole of the others. With
        ``select`` (key paths), only the values at or under those paths are read. The key
        paths of ``select``, or else of ``asked`` (those of the target restored into), at
        which a multi-rank checkpoint's tree of the rank holds nothing are read from the other
        ranks' (see graft).

        With ``window`` (bytes), the load's bytes pass through ``slab`` a window at a time
        (see :func:`cut_output`): with ``part`` None every window is read and checked and
        the reply says where each tensor lies in the whole and what the windows are; with
        ``part`` i, window i is read into the slab, at its start.

        With ``early`` (a name), the reply comes before the bytes are read (into the slab,
        or a new segment without a slab large enough; in windows, with ``part`` None; see
        :class:`_Early`); ``collect`` with that name answers once they are in (in windows:
        every window read and checked); ``image``: see :func:`read_as_image`.

        With ``stream`` (a name, and ``window``), ``part`` None reads nothing: the reply says
        where each tensor lies and what the windows are, which the trainer then asks for in
        order under the same name, each read and checked on its own, a tensor cut by windows
        by its running crc32c once its last window is in."""
        if collect is not None:
            return self.early.collect(collect)
        if stream is not None and part is not None:
            return self._streams.part(stream, part, lambda w: self._load_windowed(w, slab, part))
        key = (step, rank, world_size, wanted, select, select_required, window, asked)
        if part is not None and self._windowed is not None and self._windowed[0] == key:
            return self._load_windowed(self._windowed[1], slab, part)
        plan = self._plan(step, rank, world_size, wanted, select, select_required, asked)
        if window:
            return self._windows(plan, key, slab, window, part, early, stream)
        pooled = slab is not None and slab.size >= plan.size
        if slab is not None and pooled:
            seg = self.slabs.get(slab.name, slab.size)
            if early is not None:
                plan, decide = read_as_image(plan, self.storage, image, slab.size)
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

    def _plan(
        self,
        step: int | None,
        rank: int,
        world_size: int,
        wanted: dict[str, Wanted] | None,
        select: tuple[str, ...] | None,
        select_required: bool,
        asked: tuple[str, ...] | None,
    ) -> _Plan:
        """What a load reads (see load), checked against the manifest."""
        step, m, rank, shard, smap, where = self._shard(step, rank, world_size)
        tree, borrowed = m.trees[rank], NOTHING
        asked = select if select is not None else asked
        if asked and m.world_size > 1:
            tree, borrowed = graft(m, rank, tree, asked)
        left_out: list[str] = []
        if select is not None:
            tree = _selected(tree, select, select_required, left_out)
        records, boxes = _wanted(m, tree, shard, wanted, select is not None, borrowed)
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
        at 20k tensors, reading and parsing the manifest and checking the shard's records
        and the tree, 0.1 s of a process's first load."""
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
                    self.checks.read_verified(
                        self.storage, seg, plan.smap, items, (lo, hi), base, plan.where
                    )
            self.checks.wait()
            assembled = assemble(
                self.catalog,
                self.pool,
                plan.m,
                plan.step,
                plan.boxes,
                plan.out_at,
                seg,
                plan.borrowed,
            )
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

    def _windows(
        self,
        plan: _Plan,
        key: tuple[Any, ...],
        slab: SlabRef | None,
        window: int,
        part: int | None,
        early: str | None,
        stream: str | None,
    ) -> LoadReply:
        """A load in windows (see load), planned: kept by its request's fields (``key``), or
        by its name when streamed."""
        if stream is not None:  # nothing read yet: the windows are asked for one at a time
            windows = self._streams.start(stream, _Windowed.of(plan, window, _Stream())).windows
            return plan.reply(segment=None, tensors=plan.placed(), tree=plan.tree, windows=windows)
        windowed = _Windowed.of(plan, window)
        self._windowed = ((plan.step, *key[1:]), windowed)
        if early is not None and part is None:  # the checking pass, after the answer

            def fill() -> int:
                return self._load_windowed(windowed, slab, None).read_nbytes

            return self.early.answer(early, plan, fill, None, windows=windowed.windows)
        return self._load_windowed(windowed, slab, part)

    def _load_windowed(
        self, windowed: _Windowed, slab: SlabRef | None, part: int | None
    ) -> LoadReply:
        """A load through ``slab`` in windows (see load): all of them read and checked when
        ``part`` is None, else window ``part`` read."""
        assert slab is not None
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
        # window: at 20k tensors, looking at every one took 17 ms a window.
        first = bisect.bisect_left(ends, a - base + lo)
        for name, r in items[first : bisect.bisect_right(starts, b - base + lo)]:
            o, e = r.start - lo + base, r.end - lo + base
            if a <= o and e <= b:
                whole.append((name, r))
            elif o < b and e > a:
                split.append((name, r))
        # Read in chunks, each one's whole tensors checked while the next is read.
        span = (lo + x - base, lo + y - base)
        reader.checks.read_verified(reader.storage, seg, plan.smap, whole, span, x - a, plan.where)
        read += y - x
        if crcs is not None:
            _check_split(seg, plan.where, split, lo - base + a, a, b, crcs)
    inside = [
        (name, dtype, box) for name, dtype, box in plan.boxes if windowed.box_window[name] == index
    ]
    if inside:
        shifted = {name: plan.out_at[name] - a for name, _, _ in inside}
        assembled = assemble(
            reader.catalog, reader.pool, plan.m, plan.step, inside, shifted, seg, plan.borrowed
        )
        read += assembled.read_bytes if assembled else 0
    reader.checks.wait()
    return read
