"""The manifest's table of distributed tensors (format version 2), shared by daemon and CLI.

A distributed tensor (a ``DTensor`` of FSDP2 or tensor parallelism) is saved once per
distinct chunk: each chunk is a tensor of one rank's shard file, stored under the tensor's
name, and the manifest's ``dtensors`` table says, per name, the global dtype and shape, the
placements and mesh it was saved from (for people; loading never needs them), and where each
chunk lies in the global tensor and in which shard. Every chunk also carries the crc32c of
each ``block_bytes`` block of its bytes, so a load that needs only part of a chunk (a
reshard) verifies the blocks it reads instead of reading the whole chunk to check it.

On the way to the manifest each rank's daemon sends its own entries (:func:`rank_json`,
one chunk or none per name) and rank 0 merges them (:func:`merge`). Everything read back
is checked by :func:`parse_dtensors` and :class:`DTensorRecord` before it is used.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import json
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import crc32c

from ..errors import CorruptCheckpointError
from .chunks import Chunk, check_chunks, overlap
from .dtypes import DTYPE_SIZES
from .gc import no_gc
from .tree import bounded_repr as _short

#: The block size of a chunk's block checksums: a partial read verifies whole blocks, so it
#: reads at most two blocks more than it uses per chunk.
BLOCK_BYTES = 64 * 1024
#: Bounds on what an untrusted table may claim.
MAX_PLACEMENTS = 16
_MAX_DIM = 2**63


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    """One saved chunk: its box in the global tensor and where its bytes are (the tensor of
    the same name in ``shard``: bytes ``[start, end)``, absolute in the file)."""

    chunk: Chunk
    shard: str
    start: int
    end: int
    crc32c: int
    #: crc32c of each BLOCK_BYTES block of the chunk's bytes, the last one shorter.
    blocks: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """The chunk's size in bytes."""
        return self.end - self.start


