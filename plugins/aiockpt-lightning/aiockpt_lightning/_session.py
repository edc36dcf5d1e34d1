"""One open aiockpt manager of the plugin, and the thread that finishes its saves.

A save returns once aiockpt has taken its snapshot. A save to a new name writes its pointer
file at once, so that the name is taken (ModelCheckpoint versions names by asking whether the
file exists); a save over an existing pointer (``last.ckpt``) leaves it in place until the
commit. The committer thread waits for each commit, then writes the pointer, and deletes the
aiockpt checkpoints that no pointer names any more (removed by ``save_top_k``, or whose
pointer was overwritten), each once its save has committed.

A *shared* session is one manager per rank on the job's whole process group, for sharded
saves (AiockptFSDPStrategy): every rank saves its own part of each checkpoint, and global rank
0's session alone keeps the pointers; the other ranks' sessions are *members*, which only save
and load.

Each committed checkpoint records, in its metadata, the path of its pointer and the id of the
root it was saved into. A writing session uses that to put right what a killed run left (see
:meth:`Session.recover`); a reading one to load, for a pointer, the newest checkpoint
committed for it (see :meth:`Session.resolve`).

Pointers are matched to the session's root by the root's id, never by how its path or URL is
spelled (see :meth:`Session.whose`), and a checkpoint is deleted only where the session can
prove it is an orphan of its own root (see :meth:`Session.orphan`): where a doubt remains, it
is kept and a warning says which pointer and which root.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import queue
import shutil
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Literal

from aiockpt import CheckpointManager, SyncSaveHandle
from aiockpt._core.identity import read_root_id
from aiockpt.errors import CheckpointNotFoundError
from aiockpt.storage import Storage, open_storage

from . import _pointer
from ._pointer import Pointer, UnreadablePointerError

__all__ = ["SAVES_PER_GLOBAL_STEP", "Session"]

#: The aiockpt step of a save is ``global_step * SAVES_PER_GLOBAL_STEP + n``, ``n`` the first
#: number not taken in the root: several saves at one global step (``last.ckpt`` and a top-k
#: file, two ModelCheckpoint callbacks, a run resumed from an earlier checkpoint) each get one.
SAVES_PER_GLOBAL_STEP = 1000
#: aiockpt's step directories have 12 digits.
MAX_GLOBAL_STEP = 10**12 // SAVES_PER_GLOBAL_STEP - 1

log = logging.getLogger("aiockpt_lightning")

#: Sessions still open, closed at interpreter exit (see _close_at_exit).
_OPEN: weakref.WeakSet[Session] = weakref.WeakSet()

#: How a pointer relates to a session's root (see Session.whose).
Whose = Literal["own", "other", "unknown"]


@dataclass(frozen=True)
class _Committed:
    """What a committed step's manifest says of it."""

    created_at: float
    #: The pointer file it was saved for (absolute); None for a checkpoint saved otherwise.
    path: str | None
    global_step: int
    epoch: int
    #: The checkpoint's top-level keys, for one saved sharded (by every rank); else None.
    keys: tuple[str, ...] | None = None
    #: The id of the root it was saved into; None for one saved before the plugin recorded it.
    root_id: str | None = None


@dataclass(eq=False)
class _Save:
    """A save whose pointer is written once it commits, unless its path is removed first."""

    #: None for a member's part of a save: no pointer to write.
    path: str | None
    pointer: Pointer | None
    handle: SyncSaveHandle
    cancelled: bool = False


@dataclass(frozen=True)
class _Forget:
    """Delete ``step`` unless a pointer in ``directory`` still names it."""

    directory: str
    step: int


