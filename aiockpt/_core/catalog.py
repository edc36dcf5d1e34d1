"""What a checkpoint root holds, read and changed through its :class:`~aiockpt.storage.Storage`.

One catalog serves the daemon (listing steps, loading, retention, collecting partial saves)
and the ``aiockpt`` command (ls, show, verify, prune), so both see a root the same way: the
same step directories, the same bounded and validated manifest reads, the same order of
deletion (manifest first) and the same checksums.

A step directory is *committed* when it holds a manifest and *partial* when it does not (a
save that is still writing, or one a crash cut short). What is read from storage is
untrusted: manifests are size-checked before they are read and validated as they are parsed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterable, Mapping

import crc32c

from ..errors import CheckpointError, CorruptCheckpointError, StepExistsError
from ..retention import CheckpointRecord
from ..storage import Storage
from . import format as fmt
from .blocks import ShardMap, missing
from .pruning import held_files, plan_prune

__all__ = ["MAX_MANIFEST_BYTES", "VERIFY_CHUNK", "Catalog", "ShardCrcs", "publish_manifest"]

#: A manifest larger than this is refused before it is read. The largest legitimate ones are
#: those of distributed tensors, whose chunks list a crc32c per 64 KiB (about 11 bytes each):
#: 1 GiB holds the tables of about 6 TB of such state, or 8 million plain tensors.
MAX_MANIFEST_BYTES = 1 << 30
#: Listings and retention read a manifest's head (its step, times, shards, metrics and
#: metadata) from at most this many of its first bytes (see Catalog.manifest_head).
HEAD_BYTES = 16 << 20
#: The first read of a manifest's head.
HEAD_PEEK = 64 << 10
#: How many places a head may be cut at before a manifest is read whole or refused.
_HEAD_TRIES = 4


def _cut_head(data: bytes) -> bytes | None:
    """The manifest's head, cut before its ``"tensors"`` member and closed, when ``data``
    (its first bytes) holds it; None when it does not. A key "tensors" may also occur in the
    metadata: the first few places that parse are tried."""
    at = 0
    for _ in range(_HEAD_TRIES):
        at = data.find(b',"tensors":', at + 1)
        if at < 0:
            return None
        head = data[:at] + b"}"
        try:
            json.loads(head)
        except (UnicodeDecodeError, ValueError, RecursionError):
            continue
        return head
    return None


#: Verification reads a shard in pieces of this size: bounded memory, whatever its size.
VERIFY_CHUNK = 16 << 20


#: How many steps' parsed manifests a catalog keeps (see Catalog.read_manifest).
PARSED_KEPT = 2


def manifest_path(step: int) -> str:
    """The path of a step's manifest, relative to the root."""
    return f"{fmt.step_dirname(step)}/{fmt.MANIFEST}"


def publish_manifest(storage: Storage, path: str, manifest: bytes, step: int) -> None:
    """Commit: create the manifest at ``path``, conditionally where the storage can (so of
    two writers committing one step, one wins and the other hears StepExistsError). Saves
    and ``aiockpt copy`` commit through it."""
    put_if_absent = getattr(storage, "put_if_absent", None)
    if put_if_absent is None:
        storage.put_atomic(path, manifest)
    elif not put_if_absent(path, manifest):
        raise StepExistsError(
            f"step {step} was committed in {storage.url} by another writer while this save "
            "ran; this save's shard was left in place"
        )


