"""The manifest read back: its records, and their validation as untrusted input (whole, by
its head alone for listings, or lazily, each record as a load uses it)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, ItemsView, Iterator, Mapping, ValuesView
from dataclasses import dataclass, field
from typing import Any

from ...errors import CorruptCheckpointError
from .. import values
from ..blocks import Block, in_order, is_block_source, parse_blocks
from ..dtable import BLOCK_BYTES, DTensorRecord, parse_dtensors
from ..gc import no_gc
from ..tree import bounded_repr as _short
from .header import _check_disjoint, _tensor_spec
from .names import (
    _SHARD_FILE,
    DTENSOR_VERSION,
    FORMAT,
    NAMES_VERSION,
    REFS_VERSION,
    VERSION,
    VERSIONS,
    step_dirname,
)


@dataclass(frozen=True, slots=True)
class ShardRecord:
    """A shard in the manifest: its file, the rank that wrote it, its (logical) size and its
    crc32c; with a block table, the size of its own file and where each block is stored."""

    file: str
    rank: int
    nbytes: int
    crc32c: int
    #: The size of the shard's own file: ``nbytes`` unless some blocks are stored elsewhere.
    stored: int = -1
    #: The block table (blocks.py); empty when the manifest has none.
    blocks: tuple[Block, ...] = ()

    @property
    def file_size(self) -> int:
        """The size the shard's own file must have."""
        return self.nbytes if self.stored < 0 else self.stored

    @property
    def referenced_nbytes(self) -> int:
        """The bytes of this shard stored in other steps' files."""
        return sum(b.length for b in self.blocks if b.source)


@dataclass(frozen=True, slots=True)
class TensorRecord:
    """A tensor in the manifest: byte range [start, end) is absolute within its shard file."""

    shard: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int
    crc32c: int


class ShardTensors(Mapping[str, TensorRecord]):
    """One shard's tensors (name -> record), each checked when it is first looked up.

    A load uses a few of them: at 1024 ranks × 200 distributed tensors a manifest lists 200k,
    and checking them all cost a loading rank more than its load planned. ``items()`` and
    ``values()`` check every entry, and that no two overlap in the file; a lookup checks one,
    and whoever reads several records into one buffer checks that they do not overlap (see
    the reader's ``contiguous``). Keys and ``in`` need no check (JSON keys are strings).
    """

    __slots__ = ("_all", "_done", "_file", "_limit", "_path", "_raw")

    def __init__(self, file: str, raw: dict[str, Any], limit: int, path: str) -> None:
        self._file, self._raw, self._limit, self._path = file, raw, limit, path
        self._done: dict[str, TensorRecord] = {}
        self._all: dict[str, TensorRecord] | None = None

    def __getitem__(self, name: str) -> TensorRecord:
        rec = self._done.get(name)
        if rec is None:
            entry = self._raw[name]  # KeyError for a name the shard does not hold
            rec = self._done[name] = _tensor_record(
                self._file, name, entry, self._limit, self._path
            )
        return rec

    def raw_entries(self) -> Mapping[str, Any]:
        """The entries as the manifest has them, unchecked (see check_header_agrees)."""
        return self._raw

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)

    def __contains__(self, name: object) -> bool:
        return name in self._raw

    def checked(self) -> dict[str, TensorRecord]:
        """Every record, checked, and none overlapping another."""
        if self._all is None:
            records = {name: self[name] for name in self._raw}
            _check_disjoint([(r.start, r.end, n) for n, r in records.items()], self._path)
            self._all = records
        return self._all

    def items(self) -> ItemsView[str, TensorRecord]:
        return self.checked().items()

    def values(self) -> ValuesView[TensorRecord]:
        return self.checked().values()


def _tensor_record(file: str, name: str, entry: Any, limit: int, path: str) -> TensorRecord:
    dtype, shape, start, end = _tensor_spec(name, entry, limit, path, offsets_key="byte_range")
    crc = entry.get("crc32c")
    if type(crc) is not int or not 0 <= crc < 2**32:
        raise CorruptCheckpointError(
            f"{path}: tensor {_short(name)}: bad crc32c", path=path, key=name
        )
    return TensorRecord(file, dtype, shape, start, end, crc)


