"""``aiockpt verify``: re-read every shard of a root's checkpoints and check every checksum.

Verify streams every shard once (:meth:`Catalog.verify_shard`); :class:`ChunkBlocks` takes the
same bytes as they go by and checks the block crcs of every chunk of a distributed tensor in
the shard, the checksums a resharding load relies on.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable

import crc32c

from .._core import format as fmt
from .._core.catalog import Catalog
from .._core.dtable import ChunkRecord
from .args import Parser, add_step
from .common import Entry, Root, open_root, require_checkpoints, scan, show_entry
from .output import Progress, human_bytes, plural

#: The line of ``aiockpt --help`` that names the command.
HELP = "re-read and check every checksum"
#: What ``aiockpt verify --help`` says it does.
DESCRIPTION = (
    "Re-read every byte of every shard of every committed checkpoint (or of STEP; latest for "
    "the newest) and check each file's size and crc32c, each tensor's crc32c, each chunk's "
    "block crc32cs and the manifest itself; print one line per checkpoint and one per "
    "problem. Exit 1 when anything is corrupt or missing."
)


def add_arguments(p: Parser) -> None:
    """The arguments of ``verify``."""
    add_step(p, required=False, latest=True)
    p.add_argument("--json", action="store_true", help="one JSON object per checkpoint checked")
    p.set_defaults(func=run)


def entry_problems(root: Root, e: Entry, progress: Progress) -> list[str]:
    """What is wrong with one committed step: its manifest, or every byte of its shards."""
    if e.manifest is None:
        path = f"{e.dirname}/{fmt.MANIFEST}"
        # The error names the manifest by its URL; the line names it once, under the root.
        why = (e.error or "").removeprefix(f"{root.catalog.where(path)}: ")
        return [f"{path}: {why}"]
    problems: list[str] = []
    advance = functools.partial(progress.advance, label=f"step {e.step}")
    for shard in e.manifest.shards:
        problems += verify_shard(root.catalog, e.manifest, shard, advance)
    return problems


def run(args: argparse.Namespace) -> int:
    """``aiockpt verify``: re-read every shard and check every checksum; 1 when any fails."""
    if args.step is None:
        root = scan(open_root(args.root, args.storage_options), args.root)
        require_checkpoints(root)
        entries = root.committed
    else:
        root, entry = show_entry(args)
        entries = [entry]
    total = sum(e.manifest.nbytes for e in entries if e.manifest is not None)
    progress = Progress(total, sys.stderr)
    bad = 0
    try:
        for e in entries:
            problems = entry_problems(root, e, progress)
            progress.close()
            bad += bool(problems)
            if args.json:
                record = {"step": e.step, "ok": not problems, "problems": problems}
                print(json.dumps(record, ensure_ascii=False), flush=True)
            elif problems:
                print(f"step {e.step}: CORRUPT")
                for p in problems:
                    print(f"  {p}")
            else:
                size = human_bytes(e.manifest.nbytes) if e.manifest else ""
                print(f"step {e.step}: ok ({size})")
    finally:
        progress.close()
    n = len(entries)
    if bad:
        print(f"{bad} of {plural(n, 'checkpoint')} corrupt", file=sys.stderr)
        return 1
    print(f"{'all ' if n > 1 else ''}{plural(n, 'checkpoint')} intact", file=sys.stderr)
    return 0


class ChunkBlocks:
    """The block crcs of the distributed-tensor chunks of one shard, computed as the shard
    streams by in consecutive pieces (as :class:`~aiockpt._core.catalog.ShardCrcs` computes
    its tensors' crcs)."""

    def __init__(self, chunks: list[tuple[str, ChunkRecord]], block: int) -> None:
        self.block = block
        # A shard's tensors are disjoint: sorted by start, the chunks a piece overlaps are
        # consecutive, from the first one not yet read whole.
        self.order = sorted(chunks, key=lambda item: (item[1].start, item[1].end))
        self.first = 0
        # Per chunk: the next byte expected (absolute), the running crc of its current
        # block, and the crcs of its finished blocks.
        self.pos = [c.start for _, c in self.order]
        self.crc = [0] * len(self.order)
        self.done: list[list[int]] = [[] for _ in self.order]

    def update(self, lo: int, piece: memoryview) -> None:
        """Take in the bytes ``[lo, lo + len(piece))`` of the shard, the next after the last."""
        hi = lo + len(piece)
        i = self.first
        while i < len(self.order) and self.order[i][1].start < hi:
            self._take(i, lo, piece)
            i += 1
        while self.first < len(self.order) and self.order[self.first][1].end <= hi:
            self.first += 1

    def _take(self, i: int, lo: int, piece: memoryview) -> None:
        c = self.order[i][1]
        pos, stop = max(self.pos[i], lo), min(c.end, lo + len(piece))
        while pos < stop:
            block_end = min(c.start + (len(self.done[i]) + 1) * self.block, c.end)
            take = min(stop, block_end) - pos
            self.crc[i] = crc32c.crc32c(piece[pos - lo : pos - lo + take], self.crc[i])
            pos += take
            if pos == block_end:
                self.done[i].append(self.crc[i])
                self.crc[i] = 0
        self.pos[i] = max(self.pos[i], pos)

    def mismatches(self) -> list[str]:
        """The chunks, read whole, whose block crcs differ from their table's."""
        problems = []
        for i, (name, c) in enumerate(self.order):
            if self.pos[i] < c.end:
                continue  # not read whole: the shard's own check says why
            bad = [k for k, (a, b) in enumerate(zip(self.done[i], c.blocks, strict=True)) if a != b]
            if bad:
                shown = ", ".join(map(str, bad[:8])) + (", …" if len(bad) > 8 else "")
                problems.append(
                    f"distributed tensor {name!r}: the chunk at {list(c.chunk.offsets)} fails "
                    f"{len(bad)} of its {len(c.blocks)} block crc32c checks (block {shown})"
                )
        return problems


def verify_shard(
    catalog: Catalog,
    m: fmt.Manifest,
    shard: fmt.ShardRecord,
    progress: Callable[[int], None],
) -> list[str]:
    """Problems with one shard of step ``m``: those of :meth:`Catalog.verify_shard`, then
    every chunk of a distributed tensor in the shard whose block crcs fail, from one read;
    ``progress`` as there."""
    records = m.tensors[shard.file]
    chunks = [
        (name, c) for name, d in m.dtensors.items() for c in d.chunks if c.shard == shard.file
    ]
    if not chunks:
        return catalog.verify_shard(m.step, shard, records, progress)
    path = f"{fmt.step_dirname(m.step)}/{shard.file}"
    blocks = ChunkBlocks(chunks, m.block_bytes)
    problems = catalog.verify_shard(m.step, shard, records, progress, sink=blocks.update)
    return problems + [f"{path}: {p}" for p in blocks.mismatches()]