class Catalog:
    """The committed and partial steps of one root, and the few ways to read and change them."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        #: The files of other steps each committed step reads from (manifests never change).
        self._refs: dict[int, frozenset[str]] = {}
        #: step -> (manifest bytes, their lazy parse), see read_manifest.
        self._parsed: dict[int, tuple[bytes, fmt.Manifest]] = {}

    def where(self, path: str = "") -> str:
        """The URL of ``path`` under the root (of the root itself when empty)."""
        base = self.storage.url.rstrip("/")
        return f"{base}/{path}" if path else base

    # ----------------------------------------------------------------- listing

    def listed_steps(self) -> list[int]:
        """Every step with a directory in the root, committed or not, from one listing.

        A stale listing can only hide steps (storage never lists what was never written)."""
        steps = (fmt.parse_step_dirname(name) for name in self.storage.list_dir(""))
        return sorted(step for step in steps if step is not None)

    def is_committed(self, step: int) -> bool:
        """Whether the step's manifest exists."""
        return self.storage.exists(manifest_path(step))

    def step_dirs(self) -> dict[int, bool]:
        """Each step directory's step, ascending, mapped to whether it holds a manifest."""
        return {step: self.is_committed(step) for step in self.listed_steps()}

    def committed_steps(self) -> list[int]:
        """Steps whose manifest exists, fresh from storage, ascending."""
        return [step for step, committed in self.step_dirs().items() if committed]

    # ----------------------------------------------------------------- manifests

    def _manifest_size(self, step: int) -> tuple[str, str, int]:
        """A step's manifest's path, URL and size, refused when it is too large."""
        path = manifest_path(step)
        where = self.where(path)
        size = self.storage.size(path)
        if size > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(
                f"{where}: manifest of {size} bytes is too large", path=where
            )
        return path, where, size

    def manifest_bytes(self, step: int) -> tuple[bytes, str]:
        """A step's manifest, refused unread when it is too large, and the URL it came from."""
        path, where, size = self._manifest_size(step)
        return self.storage.read_range(path, 0, size), where

    def read_manifest(self, step: int, *, lazy: bool = False) -> fmt.Manifest:
        """A step's manifest, validated in full (``lazy``: its records as they are used, see
        :func:`format.parse_manifest`).

        The bytes are read every time; a lazy parse of the same bytes is kept for the next
        lazy read of the step (the last few steps read), with the records it checked since:
        parsing and checking a manifest again would be work per tensor on every load.
        Nobody changes a parsed manifest, and a step rewritten behind the run's back has other
        bytes, so it is parsed anew."""
        data, where = self.manifest_bytes(step)
        if not lazy:
            return fmt.parse_manifest(data, path=where, step=step)
        kept = self._parsed.pop(step, None)
        if kept is not None and kept[0] == data:
            m = kept[1]
        else:
            m = fmt.parse_manifest(data, path=where, step=step, lazy=True)
        self._parsed[step] = (data, m)  # the most recently read last
        while len(self._parsed) > PARSED_KEPT:
            del self._parsed[next(iter(self._parsed))]
        return m

    def shard_map(self, step: int, shard: fmt.ShardRecord) -> ShardMap:
        """Where the bytes of one shard of ``step`` are: its own file, and the files of other
        steps its block table refers to."""
        return ShardMap(fmt.step_dirname(step), shard.file, shard.nbytes, shard.blocks, self.where)

    def manifest_head(self, step: int) -> tuple[bytes, str]:
        """A step's manifest cut after its head (everything before ``"tensors"``: the step,
        times, shards and their block tables, metrics and metadata), closed as an object,
        and its URL: what listings and retention need, without reading the tensor records
        and trees (most of a large manifest). A manifest whose head is not within its first
        HEAD_BYTES is refused; a small one is read whole when it cannot be cut."""
        path, where, size = self._manifest_size(step)
        data = b""
        for peek in (HEAD_PEEK, HEAD_BYTES):  # most heads are a few KiB: one small read
            data += self.storage.read_range(path, len(data), max(len(data), min(size, peek)))
            head = _cut_head(data)
            if head is not None:
                return head, where
        if size <= HEAD_BYTES:
            return data, where  # not cut where expected: checked whole, as it is small
        raise CorruptCheckpointError(
            f"{where}: no manifest head within its first {HEAD_BYTES} bytes", path=where
        )

    def read_head(self, step: int) -> fmt.Manifest:
        """A step's manifest as listings see it: its head alone, checked (see
        :meth:`manifest_head` and :func:`format.parse_manifest_head`)."""
        data, where = self.manifest_head(step)
        return fmt.parse_manifest_head(data, path=where, step=step)

    def read_record(self, step: int) -> CheckpointRecord:
        """The step's commit time and metrics, without checking the rest of its manifest."""
        data, where = self.manifest_head(step)
        created_at, metrics, refs = fmt.parse_manifest_record(data, path=where, step=step)
        self._refs[step] = refs
        return CheckpointRecord(step, created_at, dict(metrics))

    def records(self, steps: Iterable[int] | None = None) -> list[CheckpointRecord]:
        """The record of each of ``steps`` (every committed step when None) whose manifest
        reads; a corrupt one is left out, for the full check of a load or verify to report."""
        out = []
        for step in self.committed_steps() if steps is None else steps:
            try:
                out.append(self.read_record(step))
            except CorruptCheckpointError:
                continue
        return out

    # ----------------------------------------------------------------- deleting

    def remove(self, step: int) -> None:
        """Remove a step's directory and everything in it (missing is not an error)."""
        self.storage.delete(fmt.step_dirname(step), recursive=True)

    def discard(self, step: int, path: str | None) -> None:
        """Remove ``path`` (if any), a file a save of ``step`` wrote and failed to commit,
        unless the step's manifest names it after all; then the step's directory when
        nothing else is in it (a retired directory keeps its files). The file's name is its
        attempt's own (format.shard_filename), so nothing any manifest refers to is touched."""
        if path is not None:
            if self.is_committed(step):
                names = {s.file for s in self.read_manifest(step, lazy=True).shards}
                if path.rsplit("/", 1)[-1] in names:
                    return
            self.storage.delete(path)
        if not self.storage.list_dir(fmt.step_dirname(step)):
            self.remove(step)

    def delete_step(self, step: int, *, uncommitted: Callable[[int], None] | None = None) -> None:
        """Delete a committed step, its manifest first: a deletion cut short leaves a partial
        step directory, never a committed step with missing shards. ``uncommitted`` is called
        once the step is no longer committed, before its files go.

        Files that a committed step still reads from (incremental checkpoints) stay, in a
        *retired* directory; the retired files this step was the last to read from go."""
        read = self._step_refs(step)
        self.storage.delete(manifest_path(step))
        self._refs.pop(step, None)
        if uncommitted is not None:
            uncommitted(step)
        refs = self.referenced()  # once, for this directory and those it read from
        self.sweep(step, refs)
        for old in sorted({path.split("/", 1)[0] for path in read or ()}):
            old_step = fmt.parse_step_dirname(old)
            if old_step is None or old_step == step:
                continue
            if not self.is_committed(old_step):
                self.sweep(old_step, refs)
            else:  # a replaced step, whose replaced files this one was the last to read
                self.sweep_replaced(old_step, refs=refs)

    def note_refs(self, step: int, refs: Iterable[str]) -> None:
        """What a writer knows of the step it just committed: the files its blocks refer to."""
        self._refs[step] = frozenset(refs)

    def _step_refs(self, step: int) -> frozenset[str] | None:
        """The files of other steps a committed step reads from; None when its manifest
        cannot be read."""
        if step not in self._refs:
            try:
                self.read_record(step)  # keeps its references
            except CheckpointError:
                return None
        return self._refs[step]

    def referenced(self, committed: Iterable[int] | None = None) -> frozenset[str] | None:
        """Every file (a path relative to the root) that a committed step (of ``committed``,
        all of them when None) reads from another step's directory; None when a committed
        manifest cannot be read, so that no file is known to be unreferenced."""
        refs: set[str] = set()
        for step in self.committed_steps() if committed is None else committed:
            known = self._step_refs(step)
            if known is None:
                if self.is_committed(step):
                    return None
                continue  # deleted meanwhile: it reads from nothing now
            refs |= known
        return frozenset(refs)

    def sweep(self, step: int, refs: frozenset[str] | None) -> bool:
        """Remove what a step directory without a manifest holds, except the files a
        committed step reads from (``refs``, see :meth:`referenced`); whether the directory
        is gone. With ``refs`` None (a committed manifest cannot be read) every file stays:
        it may be unreadable only for now."""
        if refs is None:
            return False
        dirname = fmt.step_dirname(step)
        kept = set(held_files(refs, step))
        if not kept:
            self.remove(step)
            return True
        for name in self.storage.list_dir(dirname):
            if f"{dirname}/{name}" not in kept:
                self.storage.delete(f"{dirname}/{name}", recursive=True)
        return False

    def sweep_replaced(
        self, step: int, names: Collection[str] | None = None, refs: frozenset[str] | None = None
    ) -> None:
        """Remove the shard files of committed ``step``'s directory its manifest does not
        name (``names``, read when None) and no committed step reads (``refs``, see
        :meth:`referenced`): a replaced or failed attempt's. Unreadable, nothing goes."""
        refs = self.referenced() if refs is None else refs
        try:
            names = [s.file for s in self.read_head(step).shards] if names is None else names
        except CheckpointError:
            return
        if refs is None:
            return
        dirname = fmt.step_dirname(step)
        kept = {*names, *(p.split("/", 1)[1] for p in refs if p.startswith(dirname + "/"))}
        for name in self.storage.list_dir(dirname):
            if fmt.parse_shard_filename(name) is not None and name not in kept:
                self.storage.delete(f"{dirname}/{name}")

    def collect_partials(
        self, busy: Callable[[], Collection[int]] = frozenset, *, everything: bool = False
    ) -> list[int]:
        """Remove the partial step directories that no save can still be writing (see
        :func:`~aiockpt._core.pruning.plan_prune`), but for the files a committed step
        reads from (see :meth:`sweep`); the steps whose directories are gone, ascending.

        ``busy`` gives the steps being saved. It is asked after the listing, so a save that
        starts in between is seen as busy rather than its directory as dead."""
        plan = plan_prune(None, (), self.step_dirs(), busy=busy(), everything=everything)
        removed = []
        if plan.partials:
            refs = self.referenced(plan.kept)
            if refs is None:
                return []  # nothing is known to be unreferenced
            removed = [step for step in plan.partials if self.sweep(step, refs)]
        return removed

    # ----------------------------------------------------------------- verifying

    def verify_shard(
        self,
        step: int,
        shard: fmt.ShardRecord,
        records: Mapping[str, fmt.TensorRecord],
        progress: Callable[[int], None] = lambda nbytes: None,
        *,
        chunk: int = VERIFY_CHUNK,
        sink: Callable[[int, memoryview], None] | None = None,
    ) -> list[str]:
        """Problems with one shard of a step: missing, wrong size, unreadable (its own file
        or a file its blocks refer to), or a failed whole-file or tensor crc32c. It is read
        in pieces of ``chunk`` bytes, each handed to ``sink`` too (its offset in the shard,
        its bytes), and ``progress`` is told how many bytes each piece covered (all
        ``shard.nbytes`` in the end, whatever is found)."""
        path = f"{fmt.step_dirname(step)}/{shard.file}"
        try:
            size = self.storage.size(path)
        except CorruptCheckpointError as e:  # not a regular file, a link out of the root
            progress(shard.nbytes)
            return [f"{path}: {e}"]
        except CheckpointError as e:
            if not missing(self.storage, path, e):
                raise  # the storage failed, not the checkpoint: a StorageError to the caller
            progress(shard.nbytes)
            return [f"{path}: missing"]
        if size != shard.file_size:
            progress(shard.nbytes)
            return [f"{path}: {size} bytes, the manifest says {shard.file_size}"]
        smap = self.shard_map(step, shard)
        crcs = ShardCrcs(records)
        buf = bytearray(min(chunk, max(shard.nbytes, 1)))
        for lo in range(0, shard.nbytes, chunk):
            hi = min(lo + chunk, shard.nbytes)
            view = memoryview(buf)[: hi - lo]
            try:
                smap.readinto(self.storage, lo, view)
            except CorruptCheckpointError as e:  # short, missing, or not a regular file
                progress(shard.nbytes - lo)
                return [f"{path}: unreadable: {e}"]
            crcs.update(lo, view)
            if sink is not None:
                sink(lo, view)
            progress(hi - lo)
        problems = crcs.mismatches(shard.crc32c)
        if problems and shard.referenced_nbytes:
            problems.append(f"its bytes are in {smap.describe(0, shard.nbytes)}")
        return [f"{path}: {problem}" for problem in problems]