class Session:
    """An open CheckpointManager, its committer thread, and the saves not yet finished."""

    def __init__(
        self,
        root: str,
        manager_kwargs: dict[str, Any],
        *,
        writer: bool = True,
        process_group: Any = None,
        shared: bool = False,
        member: bool = False,
    ) -> None:
        """``writer``: save and keep the pointers (else read only). ``shared``: a manager
        on ``process_group`` (None: the default group) that every rank of it opens at once,
        for sharded saves. ``member``: a shared session of a rank other than global rank 0,
        which saves its parts and loads, and keeps no pointers."""
        self.root = root
        self.writer = writer
        self._root_id: str | None = None
        #: What the roots that older pointers name are, by their path or URL (see whose).
        self._identities: dict[str, tuple[bool, str | None]] = {}
        self._identities_lock = threading.Lock()
        self.shared = shared or member
        self.member = member
        self._storage_options = manager_kwargs.get("storage_options")
        options = dict(manager_kwargs, process_group=process_group)
        if not writer:
            # A reader takes no lease and writes no tier.
            for key in ("takeover", "local", "persist_every"):
                options.pop(key, None)
            options["read_only"] = True
        self.manager = CheckpointManager(root, **options)
        self.manager.open()
        self._storage: Storage | None = None
        #: Directories saved into by this session (see _tidy).
        self._tidied: set[str] = set()
        self._lock = threading.Lock()
        try:
            self._taken = set(self.manager.steps())
            self.committed = {} if member else self._catalog(self._taken)
            if writer and not member:
                self.recover()
        except BaseException:
            self.manager.close()
            self._close_storage()
            raise
        #: Saves whose pointer is not written yet, by path.
        self._pending: dict[str, list[_Save]] = {}
        self._jobs: queue.Queue[_Save | _Forget | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, name="aiockpt-lightning-committer", daemon=True
        )
        self._thread.start()
        _OPEN.add(self)

    # ----------------------------------------------------------------- what a run left

    def _catalog(self, steps: set[int]) -> dict[int, _Committed]:
        """What the manifests of the committed ``steps`` say."""
        storage = self._open_storage()
        out = {}
        for step in sorted(steps):
            name = f"step_{step:012d}/manifest.json"
            manifest = json.loads(storage.read_range(name, 0, storage.size(name)))
            meta = (manifest.get("metadata") or {}).get("lightning") or {}
            path = meta.get("path")
            keys = meta.get("keys")
            root_id = meta.get("root_id")
            out[step] = _Committed(
                float(manifest.get("created_at", 0.0)),
                path if isinstance(path, str) else None,
                int(meta.get("global_step", 0)),
                int(meta.get("epoch", 0)),
                tuple(str(k) for k in keys) if isinstance(keys, list) else None,
                str(root_id) if root_id is not None else None,
            )
        return out

    # ----------------------------------------------------------------- identity

    @property
    def root_id(self) -> str | None:
        """The root's id: a writer's always (made at its open if the root had none); a
        reader's None while no writer has opened the root since roots had ids (read again
        until one has)."""
        if self._root_id is None:
            self._root_id = self.manager.root_id or read_root_id(self._open_storage())
        return self._root_id

    def whose(self, pointer: Pointer) -> Whose:
        """Whether ``pointer`` names a checkpoint of this root (``"own"``), of another
        (``"other"``), or cannot be told (``"unknown"``): by the root id it records, never by
        how it spells the root's path or URL.

        A pointer written before pointers recorded the root's id is matched by the id of
        the root that its path or URL opens now: this root's id is this root; another id,
        or none where this root has one, is another root (any spelling of this root opens
        this root, and reads its id). Only where neither has an id (a reader of a root no
        writer opened since roots had ids, which deletes nothing) is it matched as before:
        the same local directory, or the same spelling. A root that cannot be opened or
        read (another protocol, no access) leaves it unknown."""
        ours = self.root_id
        if pointer.root_id is not None:
            return "own" if pointer.root_id == ours else "other"
        known, theirs = self._identity_of(pointer.root)
        if known and theirs is not None:
            return "own" if theirs == ours else "other"
        if known and ours is not None:
            return "other"
        if ours is None:
            same = _same_directory(pointer.root, self.root)
            if same is not None:
                return "own" if same else "other"
            if pointer.root == self.root:
                return "own"
        return "unknown"

    def _identity_of(self, root: str) -> tuple[bool, str | None]:
        """Whether the root at ``root`` (a path or URL) could be read, and its id (None: it
        has none, or does not exist). Read once per session; only on this root's protocol,
        with its storage options."""
        with self._identities_lock:
            found = self._identities.get(root)
        if found is not None:
            return found
        found = (False, None)
        protocol = _protocol(root)
        if protocol == _protocol(self.root):
            options = None if protocol == "file" else self._storage_options
            try:
                storage = open_storage(root, options)
                try:
                    found = (True, read_root_id(storage))
                finally:
                    storage.close()
            except Exception as e:
                log.debug("the root %s cannot be identified: %s", root, e)
        with self._identities_lock:
            self._identities[root] = found
        return found

    def describe(self, pointer: Pointer) -> str:
        """The root ``pointer`` names, for a message."""
        return f"{pointer.root} (root id {pointer.root_id or 'not recorded'})"

    def orphan(
        self,
        step: int,
        info: _Committed,
        also: tuple[str, ...] = (),
        scans: dict[str, tuple[dict[str, Pointer], list[str]] | None] | None = None,
    ) -> tuple[bool, str | None]:
        """``(True, None)`` where committed ``step`` is provably an orphan of this root, to
        be deleted: saved through the plugin into this root (by the root id it records,
        where it records one), and no pointer file of the directory of the pointer it was
        saved for (nor of the directories ``also``) names it. Else ``(False, None)`` where a
        pointer of this root names it, or ``(False, doubt)``, the doubt naming the pointer
        and root at fault: a pointer of a root that cannot be identified that names this
        step, the file the step was saved for holding another root's pointer, a pointer file
        that cannot be read, the directory gone. ``scans`` caches the directories' pointers
        (None: the directory is missing)."""
        if info.path is None:
            return False, "it was not saved through aiockpt-lightning"
        ours = self.root_id
        if info.root_id is not None and info.root_id != ours:
            return False, (
                f"it records the root id {info.root_id}, and this root's id is {ours} (copied "
                "from another root, or this root's _root.json was replaced?)"
            )
        scans = {} if scans is None else scans
        doubt = None
        for directory in dict.fromkeys((os.path.dirname(info.path), *also)):
            if directory not in scans:
                try:
                    scans[directory] = _pointer.scan(directory)
                except FileNotFoundError:
                    scans[directory] = None
            scan = scans[directory]
            if scan is None:
                doubt = doubt or f"the directory {directory} of its pointer is gone (moved?)"
                continue
            pointers, unreadable = scan
            for name in unreadable:
                path = os.path.join(directory, name)
                doubt = doubt or f"{path} is a pointer file this version cannot read"
            for name, pointer in pointers.items():
                path = os.path.join(directory, name)
                whose = self.whose(pointer)
                if whose == "own" and pointer.step == step:
                    return False, None
                if whose == "unknown" and pointer.step == step:
                    doubt = doubt or (
                        f"{path} names step {step} of {self.describe(pointer)}, a root that "
                        "cannot be identified"
                    )
                elif path == info.path and whose != "own":
                    doubt = doubt or (
                        f"{path}, the pointer file it was saved for, now names step "
                        f"{pointer.step} of {self.describe(pointer)}, not of this root"
                    )
        return doubt is None, doubt

    def info(self, step: int) -> _Committed | None:
        """What the manifest of ``step`` says, if it is committed (one committed since this
        session opened is read now)."""
        if step not in self.committed:
            if not self._open_storage().exists(f"step_{step:012d}/manifest.json"):
                return None
            self.committed.update(self._catalog({step}))
        return self.committed[step]

    def resolve(self, path: str, pointer: Pointer) -> Pointer:
        """The pointer ``path`` should hold: ``pointer``, or one to the newest checkpoint
        committed for ``path`` after the one ``pointer`` names (a run killed between that
        commit and the rewrite of the pointer file). A pointer to a step that never
        committed stays as it is: its name was taken by a save that did not finish."""
        if pointer.step not in self.committed or self.whose(pointer) != "own":
            return pointer
        best, when = pointer, self.committed[pointer.step].created_at
        for step, info in self.committed.items():
            if info.path == path and (info.created_at, step) > (when, best.step):
                best = Pointer(self.root, step, info.global_step, info.epoch, self.root_id)
                when = info.created_at
        return best

    def recover(self) -> None:
        """Put right what a killed run left, in the directories of this root's pointers:
        remove temporary pointer files of processes that are gone and this root's pointers
        to steps that never committed; point each pointer file of this root at the newest
        checkpoint committed for it; delete the checkpoints saved through the plugin that
        are provably orphans of this root (see orphan), and say which others no pointer of
        this root names, and why they are kept."""
        paths = {info.path for info in self.committed.values() if info.path is not None}
        for directory in sorted({os.path.dirname(p) for p in paths}):
            self._tidy(directory)
        for path in sorted(paths):
            current = _read_pointer(path)
            if current is None:
                continue
            newest = self.resolve(path, current)
            if newest != current:
                _pointer.write(path, newest)
        scans: dict[str, tuple[dict[str, Pointer], list[str]] | None] = {}
        kept = []
        for step, info in sorted(self.committed.items()):
            if info.path is None:
                continue  # not saved through the plugin: not the plugin's to delete
            orphan, doubt = self.orphan(step, info, scans=scans)
            if orphan:
                # (It stays taken: the manager, which listed it as it opened, would refuse
                # a save of it as a step already committed.)
                self._delete(step)
                del self.committed[step]
            elif doubt is not None:
                kept.append(f"step {step} (saved for {info.path}): {doubt}")
        if kept:
            log.warning(
                "aiockpt-lightning kept %d checkpoint(s) of the root %s (root id %s) that no "
                "pointer file of this root names, since it cannot prove them orphans of this "
                "root; delete one with aiockpt.CheckpointManager(root).delete(step) once "
                "sure nothing needs it:\n  %s",
                len(kept),
                self.root,
                self.root_id,
                "\n  ".join(kept),
            )

    def _tidy(self, directory: str) -> None:
        """Remove from ``directory`` the temporary pointer files of processes that are gone,
        and the pointers to steps of this root that are neither committed nor being saved."""
        self._tidied.add(directory)
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            return
        for name in names:
            path = os.path.join(directory, name)
            pid = _pointer.temp_owner(name)
            if pid is not None:
                if pid != os.getpid() and not _alive(pid):
                    _unlink(path)
                continue
            pointer = _read_pointer(path)
            if (
                pointer is not None
                and pointer.step not in self._taken
                and self.whose(pointer) == "own"
            ):
                _unlink(path)

    # ----------------------------------------------------------------- trainer side

    def next_step(self, global_step: int) -> int:
        """The aiockpt step for a save at ``global_step`` (see SAVES_PER_GLOBAL_STEP)."""
        if not 0 <= global_step <= MAX_GLOBAL_STEP:
            raise ValueError(
                f"global_step {global_step} is outside 0..{MAX_GLOBAL_STEP}, the steps "
                "aiockpt-lightning can store"
            )
        base = global_step * SAVES_PER_GLOBAL_STEP
        for step in range(base, base + SAVES_PER_GLOBAL_STEP):
            if step not in self._taken:
                return step
        raise RuntimeError(
            f"{SAVES_PER_GLOBAL_STEP} checkpoints at global step {global_step} are already in "
            f"{self.root}: remove some of them"
        )

    def prepare(self, directory: str) -> None:
        """Before the first save into ``directory``: clear what a killed run left there."""
        if directory not in self._tidied:
            with self._lock:
                self._tidy(directory)

    def save(self, path: str, state: Any, pointer: Pointer, metadata: dict[str, Any]) -> None:
        """Start the save of ``state``; returns once aiockpt has taken its snapshot. A new
        name's pointer file is written at once: the name is taken."""
        self.raise_error()
        handle = self.manager.save(pointer.step, state, metadata=metadata)
        self._taken.add(pointer.step)
        job = _Save(path, pointer, handle)
        with self._lock:
            if not os.path.lexists(path) and path not in self._pending:
                _pointer.write(path, pointer)
            self._pending.setdefault(path, []).append(job)
        self._jobs.put(job)

    def save_part(self, step: int, state: Any) -> None:
        """A member's part of the save of ``step`` (global rank 0's session saves the same
        step, and writes its pointer once every rank's part has committed)."""
        self.raise_error()
        handle = self.manager.save(step, state)
        self._taken.add(step)
        self._jobs.put(_Save(None, None, handle))

    def remove(self, path: str) -> None:
        """Remove the checkpoint at ``path``: its pointer now, its aiockpt checkpoint once no
        pointer names it and it has committed. Saves to ``path`` still pending are dropped."""
        unreadable = None
        with self._lock:
            for job in self._pending.get(path, ()):
                job.cancelled = True
            if os.path.islink(path):  # a link (last.ckpt): the file it names stays
                os.unlink(path)
                return
            if os.path.isdir(path):  # not a pointer: removed as Lightning's own IO would
                shutil.rmtree(path)
                return
            try:
                old = _pointer.read(path)
            except FileNotFoundError:
                return
            except UnreadablePointerError as e:
                old, unreadable = None, e
            os.unlink(path)
        if unreadable is not None:
            log.warning(
                "removed %s; the checkpoint it names, if any, is kept: %s", path, unreadable
            )
        elif old is not None:
            self._forget_named(path, old, "removed")

    def wait(self) -> None:
        """Wait until every save has committed and its pointer is written; raise the first
        error of a save that failed since the last call."""
        self._jobs.join()
        self.raise_error()

    def raise_error(self) -> None:
        """Raise (once) the error of a save that failed in the background."""
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        """Finish every save, stop the thread and close the manager; raise the first error."""
        _OPEN.discard(self)
        self._jobs.put(None)
        self._thread.join()
        try:
            self.manager.close()
        finally:
            self._close_storage()
        self.raise_error()

    def _close_storage(self) -> None:
        storage, self._storage = self._storage, None
        if storage is not None:
            storage.close()

    def _open_storage(self) -> Storage:
        if self._storage is None:
            self._storage = open_storage(self.root, self._storage_options)
        return self._storage

    # ----------------------------------------------------------------- committer thread

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                if isinstance(job, _Save):
                    self._commit(job)
                else:
                    self._forget(job.directory, job.step)
            except Exception as e:
                with self._lock:
                    self._error = self._error or e
            finally:
                self._jobs.task_done()

    def _commit(self, job: _Save) -> None:
        """Wait for the save to commit, then write its pointer (or, if its path was removed
        meanwhile, delete the checkpoint)."""
        if job.path is None or job.pointer is None:
            job.handle.result()  # a member's part: nothing more to do here
            return
        try:
            job.handle.result()
        except BaseException:
            with self._lock:
                self._unpend(job)
            raise
        old = unreadable = None
        with self._lock:
            self._unpend(job)
            if not job.cancelled:
                if os.path.isfile(job.path) and not os.path.islink(job.path):
                    try:
                        old = _pointer.read(job.path)
                    except UnreadablePointerError as e:
                        unreadable = e
                _pointer.write(job.path, job.pointer)
        if job.cancelled:
            self._delete(job.pointer.step)
        elif unreadable is not None:
            log.warning(
                "replaced %s; the checkpoint it named, if any, is kept: %s", job.path, unreadable
            )
        elif old is not None and old.step != job.pointer.step:
            self._forget_named(job.path, old, "replaced")

    def _unpend(self, job: _Save) -> None:
        assert job.path is not None
        jobs = self._pending[job.path]
        jobs.remove(job)
        if not jobs:
            del self._pending[job.path]

    def _forget_named(self, path: str, old: Pointer, done: str) -> None:
        """The pointer ``old`` at ``path`` was removed or replaced (``done``): its checkpoint
        goes if it is this root's and an orphan now (see _forget). One of another root is
        that root's to keep or delete; one of a root that cannot be identified is kept."""
        whose = self.whose(old)
        if whose == "own":
            if done == "removed":
                self._jobs.put(_Forget(os.path.dirname(path), old.step))
            else:
                self._forget(os.path.dirname(path), old.step)
        elif whose == "unknown":
            log.warning(
                "%s %s, which named step %d of %s, a root that cannot be identified as this "
                "one (%s, root id %s) or another: that checkpoint is kept",
                done,
                path,
                old.step,
                self.describe(old),
                self.root,
                self.root_id,
            )

    def _forget(self, directory: str, step: int) -> None:
        """Delete this root's committed ``step`` if it is an orphan now that a pointer to it
        in ``directory`` is gone (see orphan); else keep it, saying why if in doubt."""
        info = self.info(step)
        if info is None:
            return  # deleted already (its save was cancelled), or never committed
        orphan, doubt = self.orphan(step, info, also=(directory,))
        if orphan:
            self._delete(step)
            self.committed.pop(step, None)
        elif doubt is not None:
            log.warning(
                "aiockpt-lightning kept step %d of the root %s (root id %s), which no pointer "
                "file of this root names any more, since it cannot prove it an orphan of this "
                "root: %s",
                step,
                self.root,
                self.root_id,
                doubt,
            )

    def _delete(self, step: int) -> None:
        """Delete a committed step as aiockpt deletes one: its manifest first, so that a
        deletion cut short leaves a partial directory, never a damaged checkpoint, and the
        files that later checkpoints read blocks from (deduplicated, see docs/format.md,
        "Block tables") kept until they do not. Through the manager, on the writer's thread
        in its daemon, after the saves queued before it. A shared session's manager spans
        every rank, where a delete is a collective that global rank 0 cannot make alone: it
        deletes the step's directory itself, which its saves allow, being made without
        deduplication (see AiockptCheckpointIO._open_shared)."""
        if not self.shared:
            with contextlib.suppress(CheckpointNotFoundError):  # gone already
                self.manager.delete(step, allow_latest=True)
            return
        storage = self._open_storage()
        directory = f"step_{step:012d}"
        storage.delete(f"{directory}/manifest.json")
        storage.delete(directory, recursive=True)


