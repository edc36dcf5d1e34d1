"""A shard's block table: where each block of its bytes is stored (format version 3).

A save with deduplication on (the default) cuts the shard's data section into *blocks* (see
:func:`cut_blocks`) and records, per block, its length, its xxh3-128 content hash and where
its bytes are: in this shard's own file, at some offset, or in a file of another committed
step of the same root that already holds the same bytes. A shard is always *logically* the
same safetensors file as before, byte for byte; only where its bytes live changes. Readers
map a logical byte range to the files holding it (:class:`ShardMap`), and every check made
of the logical bytes (tensor crc32c, the whole shard's crc32c) is unchanged.

When every block is in the shard's own file and in order, the file *is* the logical shard: the
manifest keeps its version (1 or 2) and the table is an extra field that older readers
ignore. As soon as one block lives elsewhere, or out of order, the manifest is version 3,
which older readers refuse. No chain is ever followed: a block refers to the file that holds
its bytes, never to another step's table.
"""

from __future__ import annotations

import bisect
import errno
import itertools
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointError, CorruptCheckpointError
from .tree import bounded_repr as _short

#: Large tensors are cut into blocks of this size, so one changed row of an embedding table
#: rewrites 16 MiB of it, not the table; a 1 GiB shard has 64 entries.
BLOCK_BYTES = 16 << 20
#: Tensors smaller than this are grouped with their neighbours into runs of about this size,
#: so 20,000 small tensors make a few hundred blocks, not 20,000.
SMALL_BYTES = 1 << 20
#: The content hash's name (xxh3-128, 32 lowercase hex digits).
HASH = "xxh3-128"
_HEX = re.compile(r"[0-9a-f]{32}", re.ASCII)
#: A block's source: a shard file of a step, by its path under the root (untagged in versions
#: 1-3, tagged by the attempt that wrote it from version 4 on: see format.shard_filename).
_REF = re.compile(r"step_(\d{12})/shard_r\d{5}(\.[0-9a-f]{16})?\.safetensors", re.ASCII)