class DTensorRecord:
    """A distributed tensor of a checkpoint: global dtype and shape, and its chunks.

    The table's head (dtype, shape, placements, mesh) is checked when the manifest is parsed,
    its chunks when they are used: :attr:`chunks` checks every chunk and that they tile the
    tensor, :meth:`covering` only the chunks that meet one box, and that those tile the box.
    A rank loading its part of a checkpoint of 1024 ranks thus checks the few chunks it reads,
    not all 200k of the table (which cost it seconds), and every byte it uses is still
    proven to be saved exactly once.
    """

    __slots__ = (
        "_all",
        "_block",
        "_index",
        "_parsed",
        "_path",
        "_raw",
        "_tensors",
        "dtype",
        "mesh",
        "name",
        "placements",
        "shape",
    )

    def __init__(
        self,
        name: str,
        dtype: str,
        shape: tuple[int, ...],
        placements: tuple[str, ...],
        mesh: tuple[int, ...],
        raw_chunks: list[Any],
        tensors: Mapping[str, Mapping[str, Any]],
        block: int,
        path: str,
    ) -> None:
        self.name, self.dtype, self.shape = name, dtype, shape
        self.placements, self.mesh = placements, mesh
        self._raw, self._tensors, self._block, self._path = raw_chunks, tensors, block, path
        self._parsed: list[ChunkRecord | None] = [None] * len(raw_chunks)
        self._all: tuple[ChunkRecord, ...] | None = None
        #: The raw chunks' order by their start on dim 0, those starts, and the furthest end
        #: on dim 0 of each chunk and the ones before it: what covering() bisects.
        self._index: tuple[list[int], list[int], list[int]] | None = None

    def __repr__(self) -> str:
        return (
            f"DTensorRecord({self.name!r}, {self.dtype}{list(self.shape)}, {len(self._raw)} chunks)"
        )

    @property
    def nbytes(self) -> int:
        """The global tensor's size in bytes (its chunks', each element saved once)."""
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]

    @property
    def chunks(self) -> tuple[ChunkRecord, ...]:
        """Every chunk, checked, and checked to tile the tensor exactly once."""
        if self._all is None:
            chunks = tuple(self._chunk(i) for i in range(len(self._raw)))
            seen: set[str] = set()
            for c in chunks:
                if c.shard in seen:
                    raise self._bad(f"two chunks in {c.shard}")
                seen.add(c.shard)
            where = f"{self._path}: distributed tensor {_short(self.name)}"
            try:
                check_chunks(
                    self.shape, [c.chunk for c in chunks], where=where, bounds_checked=True
                )
            except CorruptCheckpointError as e:
                raise CorruptCheckpointError(str(e), path=self._path, key=self.name) from None
            self._all = chunks
        return self._all

    def covering(self, box: Chunk) -> list[ChunkRecord]:
        """The non-empty chunks that hold part of ``box``, in dim-0 order, each checked and
        together checked to tile ``box`` exactly. They are found by bisection on dim 0, so
        that a load on many ranks does not try every saved chunk against its box."""
        if not self.shape:
            return list(self.chunks)
        order, starts, reach = self._index or self._dim0_index()
        lo, hi = box.offsets[0], box.offsets[0] + box.sizes[0]
        # Chunks before `first` all end at or before lo; those from `last` start at hi or
        # later. reach is non-decreasing, so both are bisections.
        first = bisect.bisect_right(reach, lo)
        last = bisect.bisect_left(starts, hi)
        found = []
        for i in order[first:last]:
            c = self._chunk(i)
            if c.chunk.numel and (part := overlap(c.chunk, box)) is not None:
                found.append((c, part))
        if self._all is None:  # not known to tile the tensor: prove these tile the box
            self._check_box(box, found)
        return [c for c, _ in found]

    def _chunk(self, i: int) -> ChunkRecord:
        rec = self._parsed[i]
        if rec is None:
            rec = self._parsed[i] = _parse_chunk(
                self._raw[i],
                i,
                self.name,
                self.dtype,
                self.shape,
                self._tensors,
                self._block,
                self._bad,
            )
        return rec

    def _dim0_index(self) -> tuple[list[int], list[int], list[int]]:
        # Built from the raw table in bulk (C-level passes, as _ints does); covering()
        # checks each chunk it returns, and that they tile its box, so a hostile start or
        # size here can only make a load fail, never read a wrong byte.
        raw = self._raw
        try:
            starts = [c["offsets"][0] for c in raw]
            sizes = [c["sizes"][0] for c in raw]
            ints = _INT.issuperset(map(type, starts)) and _INT.issuperset(map(type, sizes))
        except (TypeError, KeyError, IndexError):
            ints = False
        if not ints:
            self.chunks  # noqa: B018 - raises, naming the bad chunk
            raise self._bad("malformed chunk table")
        order = sorted(range(len(raw)), key=starts.__getitem__)
        ends = list(map(operator.add, starts, sizes))
        index = (
            order,
            list(map(starts.__getitem__, order)),
            list(itertools.accumulate(map(ends.__getitem__, order), max)),
        )
        self._index = index
        return index

    def _check_box(self, box: Chunk, found: list[tuple[ChunkRecord, Chunk]]) -> None:
        where = f"{self._path}: distributed tensor {_short(self.name)}"
        base = box.offsets
        parts = [Chunk(tuple(map(operator.sub, p.offsets, base)), p.sizes) for _, p in found]
        try:
            if len({c.shard for c, _ in found}) != len(found):
                raise CorruptCheckpointError(f"{where}: two chunks in one shard")
            check_chunks(box.sizes, parts, where=where, bounds_checked=True)
        except CorruptCheckpointError as e:
            self.chunks  # noqa: B018 - raises what is wrong with the whole table, if anything
            raise CorruptCheckpointError(
                f"{e} (within the box at {list(box.offsets)} of sizes {list(box.sizes)})",
                path=self._path,
                key=self.name,
            ) from None

    def _bad(self, why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{self._path}: distributed tensor {_short(self.name)}: {why}",
            path=self._path,
            key=self.name,
        )


def block_crcs(data: memoryview, block: int = BLOCK_BYTES) -> list[int]:
    """The crc32c of each ``block``-byte block of ``data``, the last one shorter."""
    return [crc32c.crc32c(data[i : i + block]) for i in range(0, len(data), block)]


def blocks_for(lo: int, hi: int, nbytes: int, block: int = BLOCK_BYTES) -> tuple[int, int]:
    """``(first, end)``: the blocks of a chunk of ``nbytes`` that hold bytes ``[lo, hi)``."""
    if not 0 <= lo < hi <= nbytes:
        raise ValueError(f"bytes [{lo}, {hi}) are not inside a chunk of {nbytes}")
    return lo // block, (hi + block - 1) // block


# --------------------------------------------------------------------------- on the way in