@dataclass(frozen=True, slots=True)
class Manifest:
    """A validated manifest. ``tensors`` maps shard file -> tensor name -> record;
    ``trees`` maps rank -> that rank's state tree.

    A manifest parsed ``lazily`` checks each shard's tensor records and each distributed
    tensor's chunks when they are used (see :class:`ShardTensors` and
    :class:`~aiockpt._core.dtable.DTensorRecord`); otherwise all of it was checked."""

    step: int
    created_at: float
    world_size: int
    shards: list[ShardRecord]
    tensors: dict[str, ShardTensors]
    trees: dict[int, Any]
    metrics: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    #: The distributed tensors by name (format version 2; empty in version 1).
    dtensors: dict[str, DTensorRecord] = field(default_factory=dict)
    version: int = VERSION
    #: The block size of the chunks' block checksums (version 2).
    block_bytes: int = BLOCK_BYTES

    @property
    def nbytes(self) -> int:
        """The size of the checkpoint: all its shards' bytes."""
        return sum(s.nbytes for s in self.shards)

    @property
    def stored_nbytes(self) -> int:
        """The bytes this step's own files hold (its shards' bytes less what they refer to)."""
        return sum(s.file_size for s in self.shards)

    @property
    def referenced_nbytes(self) -> int:
        """The bytes of this step read from files of other steps."""
        return sum(s.referenced_nbytes for s in self.shards)

    def referenced_files(self) -> set[str]:
        """The files of other steps (paths relative to the root) this step reads from."""
        return {b.source for s in self.shards for b in s.blocks if b.source}

    def shard_of(self, rank: int) -> ShardRecord:
        """The shard rank ``rank`` wrote; KeyError when there is none."""
        for s in self.shards:
            if s.rank == rank:
                return s
        raise KeyError(rank)


def check_header_agrees(
    header: Mapping[str, Any], data_start: int, records: Mapping[str, Any], *, path: str
) -> None:
    """Refuse a shard whose own safetensors header (``header``, see header_json; its data
    starting at ``data_start``) says something else of a tensor of ``records`` (those a load
    reads, checked) than the manifest does: its dtype, its shape or where its bytes lie.

    The tensors' crc32c cover their bytes, not what the bytes mean: a dtype changed to one
    of the same size (F32 to I32), or a shape to another of the same size, in either the
    header or the manifest, would pass them. The two descriptions are written together and
    must agree."""
    if isinstance(records, ShardTensors):  # all of them: their raw entries, already checked
        described: Iterator[tuple[str, Any, Any, Any]] = (
            (n, e["dtype"], e["shape"], e["byte_range"]) for n, e in records.raw_entries().items()
        )
    else:
        described = ((n, r.dtype, list(r.shape), [r.start, r.end]) for n, r in records.items())
    for name, dtype, shape, span in described:
        h = header.get(name)
        if (
            not isinstance(h, dict)
            or h.get("dtype") != dtype
            or h.get("shape") != shape
            or h.get("data_offsets") != [span[0] - data_start, span[1] - data_start]
        ):
            raise CorruptCheckpointError(
                f"{path}: the shard's header and the manifest disagree on tensor {name!r}: "
                f"the header says {_short(h)}, the manifest dtype {dtype}, shape {shape}, "
                f"bytes {span}",
                path=path,
            )


