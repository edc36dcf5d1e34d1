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

Each committed checkpoint records, in its metadata, the path of its pointer. A writing session
uses that to put right what a killed run left (see :meth:`Session.recover`); a reading one to
load, for a pointer, the newest checkpoint committed for it (see :meth:`Session.resolve`).
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
from typing import Any

from aiockpt import CheckpointManager, SyncSaveHandle
from aiockpt.storage import Storage, open_storage

from . import _pointer
from ._pointer import Pointer

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
        self.shared = shared or member
        self.member = member
        self._storage_options = manager_kwargs.get("storage_options")
        options = dict(manager_kwargs, process_group=process_group)
        if not writer:
            options.pop("takeover", None)
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
            out[step] = _Committed(
                float(manifest.get("created_at", 0.0)),
                path if isinstance(path, str) else None,
                int(meta.get("global_step", 0)),
                int(meta.get("epoch", 0)),
                tuple(str(k) for k in keys) if isinstance(keys, list) else None,
            )
        return out

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
        if pointer.root != self.root or pointer.step not in self.committed:
            return pointer
        best, when = pointer, self.committed[pointer.step].created_at
        for step, info in self.committed.items():
            if info.path == path and (info.created_at, step) > (when, best.step):
                best, when = Pointer(self.root, step, info.global_step, info.epoch), info.created_at
        return best

    def recover(self) -> None:
        """Put right what a killed run left, in the directories of this root's pointers:
        remove temporary pointer files of processes that are gone and pointers to steps that
        never committed; point each pointer file at the newest checkpoint committed for it;
        delete the checkpoints saved through the plugin that no pointer file names."""
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
        named: set[int] = set()
        for directory in {os.path.dirname(p) for p in paths}:
            named |= _pointer.steps_named_in(directory, self.root)
        for step, info in sorted(self.committed.items()):
            if info.path is not None and step not in named:
                # (It stays taken: the manager, which listed it as it opened, would refuse
                # a save of it as a step already committed.)
                self._delete(step)
                del self.committed[step]

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
                and pointer.root == self.root
                and pointer.step not in self._taken
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
            os.unlink(path)
        if old is not None and old.root == self.root:
            self._jobs.put(_Forget(os.path.dirname(path), old.step))

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
        old = None
        with self._lock:
            self._unpend(job)
            if not job.cancelled:
                if os.path.isfile(job.path) and not os.path.islink(job.path):
                    old = _pointer.read(job.path)
                _pointer.write(job.path, job.pointer)
        if job.cancelled:
            self._delete(job.pointer.step)
        elif old is not None and old.root == self.root and old.step != job.pointer.step:
            self._forget(os.path.dirname(job.path), old.step)

    def _unpend(self, job: _Save) -> None:
        assert job.path is not None
        jobs = self._pending[job.path]
        jobs.remove(job)
        if not jobs:
            del self._pending[job.path]

    def _forget(self, directory: str, step: int) -> None:
        if not _pointer.referenced_in(directory, self.root, step):
            self._delete(step)

    def _delete(self, step: int) -> None:
        """Delete a committed step as aiockpt's format prescribes: its manifest first, so a
        deletion cut short leaves a partial directory, never a damaged checkpoint."""
        storage = self._open_storage()
        directory = f"step_{step:012d}"
        storage.delete(f"{directory}/manifest.json")
        storage.delete(directory, recursive=True)


def _read_pointer(path: str) -> Pointer | None:
    """The pointer in the regular file at ``path``; None for anything else."""
    if os.path.islink(path) or not os.path.isfile(path):
        return None
    try:
        return _pointer.read(path)
    except OSError:
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