@dataclass(frozen=True, slots=True)
class RankEntry:
    """What one rank says of a distributed tensor it saves: the global facts, and its own
    chunk when it writes one (None: another rank writes the chunk it holds, or it holds
    nothing)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    placements: tuple[str, ...]
    mesh: tuple[int, ...]
    chunk: Chunk | None


def rank_json(entries: Sequence[RankEntry], blocks: dict[str, list[int]]) -> str:
    """One rank's entries as text for rank 0's :func:`merge`, with the block crcs of the
    chunks it wrote: a first line holding the JSON list of every entry's global facts (name,
    dtype, shape, placements, mesh), then one line per entry, in the same order, holding its
    chunk's JSON object (offsets, sizes, blocks) or ``null``. ``json.dumps`` never writes a
    raw newline, so lines split the text exactly; ranks that hold the same DTensors send the
    same first line, and the merge needs no JSON decoding of their chunks."""
    dumps = functools.partial(json.dumps, separators=(",", ":"), ensure_ascii=False)
    facts = [[e.name, e.dtype, list(e.shape), list(e.placements), list(e.mesh)] for e in entries]
    lines = [dumps(facts)]
    for e in entries:
        if e.chunk is None:
            lines.append("null")
        else:
            chunk = {"offsets": list(e.chunk.offsets), "sizes": list(e.chunk.sizes)}
            lines.append(dumps({**chunk, "blocks": blocks[e.name]}))
    return "\n".join(lines)


class Disagreement(ValueError):
    """The ranks' entries of one distributed tensor do not describe the same tensor."""


@no_gc
def merge(parts: Sequence[tuple[str, str]]) -> str | None:
    """The manifest's ``dtensors`` table from each rank's (shard file, :func:`rank_json`),
    in rank order; None when no rank saved a distributed tensor.

    When every rank holds the same DTensors (the same first line, compared as text) the
    table is spliced from the ranks' chunk lines: at 1024 ranks × 200 DTensors, decoding each
    rank's entries cost more than the rest of the commit. Otherwise the entries are decoded
    and merged by name. Raises :class:`Disagreement` naming the tensor when ranks give it
    different dtypes, shapes, placements or meshes.
    """
    split = [(shard, text.split("\n")) for shard, text in parts if text]
    if not split:
        return None
    if len({lines[0] for _, lines in split}) == 1 and len(split) == len(parts):
        return _splice(split)
    return _merge_decoded(split, [rank for rank, (_, text) in enumerate(parts) if text])


def _splice(split: list[tuple[str, list[str]]]) -> str:
    facts = json.loads(split[0][1][0])
    dumps = functools.partial(json.dumps, separators=(",", ":"), ensure_ascii=False)
    shards = [',"shard":' + dumps(shard) + "}" for shard, _ in split]
    out = []
    for i, (name, dtype, shape, placements, mesh) in enumerate(facts, start=1):
        chunks = [
            lines[i][:-1] + tail
            for (_, lines), tail in zip(split, shards, strict=True)
            if lines[i] != "null"
        ]
        head = dumps({"dtype": dtype, "shape": shape, "placements": placements, "mesh": mesh})
        out.append(f'{dumps(name)}:{head[:-1]},"chunks":[{",".join(chunks)}]}}')
    return "{" + ",".join(out) + "}"


def _merge_decoded(split: list[tuple[str, list[str]]], ranks: Sequence[int] | None = None) -> str:
    """The table merged by name from decoded entries; ``ranks``: the rank of each part (by
    default its index), for the message of a Disagreement."""
    table: dict[str, dict[str, Any]] = {}
    first: dict[str, int] = {}  # the rank whose entry each name's head came from
    for rank, (shard, lines) in zip(ranks or range(len(split)), split, strict=True):
        facts = json.loads(lines[0])
        for (name, dtype, shape, placements, mesh), line in zip(facts, lines[1:], strict=True):
            entry = {"dtype": dtype, "shape": shape, "placements": placements, "mesh": mesh}
            known = table.get(name)
            if known is None:
                known = table[name] = {**entry, "chunks": []}
                first[name] = rank
            elif differ := [k for k in entry if known[k] != entry[k]]:
                raise Disagreement(
                    f"the ranks disagree on the {' and '.join(differ)} of the distributed "
                    f"tensor {name!r}: rank {first[name]}: {_describe(known)}; rank {rank}: "
                    f"{_describe(entry)}"
                )
            chunk = json.loads(line)
            if chunk is not None:
                known["chunks"].append({**chunk, "shard": shard})
    return json.dumps(table, separators=(",", ":"), ensure_ascii=False)


def _describe(entry: dict[str, Any]) -> str:
    return f"{entry['dtype']}{entry['shape']} placed {entry['placements']} on mesh {entry['mesh']}"


# --------------------------------------------------------------------------- on the way out


def parse_dtensors(
    raw: Any,
    tensors: Mapping[str, Mapping[str, Any]],
    block: Any,
    *,
    path: str,
    lazy: bool = False,
) -> dict[str, DTensorRecord]:
    """Validate an untrusted ``dtensors`` table against the manifest's ``tensors`` (shard
    file -> name -> TensorRecord); raises :class:`CorruptCheckpointError` naming the tensor.

    Every chunk's bytes must be the tensor of its name in its shard, of the table's dtype and
    of the chunk's sizes, with one block crc per ``block`` bytes; and the chunks of each
    tensor must tile it exactly (:func:`chunks.check_chunks`). With ``lazy``, only each
    tensor's head is checked now and its chunks when they are used (see DTensorRecord).
    """
    if type(block) is not int or not 1 <= block <= 1 << 30:
        raise CorruptCheckpointError(f"{path}: bad block_bytes {_short(block)}", path=path)
    if not isinstance(raw, dict):
        raise CorruptCheckpointError(f"{path}: dtensors is not an object", path=path)
    records = {name: _parse_one(name, entry, tensors, block, path) for name, entry in raw.items()}
    if not lazy:
        for rec in records.values():
            rec.chunks  # noqa: B018 - checks them all
    return records


