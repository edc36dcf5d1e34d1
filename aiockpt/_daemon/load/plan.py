"""What a load reads: the step and shard, the records and boxes a load of a tree asks for,
and where each goes in the load's output (:class:`_Plan`), checked against the manifest."""

from __future__ import annotations

import difflib
import types
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from ..._core import format as fmt
from ..._core.blocks import ShardMap
from ..._core.catalog import Catalog
from ..._core.chunks import Chunk
from ..._core.protocol import LoadReply, TensorAt, Wanted
from ..._core.reshard import OUT_ALIGN, wanted_box
from ..._core.tree import select_paths, tensor_references, walk
from ...errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    SavedKeyNotFoundError,
)
from .graft import Borrowed

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

    Checking each tensor costs the daemon Python work per tensor (the crc32c of a small
    tensor included), with the GIL held while its reads wait for it; one crc32c of the whole
    shard costs less and releases it (see docs/performance.md). A load of every
    record and nothing else, one run of bytes [lo, nbytes), checks the chunks it reads and the
    head [0, lo), read as well while it is small, by folding their crc32c into the shard's
    (see read_whole)."""
    if len(ranges) != 1 or boxes:
        return None
    lo, hi, items = ranges[0]
    if len(items) != of or hi != shard.nbytes or lo * HEAD_PART > hi - lo:
        return None
    return shard


def saved_at(m: fmt.Manifest, rank: int, path: str) -> bool:
    """Whether ``rank``'s tree of ``m`` holds something at the key path ``path``."""
    return path not in select_paths(m.trees[rank], (path,))[1]


def check_replicated(m: fmt.Manifest, world_size: int, names: Iterable[str]) -> None:
    """On another world size only state that every rank saved identically can be loaded;
    distributed tensors are resharded, so their chunks need not be. ``names``: the tensors
    the load reads (of rank 0's shard), so a value per rank that a load does not select
    (say, each rank's RNG state) does not stop it. A rank that saved nothing at a tensor's
    key path (a full state saved by rank 0 alone) has no other value: see graft."""
    shards = sorted(m.shards, key=lambda s: s.rank)
    first = m.tensors[shards[0].file]
    differ: dict[str, list[int]] = {}
    for name in sorted(n for n in names if n not in m.dtensors):
        r = first[name]
        ranks = [
            s.rank
            for s in shards[1:]
            if ((o := m.tensors[s.file].get(name)) is None and saved_at(m, s.rank, name))
            or (o is not None and (o.crc32c, o.dtype, o.shape) != (r.crc32c, r.dtype, r.shape))
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
    WarmReq, or a second load of a step, does not sort them again (work per record, before
    the read starts)."""

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