def cut_blocks(spans: Iterable[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """The blocks of a data section ``[start, end)`` whose tensors lie at ``spans`` (absolute
    ``(begin, end)`` pairs, in file order): each tensor of ``SMALL_BYTES`` or more is cut
    into ``BLOCK_BYTES`` pieces from its first byte; smaller ones are grouped, in order, into
    runs that close once they reach ``SMALL_BYTES``. The blocks tile ``[start, end)``."""
    cuts = [start]

    def cut(at: int) -> None:
        if at > cuts[-1]:
            cuts.append(at)

    run = start  # where the current run of small tensors began
    for lo, hi in spans:
        if hi - lo >= SMALL_BYTES:
            cut(lo)
            for at in range(lo + BLOCK_BYTES, hi, BLOCK_BYTES):
                cut(at)
            cut(hi)
            run = hi
        elif hi - run >= SMALL_BYTES:
            cut(hi)
            run = hi
    cut(end)
    return list(itertools.pairwise(cuts))


@dataclass(frozen=True, slots=True)
class Block:
    """One block of a shard: ``length`` bytes of hash ``digest`` (hex), stored in ``source``
    (a path relative to the root; "" for the shard's own file) at ``offset``."""

    length: int
    digest: str
    source: str
    offset: int

    def json(self) -> list[Any]:
        return [self.length, self.digest, self.source, self.offset]


@dataclass(frozen=True, slots=True)
class Extent:
    """Logical bytes ``[lo, hi)`` of a shard are bytes ``[offset, offset + hi - lo)`` of
    ``path`` (relative to the root)."""

    lo: int
    hi: int
    path: str
    offset: int


def in_order(blocks: Sequence[Block], data_start: int) -> bool:
    """Whether a table describes a file that is the logical shard itself: every block in the
    own file, at its logical offset."""
    at = data_start
    for b in blocks:
        if b.source or b.offset != at:
            return False
        at += b.length
    return True


def is_block_source(source: Any, own: str, *, tagged: bool = True) -> bool:
    """Whether ``source`` names a shard file other than ``own`` (the shard's own file, by its
    path under the root). ``tagged`` False (versions 1-3, whose names repeat): only an
    untagged file of another step's directory."""
    m = _REF.fullmatch(source) if isinstance(source, str) else None
    if m is None or source == own:
        return False
    return tagged or (m.group(2) is None and m.group(1) != own[5:17])


def parse_blocks(
    raw: Any, *, nbytes: int, stored: Any, own: str, tagged: bool, path: str, file: str
) -> tuple[tuple[Block, ...], int]:
    """Validate a shard's untrusted block table; return it and the own file's size.

    The blocks tile the data section, which ends at ``nbytes``; the own file (``own``, its
    path under the root) holds the header at offset 0 and its blocks after it, disjoint and
    within ``stored`` bytes; a block stored elsewhere names another shard file (see
    :func:`is_block_source` for ``tagged``)."""

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{path}: shard {file}: {why}", path=path)

    if not isinstance(raw, list) or not raw:
        raise bad("the block table is not a non-empty list")
    if type(stored) is not int or not 8 <= stored <= nbytes:
        raise bad(f"bad stored size {_short(stored)}")
    blocks = []
    total = 0
    for entry in raw:
        if not isinstance(entry, list) or len(entry) != 4:
            raise bad(f"malformed block {_short(entry)}")
        length, digest, source, offset = entry
        if type(length) is not int or length <= 0 or type(offset) is not int or offset < 0:
            raise bad(f"malformed block {_short(entry)}")
        if not isinstance(digest, str) or not _HEX.fullmatch(digest):
            raise bad(f"block hash {_short(digest)} is not 32 hex digits")
        if not isinstance(source, str):
            raise bad(f"malformed block {_short(entry)}")
        if source and not is_block_source(source, own, tagged=tagged):
            raise bad(f"block source {_short(source)} is not another shard file of the root")
        total += length
        blocks.append(Block(length, digest, source, offset))
    data_start = nbytes - total
    if data_start < 8:
        raise bad("the blocks hold more bytes than the shard")
    spans = sorted((b.offset, b.offset + b.length) for b in blocks if not b.source)
    last = data_start  # the header [0, data_start) is the own file's first bytes
    for lo, hi in spans:
        if lo < last or hi > stored:
            raise bad("its own blocks overlap each other or lie outside its file")
        last = hi
    return tuple(blocks), stored


def missing(storage: Any, path: str, error: CheckpointError) -> bool:
    """Whether ``path``, which a storage call failed on with ``error``, is not there at all
    (the checkpoint's fault) rather than unreachable (the storage's): ENOENT, or the
    storage saying so when asked; a storage that cannot answer is failing."""
    if getattr(error, "errno", None) == errno.ENOENT:
        return True
    try:
        return not storage.exists(path)
    except CheckpointError:
        return False


class ShardMap:
    """Where each logical byte of one shard is: its own file and the files its blocks refer
    to. Reads through it check nothing themselves; the crc32c of what they read is checked by
    the caller, as for any shard."""

    def __init__(
        self, step_dir: str, file: str, nbytes: int, blocks: Sequence[Block], where: Any
    ) -> None:
        self.own = f"{step_dir}/{file}"
        self.step_dir = step_dir
        self.where = where  # path -> URL, for messages
        own = self.own
        if not blocks:
            self.extents = [Extent(0, nbytes, own, 0)]
        else:
            data_start = nbytes - sum(b.length for b in blocks)
            extents = [Extent(0, data_start, own, 0)]
            at = data_start
            for b in blocks:
                source = b.source or own
                last = extents[-1]
                if last.path == source and last.offset + (last.hi - last.lo) == b.offset:
                    extents[-1] = Extent(last.lo, at + b.length, source, last.offset)
                else:
                    extents.append(Extent(at, at + b.length, source, b.offset))
                at += b.length
            self.extents = extents
        self._starts = [e.lo for e in self.extents]

    def pieces(self, lo: int, hi: int) -> list[Extent]:
        """The extents holding logical bytes ``[lo, hi)``, cut to them, in order."""
        out = []
        i = max(bisect.bisect_right(self._starts, lo) - 1, 0)
        while lo < hi and i < len(self.extents):
            e = self.extents[i]
            a, b = max(lo, e.lo), min(hi, e.hi)
            if a < b:
                out.append(Extent(a, b, e.path, e.offset + a - e.lo))
            lo = max(lo, b)
            i += 1
        return out

    def referenced(self) -> list[str]:
        """The other steps' files this shard's bytes are read from."""
        return sorted({e.path for e in self.extents if e.path != self.own})

    def readinto(self, storage: Any, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the logical bytes from ``offset``; a referenced file that is
        missing or short is a :class:`CorruptCheckpointError` naming it and its step."""
        pieces = self.pieces(offset, offset + len(out))
        if sum(e.hi - e.lo for e in pieces) != len(out):
            where = self.where(self.own)
            raise CorruptCheckpointError(
                f"{where}: bytes {offset}..{offset + len(out)} lie outside the shard", path=where
            )
        for e in pieces:
            # Released on the way out, an error included: a view left to a traceback would
            # keep the caller's shared memory from closing.
            with out[e.lo - offset : e.hi - offset] as view:
                if e.path == self.own:
                    storage.readinto(e.path, e.offset, view)
                    continue
                try:
                    storage.readinto(e.path, e.offset, view)
                except CorruptCheckpointError:
                    raise
                except CheckpointError as err:
                    if not self._gone(storage, e.path, e.offset + len(view)):
                        raise  # the storage failed (an outage, say), not the checkpoint
                    where = self.where(e.path)
                    raise CorruptCheckpointError(
                        f"{where}: written by step {int(e.path[5:17])} and referenced by "
                        f"{self.where(self.own)}, cannot be read: {err}",
                        path=where,
                    ) from None

    @staticmethod
    def _gone(storage: Any, path: str, end: int) -> bool:
        """Whether a referenced file that failed a read is missing or shorter than ``end``:
        the checkpoint's fault. Asked once the read failed; a storage that cannot answer
        either is failing, and its error is the one to raise."""
        try:
            return bool(storage.size(path) < end)
        except CorruptCheckpointError:
            return True
        except CheckpointError as err:
            return missing(storage, path, err)

    def describe(self, lo: int, hi: int) -> str:
        """The files holding logical bytes ``[lo, hi)``, with the step that wrote each, for an
        error message."""
        names = []
        for e in self.pieces(lo, hi):
            if e.path == self.own:
                names.append(self.where(e.path))
            else:
                names.append(f"{self.where(e.path)} (written by step {int(e.path[5:17])})")
        return ", ".join(dict.fromkeys(names))


def needs_refs_version(shard: dict[str, Any]) -> bool:
    """Whether a shard object (as the writer builds it) needs format version 3: some block
    stored elsewhere, or the own file not the logical shard in order."""
    raw = shard.get("blocks")
    if not raw:
        return False
    table = [Block(*entry) for entry in raw]
    data_start = shard["nbytes"] - sum(b.length for b in table)
    return shard["stored"] != shard["nbytes"] or not in_order(table, data_start)