def _parse_one(
    name: str, entry: Any, tensors: Mapping[str, Mapping[str, Any]], block: int, path: str
) -> DTensorRecord:
    where = f"{path}: distributed tensor {_short(name)}"

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: {why}", path=path, key=name)

    if not isinstance(entry, dict):
        raise bad("malformed entry")
    dtype, shape = entry.get("dtype"), entry.get("shape")
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise bad(f"unknown dtype {_short(dtype)}")
    if not _ints(shape, 0) or len(shape) > 64:
        raise bad(f"bad shape {_short(shape)}")
    placements, mesh = entry.get("placements"), entry.get("mesh")
    if (
        not isinstance(placements, list)
        or len(placements) > MAX_PLACEMENTS
        or not all(isinstance(p, str) and len(p) <= 200 for p in placements)
    ):
        raise bad(f"bad placements {_short(placements)}")
    if not _ints(mesh, 1) or len(mesh) > MAX_PLACEMENTS:
        raise bad(f"bad mesh {_short(mesh)}")
    chunks_raw = entry.get("chunks")
    if not isinstance(chunks_raw, list):
        raise bad("chunks is not a list")
    return DTensorRecord(
        name,
        dtype,
        tuple(shape),
        tuple(placements),
        tuple(mesh),
        chunks_raw,
        tensors,
        block,
        path,
    )


def _parse_chunk(
    c: Any,
    i: int,
    name: str,
    dtype: str,
    shape: tuple[int, ...],
    tensors: Mapping[str, Mapping[str, Any]],
    block: int,
    bad: Any,
) -> ChunkRecord:
    # The hot loop of a parse at 1024 ranks (200k chunks): the record of the chunk's tensor
    # in its shard was checked already, so the chunk's sizes are checked by comparing them
    # with its shape, and that shape is what the chunk keeps.
    if type(c) is not dict:
        raise bad(f"chunk {i} is malformed")
    offsets, sizes, shard, blocks = (
        c.get("offsets"),
        c.get("sizes"),
        c.get("shard"),
        c.get("blocks"),
    )
    if not isinstance(shard, str) or (in_shard := tensors.get(shard)) is None:
        raise bad(f"chunk {i} names shard {_short(shard)}, which the manifest does not list")
    rec = in_shard.get(name)
    if rec is None:
        raise bad(f"chunk {i}: {shard} holds no tensor of this name")
    ndim = len(shape)
    if (
        type(sizes) is not list
        or rec.dtype != dtype
        or rec.shape != tuple(sizes)
        or not _INT.issuperset(map(type, sizes))  # 2.0 == 2, True == 1: refused still
    ):
        raise bad(
            f"chunk {i}: {shard} holds it as {rec.dtype}{list(rec.shape)}, the table says "
            f"{dtype}{_short(sizes)}"
        )
    if not _ints(offsets, 0) or len(offsets) != ndim or len(rec.shape) != ndim:
        raise bad(f"chunk {i} has bad offsets {_short(offsets)} or sizes {_short(sizes)}")
    if not all(map(operator.le, map(operator.add, offsets, rec.shape), shape)):
        for d, (o, n, size) in enumerate(zip(offsets, rec.shape, shape, strict=True)):
            if o + n > size:
                raise bad(f"chunk {i} spans [{o}, {o + n}) on dim {d} of size {size}")
    nbytes = rec.end - rec.start
    if (
        type(blocks) is not list
        or len(blocks) != (nbytes + block - 1) // block
        or (blocks and not (_INT.issuperset(map(type, blocks)) and min(blocks) >= 0))
        or (blocks and max(blocks) >= 2**32)
    ):
        raise bad(f"chunk {i} has bad block checksums")
    return ChunkRecord(
        Chunk(tuple(offsets), rec.shape), shard, rec.start, rec.end, rec.crc32c, tuple(blocks)
    )


_INT = frozenset({int})


def _ints(value: Any, least: int) -> TypeGuard[list[int]]:
    # The hot check of a parse at 1024 ranks (400k lists): C-level passes, no generator.
    return isinstance(value, list) and (
        not value
        or (_INT.issuperset(map(type, value)) and min(value) >= least and max(value) < _MAX_DIM)
    )
