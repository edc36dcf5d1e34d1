"""``aiockpt copy``: one checkpoint made self-contained in another root.

An incremental checkpoint reads some of its bytes from files of earlier steps (see
:mod:`aiockpt._core.blocks`). A copy writes each shard whole, every byte checked against the
shard's crc32c and its tensors' as it streams by, and a manifest without block tables: a
checkpoint of format version 1 or 2, as a save with ``dedup=False`` writes it, which needs
nothing else of the source root and which readers of those versions read.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import Any

from ._core import format as fmt
from ._core.blocks import ShardMap
from ._core.catalog import Catalog, ShardCrcs, manifest_path
from ._core.pieces import Pieces
from ._daemon.coord import publish_manifest
from .errors import CheckpointError, CorruptCheckpointError, StepExistsError

#: A shard streams through memory in pieces of this size.
COPY_CHUNK = 16 << 20


class _Streamed(Pieces):
    """A shard's logical bytes as consecutive pieces, read when the storage asks for each and
    checked as they go: a failed check raises from the last piece, so the write fails and
    leaves nothing behind. Nothing is kept here: a storage that writes each piece as it gets
    it holds one piece at a time."""

    def __init__(
        self,
        src: Catalog,
        smap: ShardMap,
        shard: fmt.ShardRecord,
        records: Any,
        progress: Callable[[int], None],
    ) -> None:
        self.src, self.smap, self.shard, self.progress = src, smap, shard, progress
        self.records = records
        self.n = max(1, -(-shard.nbytes // COPY_CHUNK))
        self._crcs: ShardCrcs | None = None
        self._next = 0

    def __len__(self) -> int:
        return self.n

    def piece(self, i: int) -> memoryview:
        lo = i * COPY_CHUNK
        hi = min(lo + COPY_CHUNK, self.shard.nbytes)
        piece = memoryview(bytearray(hi - lo))
        self.smap.readinto(self.src.storage, lo, piece)
        if i == 0:  # a storage may read the pieces again (a retried upload): check afresh
            self._crcs, self._next = ShardCrcs(self.records), 0
        if self._crcs is not None and i == self._next:
            self._crcs.update(lo, piece)
            self._next += 1
            self.progress(hi - lo)
            if self._next == self.n:
                problems = self._crcs.mismatches(self.shard.crc32c)
                if problems:
                    where = self.src.where(self.smap.own)
                    raise CorruptCheckpointError(
                        f"{where}: {problems[0]} (its bytes are in "
                        f"{self.smap.describe(0, self.shard.nbytes)}); nothing was copied",
                        path=where,
                    )
        return piece

    def checked(self) -> bool:
        """Whether every piece went through the check, in order (a storage that asked for
        them otherwise leaves the copy unchecked: refused)."""
        return self._next == self.n


def self_contained(raw: dict[str, Any]) -> bytes:
    """A manifest's text without its block tables, at the version its other contents need."""
    for shard in raw["shards"]:
        shard.pop("blocks", None)
        shard.pop("stored", None)
    version = fmt.tree_version(json.dumps(raw["trees"], separators=(",", ":")))
    if "dtensors" in raw:
        version = fmt.DTENSOR_VERSION
    raw["version"] = version
    return json.dumps(raw, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def copy_step(src: Catalog, m: fmt.Manifest, dest: Catalog, progress: Callable[[int], None]) -> int:
    """Write step ``m`` of ``src`` into ``dest``, self-contained; the bytes written. A step
    already committed in ``dest`` is refused; a failure leaves no committed step there."""
    step = m.step
    if dest.is_committed(step):
        raise StepExistsError(f"step {step} is already committed in {dest.where()}")
    data, where = src.manifest_bytes(step)
    fmt.parse_manifest(data, path=where, step=step)  # the copy is of what was checked
    raw = json.loads(data)
    dirname = fmt.step_dirname(step)
    dest.storage.makedirs(dirname)
    written = 0
    try:
        for shard in m.shards:
            smap = src.shard_map(step, shard)
            actual = src.storage.size(smap.own)
            if actual != shard.file_size:
                raise CorruptCheckpointError(
                    f"{src.where(smap.own)}: {actual} bytes on storage, the manifest says "
                    f"{shard.file_size}",
                    path=src.where(smap.own),
                )
            pieces = _Streamed(src, smap, shard, m.tensors[shard.file], progress)
            dest.storage.write_file(f"{dirname}/{shard.file}", pieces)
            if not pieces.checked():
                raise CheckpointError(
                    f"{dest.where()} did not take {shard.file} in order, so its checksums "
                    "could not be checked as it was copied; nothing was committed"
                )
            written += shard.nbytes
        publish_manifest(dest.storage, manifest_path(step), self_contained(raw), step)
    except BaseException:
        # What is left is a partial directory, collected by the next writer or by prune.
        with contextlib.suppress(CheckpointError):
            if not dest.is_committed(step):
                dest.remove(step)
        raise
    return written
