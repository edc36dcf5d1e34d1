"""Deduplicated shard writes: blocks whose bytes a kept checkpoint already holds are referred
to, not written again (see :mod:`aiockpt._core.blocks` for the format).

**What a save deduplicates against.** The blocks of this rank's shard in the checkpoint this
writer committed last (at start-up, the newest committed step). That checkpoint is never
deleted by the retention pass that follows its commit, nor by any pass before the next commit
(retention spares the step just committed and the newest one), and the files it refers to are
kept while it is: so whatever a save refers to stays on storage until that save has committed
and become the reference point itself. On several ranks this needs no coordination: rank 0
prunes before the others hear that a step committed, and each rank's next save starts after.

**Not waiting for hashes.** Hashing a block costs about a sixth of writing it, so a save does
not hash everything before it writes. A block can only be a duplicate of a base block of the
same length; this writer remembers a 128-byte sample of each block it wrote (16 words spread
over it), so a block whose sample differs from every base block of its length is new for sure
and is written at once (a trained weight changes everywhere). The other blocks, the
candidates, are hashed on the pool while the sure ones are written, and written after them,
only if their hash is not the base's. Every block's hash is computed either way (it goes in
the manifest), off the writing thread. After a restart no samples are known: every block
that has a base block of its length is a candidate for the first save.

**Checksums without another pass.** A new block's crc32c is computed by the task that hashes
it, while its bytes are in cache; a block whose hash the base holds has the base block's bytes,
hence its crc, which this writer remembers (after a restart, the first save computes them with
the hashes). A tensor cut into whole blocks gets its crc folded from theirs (see
:mod:`aiockpt._crc`), so unchanged weights are read once, to hash them, and no more.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import crc32c
import xxhash

from .._core import blocks as bl
from .._core import format as fmt
from .._core.pieces import Pieces

#: Bytes sampled per block to tell a changed block without hashing it.
_SAMPLES = 16
_WORD = 8


def digest(view: memoryview) -> str:
    """A block's content hash, as stored in the manifest."""
    return xxhash.xxh3_128_hexdigest(view)


def digest_and_crc(view: memoryview) -> tuple[str, int]:
    """A block's hash and crc32c, in one task while its bytes are in cache."""
    return digest(view), crc32c.crc32c(view)


def sample(view: memoryview) -> bytes:
    """A few words spread over a block: equal blocks have equal samples."""
    n = len(view)
    if n <= _SAMPLES * _WORD:
        return bytes(view)
    step = (n - _WORD) // (_SAMPLES - 1)
    return b"".join(view[i * step : i * step + _WORD] for i in range(_SAMPLES))


@dataclass
class Base:
    """What a save may refer to: the blocks of the last committed shard of this rank."""

    #: (length, hash) -> (source path relative to the root, offset in it)
    where: dict[tuple[int, str], tuple[str, int]]
    #: (length, sample) of the blocks whose bytes this writer saw; None after a restart.
    samples: set[tuple[int, bytes]] | None
    #: The committed step these blocks are of (None: nothing to refer to).
    step: int | None = None
    #: The size of each file the blocks are in (what a save referring to it keeps alive).
    sizes: dict[str, int] = field(default_factory=dict)
    #: (length, hash) -> the block's crc32c, for the blocks this writer saw (none after a
    #: restart: the manifest keeps crcs per tensor, not per block).
    crcs: dict[tuple[int, str], int] = field(default_factory=dict)

    @classmethod
    def empty(cls) -> Base:
        return cls({}, set())

    @classmethod
    def of_shard(cls, step: int, shard: fmt.ShardRecord, size: Callable[[str], int]) -> Base:
        """The blocks of a committed shard read back from its manifest (no samples);
        ``size`` tells the size of a file it refers to."""
        own = f"{fmt.step_dirname(step)}/{shard.file}"
        where = {(b.length, b.digest): (b.source or own, b.offset) for b in shard.blocks}
        sizes = {own: shard.file_size}
        for source in {b.source for b in shard.blocks if b.source}:
            sizes[source] = size(source)
        return cls(where, None, step, sizes)

    def lengths(self) -> set[int]:
        return {length for length, _ in self.where}


