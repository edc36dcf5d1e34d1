"""Reading distributed tensors for a load: each wanted box assembled from the saved chunks.

A load names, per distributed tensor, the box of the global tensor it wants (the local chunk
of the DTensor it restores into, or the whole tensor). For every saved chunk that overlaps
that box, :func:`chunks.read_plan` gives the byte runs to copy and :func:`chunks.byte_span`
the one range of the chunk that holds them. Only that range is read:

- a chunk used whole (the same layout as saved, or a coarser one) is read straight into its
  place in the output when it lands there as one run, and checked against its crc32c;
- a chunk used in part (a finer layout) is read block-aligned, each ``block_bytes`` block
  checked against its block crc32c, and the runs copied into place.

Every byte used is checked. Where the overlap is one run (FSDP's dim-0 sharding, however the
rows are redistributed) a chunk's read exceeds what is used by at most one block at each end;
where it is strided (a dim-1 chunk read into dim-0 boxes) the one range also spans the gaps
between the runs, which costs bytes but keeps it one request. Checksums run on the caller's
pool while the next chunk is read.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import crc32c

from ..errors import CorruptCheckpointError, LoadMismatchError
from . import dtable
from .chunks import Chunk, Run, byte_span, read_plan, scatter
from .dtypes import DTYPE_SIZES
from .protocol import Wanted

#: Where the bytes of a shard file are read: ``read(shard_file, offset, out)``.
ReadInto = Callable[[str, int, memoryview], None]

#: Output boxes start on this boundary in the load's segment.
OUT_ALIGN = 64


def wanted_box(rec: dtable.DTensorRecord, want: Wanted | None) -> Chunk | None:
    """The box of ``rec`` a load wants: the whole tensor without a target, the target's own
    chunk with one (None: the target's rank holds none of it). Raises
    :class:`LoadMismatchError` when the target is not the saved tensor's dtype and shape."""
    if want is None:
        return Chunk((0,) * len(rec.shape), rec.shape)
    dtype, shape, box = want
    if tuple(shape) != rec.shape or dtype != rec.dtype:
        raise LoadMismatchError(
            f"{rec.name}: saved {rec.dtype}{list(rec.shape)} does not fit {dtype}{list(shape)}"
        )
    if box is None:
        return None
    chunk = Chunk(tuple(box[0]), tuple(box[1]))
    if len(chunk.sizes) != len(rec.shape) or any(
        o < 0 or o + s > n for o, s, n in zip(chunk.offsets, chunk.sizes, rec.shape, strict=True)
    ):
        raise LoadMismatchError(f"{rec.name}: the target's chunk {box} lies outside the tensor")
    return chunk


class Covered(Protocol):
    """What :meth:`Assembler.fill` needs of a tensor: its name and dtype, and its chunks
    that hold part of a box (a :class:`dtable.DTensorRecord`; or a plain tensor read whole
    as one chunk: another rank's (see graft.Borrowed), or one of a safetensors file)."""

    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    def covering(self, box: Chunk) -> list[dtable.ChunkRecord]: ...


class Assembler:
    """Fills boxes of distributed tensors in ``out`` from the chunks of their shards.

    With ``checked`` False (a source without checksums: a plain safetensors file) each chunk
    is read over exactly the bytes its runs span, and nothing is checked."""

    def __init__(
        self,
        read: ReadInto,
        pool: ThreadPoolExecutor,
        block: int,
        where: Callable[[str], str],
        *,
        checked: bool = True,
    ) -> None:
        self.read = read
        self.pool = pool
        self.block = block
        self.where = where
        self.checked = checked
        self.checks: list[Future[None]] = []
        #: Bytes read from storage, and bytes of the boxes filled.
        self.read_bytes = 0
        self.used_bytes = 0

    def fill(self, rec: Covered, box: Chunk, out: memoryview) -> None:
        """Assemble ``box`` of ``rec`` into ``out`` (its row-major bytes)."""
        itemsize = DTYPE_SIZES[rec.dtype]
        self.used_bytes += box.numel * itemsize
        for saved in rec.covering(box):
            self._copy(rec.name, saved, read_plan(saved.chunk, box, itemsize), out)

    def _copy(self, name: str, saved: dtable.ChunkRecord, runs: list[Run], out: memoryview) -> None:
        lo, hi = byte_span(runs)
        n = saved.nbytes
        if not self.checked:
            self._unchecked(saved, runs, lo, hi, out)
            return
        if lo == 0 and hi == n and len(runs) == 1:
            # The whole chunk lands as one run: read it into place, check it there.
            dst = out[runs[0].dst_offset : runs[0].dst_offset + n]
            self.read(saved.shard, saved.start, dst)
            self.read_bytes += n
            self._check(name, saved, dst, [saved.crc32c], whole=True)
            return
        if lo == 0 and hi == n:
            first, end, start, stop, expect, whole = 0, 0, 0, n, [saved.crc32c], True
        else:
            first, end = dtable.blocks_for(lo, hi, n, self.block)
            start, stop = first * self.block, min(end * self.block, n)
            expect, whole = list(saved.blocks[first:end]), False
        buf = bytearray(stop - start)
        view = memoryview(buf)
        self.read(saved.shard, saved.start + start, view)
        self.read_bytes += stop - start
        # The bytes are copied before their check ends: a failed check fails the whole load,
        # and nobody sees ``out`` then.
        scatter(runs, view, out, src_base=start)
        self._check(name, saved, view, expect, whole=whole)

    def _unchecked(
        self, saved: dtable.ChunkRecord, runs: list[Run], lo: int, hi: int, out: memoryview
    ) -> None:
        """Read bytes [lo, hi) of ``saved`` and copy its runs into place: one run is read
        straight there."""
        self.read_bytes += hi - lo
        if len(runs) == 1:
            at = runs[0].dst_offset
            self.read(saved.shard, saved.start + lo, out[at : at + hi - lo])
            return
        buf = memoryview(bytearray(hi - lo))
        self.read(saved.shard, saved.start + lo, buf)
        scatter(runs, buf, out, src_base=lo)

    def _check(
        self,
        name: str,
        saved: dtable.ChunkRecord,
        data: memoryview,
        expect: list[int],
        *,
        whole: bool,
    ) -> None:
        where = self.where(saved.shard)
        block = self.block

        def check() -> None:
            if whole:
                ok = crc32c.crc32c(data) == expect[0]
            else:
                ok = all(
                    crc32c.crc32c(data[i * block : (i + 1) * block]) == crc
                    for i, crc in enumerate(expect)
                )
            if not ok:
                raise CorruptCheckpointError(
                    f"{where}: the chunk of {name!r} at {list(saved.chunk.offsets)} failed its "
                    "crc32c check",
                    path=where,
                    key=name,
                )

        self.checks.append(self.pool.submit(check))

    def wait(self) -> None:
        """Wait for every check; raise the first failure."""
        checks, self.checks = self.checks, []
        for c in checks:
            c.result()


def out_offsets(base: int, boxes: list[tuple[str, str, Chunk]]) -> tuple[dict[str, int], int]:
    """Where each (name, dtype, box) goes in a load's segment after ``base`` bytes of plain
    tensors, and the segment's total size."""
    offsets, pos = {}, base
    for name, dtype, box in boxes:
        pos = (pos + OUT_ALIGN - 1) // OUT_ALIGN * OUT_ALIGN
        offsets[name] = pos
        pos += math.prod(box.sizes) * DTYPE_SIZES[dtype]
    return offsets, pos