def _decode_manifest(data: bytes, path: str) -> tuple[dict[str, Any], Callable[[str], Exception]]:
    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{path}: {why}", path=path)

    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise bad(f"manifest is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise bad("manifest is not a JSON object")
    return raw, bad


def _manifest_head(
    raw: dict[str, Any], bad: Callable[[str], Exception], step: int | None
) -> tuple[int, float, dict[str, Any]]:
    """The checked (step, created_at, metrics) of a decoded manifest."""
    if raw.get("format") != FORMAT:
        raise bad(f"not an aiockpt manifest (format {_short(raw.get('format'))})")
    version = raw.get("version")
    if type(version) is not int or version not in VERSIONS:  # not True or 1.0, which equal 1
        raise bad(
            f"unsupported format version {_short(version)} (this aiockpt reads versions "
            f"{', '.join(map(str, VERSIONS))}; a newer aiockpt wrote it?)"
        )
    m_step = raw.get("step")
    if type(m_step) is not int or m_step < 0 or (step is not None and m_step != step):
        raise bad(f"manifest step {_short(m_step)} does not match its directory")
    created = raw.get("created_at")
    # JSON decodes numbers to exact ints and floats; bool is the subclass to keep out.
    if isinstance(created, bool) or not isinstance(created, (int, float)):
        raise bad("bad created_at")
    if not math.isfinite(created):
        raise bad("bad created_at")
    metrics = raw.get("metrics", {})
    if not isinstance(metrics, dict):
        raise bad("metrics and metadata must be objects")
    for k, v in metrics.items():
        # The rules save() applies (values.py): what one refuses, the other never wrote.
        why = values.text_problem(k) or values.metric_problem(v)
        if why is not None:
            raise bad(f"metric {_short(k)}: {why}")
    return m_step, float(created), metrics


@no_gc
def parse_manifest_record(
    data: bytes, *, path: str, step: int | None = None
) -> tuple[float, dict[str, Any], frozenset[str]]:
    """What retention and best_step read of an untrusted manifest: (created_at, metrics),
    checked as parse_manifest checks them, and the files of other steps its block tables
    refer to (for keeping them, so only names that are such files are taken). The rest (20k
    tensor entries, say) is left to the full check of a load: at start-up and for retention
    it would be work per tensor for every checkpoint."""
    raw, bad = _decode_manifest(data, path)
    m_step, created, metrics = _manifest_head(raw, bad, step)
    refs = set()
    shards = raw.get("shards")
    tagged = raw["version"] >= NAMES_VERSION
    for shard in shards if isinstance(shards, list) else ():
        table = shard.get("blocks") if isinstance(shard, dict) else None
        own = f"{step_dirname(m_step)}/{shard.get('file')}" if isinstance(shard, dict) else ""
        for entry in table if isinstance(table, list) else ():
            if (
                isinstance(entry, list)
                and len(entry) == 4
                and is_block_source(entry[2], own, tagged=tagged)
            ):
                refs.add(entry[2])
    return created, metrics, frozenset(refs)


def _parse_shards(
    raw: dict[str, Any], world: int, m_step: int, bad: Callable[[str], Exception], path: str
) -> list[ShardRecord]:
    """The checked shard objects of a decoded manifest: names of the manifest's version,
    ranks, sizes, crcs and block tables."""
    shards_raw = raw.get("shards")
    if not isinstance(shards_raw, list) or len(shards_raw) != world:
        raise bad("the shards do not match the world size")
    shards: list[ShardRecord] = []
    for s in shards_raw:
        if not isinstance(s, dict):
            raise bad("malformed shard entry")
        f, r, nb, crc = s.get("file"), s.get("rank"), s.get("nbytes"), s.get("crc32c")
        if not isinstance(f, str) or (m := _SHARD_FILE.fullmatch(f)) is None:
            raise bad(f"shard file name {_short(f)} is not a plain shard name")
        if (m.group(2) is None) == (raw["version"] >= NAMES_VERSION):
            # Version 4 names every file by its attempt; earlier versions never did.
            raise bad(f"shard file name {f} does not match format version {raw['version']}")
        if type(r) is not int or r != int(m.group(1)) or not 0 <= r < world:
            raise bad(f"shard {f}: bad rank {_short(r)}")
        if type(nb) is not int or nb < 8:
            raise bad(f"shard {f}: bad size {_short(nb)}")
        if type(crc) is not int or not 0 <= crc < 2**32:
            raise bad(f"shard {f}: bad crc32c {_short(crc)}")
        blocks: tuple[Block, ...] = ()
        stored = -1
        if "blocks" in s:
            blocks, stored = parse_blocks(
                s["blocks"],
                nbytes=nb,
                stored=s.get("stored"),
                own=f"{step_dirname(m_step)}/{f}",
                tagged=raw["version"] >= NAMES_VERSION,
                path=path,
                file=f,
            )
            if raw["version"] < REFS_VERSION and (
                stored != nb or not in_order(blocks, nb - sum(b.length for b in blocks))
            ):
                raise bad(f"shard {f}: a version {raw['version']} shard is its own file, in order")
        shards.append(ShardRecord(f, r, nb, crc, stored, blocks))
    return shards


@no_gc
def parse_manifest_head(data: bytes, *, path: str, step: int | None = None) -> Manifest:
    """What listings show of an untrusted manifest, from its head alone (see
    Catalog.manifest_head): step, time, shards with their block tables, metrics and
    metadata, checked as parse_manifest checks them; no tensors, trees or distributed
    tensors (empty), which a load or verify checks in full."""
    raw, bad = _decode_manifest(data, path)
    m_step, created, metrics = _manifest_head(raw, bad, step)
    world = _world_size(raw, bad)
    shards = _parse_shards(raw, world, m_step, bad, path)
    metadata = _metadata(raw, bad)
    return Manifest(
        m_step, created, world, shards, {}, {}, metrics, metadata, {}, raw["version"], BLOCK_BYTES
    )


def _world_size(raw: dict[str, Any], bad: Callable[[str], Exception]) -> int:
    world = raw.get("world_size")
    if type(world) is not int or not 1 <= world <= 1 << 20:
        raise bad(f"bad world_size {_short(world)}")
    return world


def _metadata(raw: dict[str, Any], bad: Callable[[str], Exception]) -> dict[str, Any]:
    """The checked metadata of a decoded manifest: the same rules save() applies (values.py).
    It is pickled to the trainer on load; too deep a value would fail there instead."""
    metadata = raw.get("metadata", {})
    if not isinstance(metadata, dict):
        raise bad("metrics and metadata must be objects")
    found = values.json_problem(metadata)
    if found is not None:
        raise bad(f"metadata {found[0] or '<root>'}: {found[1]}")
    return metadata


@no_gc
def parse_manifest(
    data: bytes, *, path: str, step: int | None = None, lazy: bool = False
) -> Manifest:
    """Validate an untrusted manifest. Raises :class:`CorruptCheckpointError` naming ``path``.

    ``lazy``: check the head, shards and trees now, and each tensor record and distributed
    tensor chunk when it is first used (a load, which uses a part); every value a caller gets
    is checked either way.
    """
    raw, bad = _decode_manifest(data, path)
    m_step, created, metrics = _manifest_head(raw, bad, step)
    world = _world_size(raw, bad)
    shards = _parse_shards(raw, world, m_step, bad, path)
    sizes = {s.file: s.nbytes for s in shards}
    if len(sizes) != len(shards):
        raise bad("a shard is listed twice")
    tensors_raw = raw.get("tensors")
    if not isinstance(tensors_raw, dict) or set(tensors_raw) != set(sizes):
        raise bad("tensors must map each shard file to its tensors")
    tensors: dict[str, ShardTensors] = {}
    for shard, entries in tensors_raw.items():
        if not isinstance(entries, dict):
            raise bad(f"tensors of {shard} is not an object")
        tensors[shard] = ShardTensors(shard, entries, sizes[shard], path)
        if not lazy:
            tensors[shard].checked()
    trees_raw = raw.get("trees")
    if not isinstance(trees_raw, dict) or set(trees_raw) != {str(s.rank) for s in shards}:
        raise bad("trees must map each rank to its state tree")
    trees = {int(r): t for r, t in trees_raw.items()}
    version = raw["version"]
    dtensors: dict[str, DTensorRecord] = {}
    block: Any = BLOCK_BYTES
    if "dtensors" in raw:  # version 2, with distributed tensors
        if version < DTENSOR_VERSION:
            raise bad("a version 1 manifest has no dtensors")
        block = raw.get("block_bytes")  # checked by parse_dtensors
        dtensors = parse_dtensors(raw["dtensors"], tensors, block, path=path, lazy=lazy)
    metadata = _metadata(raw, bad)
    return Manifest(
        m_step, created, world, shards, tensors, trees, metrics, metadata, dtensors, version, block
    )
