"""``aiockpt copy``: one checkpoint made self-contained in another root.

An incremental checkpoint reads some of its bytes from files of earlier steps (see
:mod:`aiockpt._core.blocks`). A copy writes each shard whole, every byte checked against the
shard's crc32c and its tensors' as it streams by, and a manifest without block tables, as a
save with ``dedup=False`` writes it, which needs nothing else of the source root.

The copy writes into the destination as a save does: under the destination's lease (taken for
the copy's duration, refused while a writer holds it), each shard under a name of this copy's
own (format.shard_filename), so nothing the destination already holds, such as a retired file
of a step with the same number, is overwritten; a failed copy removes only what it wrote.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from ._core import format as fmt
from ._core.blocks import ShardMap
from ._core.catalog import Catalog, ShardCrcs, manifest_path, publish_manifest
from ._core.leasekeeper import LeaseKeeper
from ._core.pieces import Pieces
from ._core.protocol import LeaseSpec
from .errors import CheckpointError, CorruptCheckpointError, StepExistsError

#: The destination's lease is held this long between renewals (see _core.leasekeeper).
COPY_LEASE_TTL = 30.0

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


def self_contained(raw: dict[str, Any], names: dict[str, str]) -> bytes:
    """A manifest's text without its block tables, its shard files renamed as ``names`` says
    (old name -> the copy's), at the version every new write has."""
    for shard in raw["shards"]:
        shard.pop("blocks", None)
        shard.pop("stored", None)
        shard["file"] = names[shard["file"]]
    raw["tensors"] = {names[f]: entries for f, entries in raw["tensors"].items()}
    for entry in raw.get("dtensors", {}).values():
        for chunk in entry["chunks"]:
            chunk["shard"] = names[chunk["shard"]]
    raw["version"] = fmt.NAMES_VERSION
    return json.dumps(raw, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


@contextlib.contextmanager
def holding_lease(dest: Catalog) -> Iterator[Callable[[str], None]]:
    """The destination root's lease, taken for a copy (refused with RootLockedError while a
    writer holds it) and released after; yields the fence to check before each write."""
    spec = LeaseSpec(owner=f"copy-{uuid.uuid4().hex}", ttl=COPY_LEASE_TTL, renew_every=10.0)
    keeper = LeaseKeeper(dest.storage, spec, os.getpid())
    keeper.acquire()
    keeper.start()
    try:
        yield keeper.check
    finally:
        keeper.close(release=True)


def copy_step(src: Catalog, m: fmt.Manifest, dest: Catalog, progress: Callable[[int], None]) -> int:
    """Write step ``m`` of ``src`` into ``dest``, self-contained, under ``dest``'s lease; the
    bytes written. A step already committed in ``dest`` is refused; a failure leaves no
    committed step there, and removes only the files the copy wrote."""
    with holding_lease(dest) as fence:
        return _copy(src, m, dest, progress, fence)


def _copy(
    src: Catalog,
    m: fmt.Manifest,
    dest: Catalog,
    progress: Callable[[int], None],
    fence: Callable[[str], None],
) -> int:
    step = m.step
    if dest.is_committed(step):
        raise StepExistsError(f"step {step} is already committed in {dest.where()}")
    data, where = src.manifest_bytes(step)
    fmt.parse_manifest(data, path=where, step=step)  # the copy is of what was checked
    raw = json.loads(data)
    dirname = fmt.step_dirname(step)
    tag = fmt.new_tag()
    names = {shard.file: fmt.shard_filename(shard.rank, tag) for shard in m.shards}
    fence(f"copy step {step}")
    dest.storage.makedirs(dirname)
    written = 0
    made: list[str] = []
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
            fence(f"copy step {step}")
            path = f"{dirname}/{names[shard.file]}"
            dest.storage.write_file(path, pieces)
            made.append(path)
            if not pieces.checked():
                raise CheckpointError(
                    f"{dest.where()} did not take {shard.file} in order, so its checksums "
                    "could not be checked as it was copied; nothing was committed"
                )
            written += shard.nbytes
        fence(f"commit step {step}")
        publish_manifest(dest.storage, manifest_path(step), self_contained(raw, names), step)
    except BaseException:
        # Only what this copy wrote goes: the directory may hold a retired step's files.
        for path in made:
            with contextlib.suppress(CheckpointError):
                dest.discard(step, path)
        raise
    return written