class Plan(Pieces):
    """One shard's bytes as the storage is asked to write them: the header and the blocks new
    for sure, in runs, then one item per candidate, decided when the storage reaches it (its
    bytes, or an empty view when the base holds them). Decisions are made once."""

    def __init__(
        self,
        data: memoryview,
        blocks: list[tuple[int, int]],
        data_start: int,
        base: Base,
        pool: ThreadPoolExecutor,
        *,
        reads: Counter[str] | None = None,
        pace: float = 1.0,
        known: dict[int, tuple[str, int]] | None = None,
    ) -> None:
        """The plan of ``data``: a header of ``data_start`` bytes, then ``blocks`` (offsets in
        ``data``, tiling the rest; see blocks.cut_blocks). A shard staged in windows makes
        one plan per window (the header in the first): ``reads`` then counts, across them,
        the bytes referred to in each base file, and ``pace`` is the part of the shard seen
        by the end of this window (see :meth:`_decide`). ``known``: the hash and crc32c of
        blocks whose bytes are those of a block of the same save slot written before (see
        writer.Remembered): they are not read at all, and referred to when the base holds
        them."""
        self.data = data[:]  # a view of its own, released when the plan is done
        self.base = base
        self.blocks = blocks
        self.data_start = data_start
        self._reads = Counter() if reads is None else reads
        self._pace = pace
        self.known = known or {}
        self.samples = [sample(data[lo:hi]) for lo, hi in self.blocks]
        lengths = base.lengths()
        seen = base.samples
        self.candidate = [
            (hi - lo, self.known[i][0]) in base.where
            if i in self.known
            else (hi - lo) in lengths and (seen is None or (hi - lo, s) in seen)
            for i, ((lo, hi), s) in enumerate(zip(self.blocks, self.samples, strict=True))
        ]
        # The candidates' hashes first: the writes of the others wait for nothing. Their
        # crcs too where the base knows none (the base's crc serves a block it holds).
        self._pool = pool
        self._hashes: dict[int, Future[str]] = {}
        self._both: dict[int, Future[tuple[str, int]]] = {}
        self._late: dict[int, Future[int]] = {}  # crcs computed after the write
        for i, c in enumerate(self.candidate):
            if c and i not in self.known:
                view = data[self.blocks[i][0] : self.blocks[i][1]]
                if base.crcs:
                    self._hashes[i] = pool.submit(digest, view)
                else:
                    self._both[i] = pool.submit(digest_and_crc, view)
        # Runs of sure blocks, the header joined to the first when they touch.
        runs: list[list[int]] = [[0, data_start]]
        for i, c in enumerate(self.candidate):
            if c:
                continue
            lo, hi = self.blocks[i]
            if runs[-1][1] == lo:
                runs[-1][1] = hi
            else:
                runs.append([lo, hi])
        self._runs = [(lo, hi) for lo, hi in runs]
        self._candidates = [i for i, c in enumerate(self.candidate) if c]
        self._decided: dict[int, bool] = {}  # candidate index -> whether it is written

    def hash_rest(self) -> None:
        """Start hashing the blocks new for sure, with their crcs (their hashes go in the
        manifest only)."""
        for i, (lo, hi) in enumerate(self.blocks):
            if i not in self._hashes and i not in self._both and i not in self.known:
                self._both[i] = self._pool.submit(digest_and_crc, self.data[lo:hi])

    def _hash(self, i: int) -> str:
        if i in self.known:
            return self.known[i][0]
        both = self._both.get(i)
        return both.result()[0] if both is not None else self._hashes[i].result()

    def hashes(self) -> list[str]:
        """Every block's hash, once the plan is written."""
        return [self._hash(i) for i in range(len(self.blocks))]

    def tiles(self, spans: list[tuple[int, int]]) -> list[range | None]:
        """For each (start, end) byte span of the shard: the blocks that tile it exactly,
        first to last, or None when it shares a block with another span."""
        starts = [lo for lo, _ in self.blocks]
        out: list[range | None] = []
        for a, b in spans:
            j = bisect.bisect_left(starts, a)
            k = j
            while k < len(self.blocks) and self.blocks[k][1] <= b:
                k += 1
            tiled = a < b and j < k and starts[j] == a and self.blocks[k - 1][1] == b
            out.append(range(j, k) if tiled else None)
        return out

    def block_crcs(self) -> list[int]:
        """Every block's crc32c, once the plan is written: computed with its hash, or the
        base's for a block the base holds, or computed now (a candidate the base turned out
        not to hold)."""
        late = self._late
        known: dict[int, int] = {}
        for i, (lo, hi) in enumerate(self.blocks):
            both = self._both.get(i)
            if both is not None:
                known[i] = both.result()[1]
                continue
            if i in self.known:
                known[i] = self.known[i][1]
                continue
            crc = self.base.crcs.get((hi - lo, self._hashes[i].result()))
            if crc is None:
                late[i] = self._pool.submit(crc32c.crc32c, self.data[lo:hi])
            else:
                known[i] = crc
        known.update((i, f.result()) for i, f in late.items())
        return [known[i] for i in range(len(self.blocks))]

    def __len__(self) -> int:
        return len(self._runs) + len(self._candidates)

    def piece(self, i: int) -> memoryview:
        if i < len(self._runs):
            lo, hi = self._runs[i]
            return self.data[lo:hi]
        block = self._candidates[i - len(self._runs)]
        lo, hi = self.blocks[block]
        return self.data[lo:hi] if self._written(block) else self.data[lo:lo]

    def _written(self, block: int) -> bool:
        if not self._decided:
            self._decide()
        return self._decided[block]

    def _decide(self) -> None:
        """Which candidates are written: those the base does not hold, and those in a file
        this save would read less than half of (referring to a few blocks would keep the
        whole file alive), so a kept file is always at least half read by a kept step.

        A shard staged in windows decides each window as it comes, before the next is
        known: a file is referred to while the bytes read from it so far keep pace with
        that half (half its size times the part of the shard seen so far)."""
        found: dict[int, str] = {}
        reads = self._reads
        for i in self._candidates:
            lo, hi = self.blocks[i]
            hit = self.base.where.get((hi - lo, self._hash(i)))
            if hit is not None:
                found[i] = hit[0]
                reads[hit[0]] += hi - lo
        sizes, pace = self.base.sizes, self._pace
        worth = {path for path, n in reads.items() if 2 * n >= sizes.get(path, 0) * pace > 0}
        for i in self._candidates:
            self._decided[i] = found.get(i) not in worth

    def wait(self) -> None:
        """Let every hash finish (none may run on the slab once the save lets it go)."""
        for f in self._hashes.values():
            f.exception()
        for both in self._both.values():
            both.exception()
        for late in self._late.values():
            late.exception()

    def release(self) -> None:
        """Let go of the slab: a view kept (by a traceback, say) would keep it mapped."""
        self.data.release()

    def table(self, own: str, step: int, crcs: list[int]) -> tuple[list[bl.Block], int, Base]:
        """Once written: the block table, the own file's size, and the base for the next
        save (``own``: this shard's path relative to the root, of step ``step``; ``crcs``:
        :meth:`block_crcs`)."""
        where: dict[int, tuple[str, int]] = {}
        run_at, at = [], 0  # where each run starts in the own file
        for lo, hi in self._runs:
            run_at.append(at)
            at += hi - lo
        run = 0
        for i, (a, b) in enumerate(self.blocks):
            if self.candidate[i]:
                continue
            while self._runs[run][1] < b:
                run += 1
            where[i] = ("", run_at[run] + a - self._runs[run][0])
        for i in self._candidates:
            lo, hi = self.blocks[i]
            if self._written(i):
                where[i] = ("", at)
                at += hi - lo
            else:
                where[i] = self.base.where[(hi - lo, self._hash(i))]
        table = []
        nxt: dict[tuple[int, str], tuple[str, int]] = {}
        nxt_crcs: dict[tuple[int, str], int] = {}
        sizes = {own: at}
        for i, (lo, hi) in enumerate(self.blocks):
            source, offset = where[i]
            h = self._hash(i)
            table.append(bl.Block(hi - lo, h, source, offset))
            nxt.setdefault((hi - lo, h), (source or own, offset))
            nxt_crcs[(hi - lo, h)] = crcs[i]
            if source:
                sizes[source] = self.base.sizes[source]
        samples = {(hi - lo, s) for (lo, hi), s in zip(self.blocks, self.samples, strict=True)}
        return table, at, Base(nxt, samples, step, sizes, nxt_crcs)


def shard_fields(table: list[bl.Block], stored: int) -> dict[str, Any]:
    """The manifest's fields of a deduplicated shard (none for a shard without data, whose
    own file is its header)."""
    if not table:
        return {}
    return {"stored": stored, "blocks": [b.json() for b in table]}
