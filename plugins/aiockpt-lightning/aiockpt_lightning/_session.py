"""One open aiockpt manager of the plugin, and the thread that finishes its saves.

A save returns once aiockpt has taken its snapshot. The committer thread then waits for the
commit and only then writes the pointer file at the path Lightning named, so a pointer file
always names a committed checkpoint: a run that dies mid-save leaves the previous pointer (the
previous ``last.ckpt``, say) in place. The thread also deletes the aiockpt checkpoints that no
pointer names any more (removed by ``save_top_k``, or whose pointer was overwritten), each
once its save has committed.
"""

from __future__ import annotations

import os
import queue
import shutil
import threading
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


@dataclass(eq=False)
class _Save:
    """A save whose pointer is written once it commits, unless its path is removed first."""

    path: str
    pointer: Pointer
    handle: SyncSaveHandle
    cancelled: bool = False


@dataclass(frozen=True)
class _Forget:
    """Delete ``step`` unless a pointer in ``directory`` still names it."""

    directory: str
    step: int


class Session:
    """An open CheckpointManager, its committer thread, and the saves not yet finished."""

    def __init__(self, root: str, manager_kwargs: dict[str, Any]) -> None:
        self.root = root
        self._storage_options = manager_kwargs.get("storage_options")
        self.manager = CheckpointManager(root, **manager_kwargs)
        self.manager.open()
        try:
            self._taken = set(self.manager.steps())
        except BaseException:
            self.manager.close()
            raise
        self._storage: Storage | None = None
        self._lock = threading.Lock()
        #: Saves whose pointer is not written yet, by path.
        self._pending: dict[str, list[_Save]] = {}
        self._jobs: queue.Queue[_Save | _Forget | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, name="aiockpt-lightning-committer", daemon=True
        )
        self._thread.start()

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

    def save(self, path: str, state: Any, pointer: Pointer, metadata: dict[str, Any]) -> None:
        """Start the save of ``state``; returns once aiockpt has taken its snapshot."""
        self.raise_error()
        handle = self.manager.save(pointer.step, state, metadata=metadata)
        self._taken.add(pointer.step)
        job = _Save(path, pointer, handle)
        with self._lock:
            self._pending.setdefault(path, []).append(job)
        self._jobs.put(job)

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
        self._jobs.put(None)
        self._thread.join()
        try:
            self.manager.close()
        finally:
            if self._storage is not None:
                self._storage.close()
        self.raise_error()

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
        if self._storage is None:
            self._storage = open_storage(self.root, self._storage_options)
        directory = f"step_{step:012d}"
        self._storage.delete(f"{directory}/manifest.json")
        self._storage.delete(directory, recursive=True)