def _read_pointer(path: str) -> Pointer | None:
    """The pointer in the regular file at ``path``; None for anything else (a file marked
    as a pointer that cannot be read included)."""
    if os.path.islink(path) or not os.path.isfile(path):
        return None
    try:
        return _pointer.read(path)
    except (OSError, UnreadablePointerError):
        return None


def _protocol(root: str) -> str:
    """The protocol of a root's path or URL: ``file`` for a local path."""
    return root.split("://", 1)[0] if "://" in root else "file"


def _same_directory(a: str, b: str) -> bool | None:
    """Whether the local roots ``a`` and ``b`` are one directory (by device and inode,
    whatever links lead to it); None where either is not a local directory there now."""
    try:
        paths = [_pointer.local_path(r) for r in (a, b)]
        return os.path.samefile(*paths)
    except (ValueError, OSError):
        return None


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a process of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@atexit.register
def _close_at_exit() -> None:
    """At interpreter exit, close the sessions nobody tore down (wrapped in Lightning's
    AsyncCheckpointIO, whose teardown does not reach the plugin's; a ddp_spawn process's
    last save, made after the Trainer's teardown), so that their saves commit and their
    pointer files are written. Runs before aiockpt's own exit handler, registered earlier."""
    for session in list(_OPEN):
        try:
            session.close()
        except Exception:
            log.exception("closing the aiockpt-lightning session of %s at exit", session.root)