class ShardCrcs:
    """The crc32c of a whole shard and of each of its tensors, computed as the shard streams
    by in consecutive pieces: each piece updates every tensor it overlaps."""

    def __init__(self, records: Mapping[str, fmt.TensorRecord]) -> None:
        self.order = sorted(records.items(), key=lambda item: (item[1].start, item[1].end))
        self.crcs = dict.fromkeys(records, 0)
        self.whole = 0
        self._active: list[tuple[str, fmt.TensorRecord]] = []  # started, not yet ended
        self._next = 0  # the first tensor of ``order`` not yet started

    def update(self, lo: int, piece: memoryview) -> None:
        """Take in the bytes ``[lo, lo + len(piece))`` of the shard, the next after the last."""
        hi = lo + len(piece)
        self.whole = crc32c.crc32c(piece, self.whole)
        while self._next < len(self.order) and self.order[self._next][1].start < hi:
            self._active.append(self.order[self._next])
            self._next += 1
        still = []
        for name, r in self._active:
            a, b = max(r.start, lo), min(r.end, hi)
            if a < b:
                self.crcs[name] = crc32c.crc32c(piece[a - lo : b - lo], self.crcs[name])
            if r.end > hi:
                still.append((name, r))
        self._active = still

    def mismatches(self, shard_crc: int) -> list[str]:
        """What failed its check, once the whole shard went by: the file first, then each
        tensor in file order."""
        problems = []
        if self.whole != shard_crc:
            problems.append("whole-file crc32c mismatch")
        for name, r in self.order:
            if self.crcs[name] != r.crc32c:
                problems.append(f"tensor {name!r} crc32c mismatch")
        return problems
