"""AiockptCheckpointIO: Lightning's CheckpointIO plugin, saving through aiockpt."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import CheckpointIO

from aiockpt import CheckpointManager
from aiockpt.errors import CheckpointNotFoundError, RootLockedError

from . import _pointer
from ._codec import decode, encode
from ._pointer import Pointer
from ._session import SAVES_PER_GLOBAL_STEP, Session

__all__ = ["SAVES_PER_GLOBAL_STEP", "AiockptCheckpointIO"]

log = logging.getLogger("aiockpt_lightning")


def _absolute_root(root: str | os.PathLike[str]) -> str:
    """``root`` with a local path made absolute, so pointers name it the same from any cwd."""
    text = os.fspath(root)
    return text if "://" in text else os.path.abspath(text)


class AiockptCheckpointIO(CheckpointIO):
    """Saves Lightning checkpoints through aiockpt: ``plugins=[AiockptCheckpointIO(root)]``.

    ``root`` is the aiockpt root (a local path or any URL aiockpt serves) and
    ``manager_kwargs`` go to :class:`aiockpt.CheckpointManager` (``storage_options``,
    ``max_pending``, ``event_handlers``, ...). The manager opens at the first save or load
    and closes at :meth:`teardown`, which the Trainer calls at the end of each ``fit``,
    ``validate``, ``test`` or ``predict``.

    ``save_checkpoint`` returns once aiockpt has copied the checkpoint's tensors; the write
    goes on in aiockpt's daemon. A small pointer file at the path Lightning named
    (``epoch=0-step=10.ckpt``) names the aiockpt step that holds the checkpoint:
    ``global_step * SAVES_PER_GLOBAL_STEP + n``, ``n`` counting the saves at that global step.
    A new name's pointer is written as the save starts (the name is taken), one over an
    existing pointer once the save commits; it records the root's id, by which it is matched
    to a root however the root is spelled. Global rank 0 saves and removes, on a process
    group of its own; the other ranks only load, through read-only managers, as does a load
    while another writer (another instance, another process) holds the root. Opening the root
    for writing puts right what a killed run left (docs/lightning.md, "After a killed run").
    Thread-safe: one manager at a time, whichever thread opens it.

    ``load_checkpoint`` reads such a pointer; ``remove_checkpoint`` deletes the
    pointer and the aiockpt checkpoint it names. Nothing is pickled: values aiockpt cannot
    store as they are are converted losslessly (and back on load) or refused with an
    :class:`aiockpt.UnsupportedValueError` naming every key path at fault.
    """

    def __init__(self, root: str | os.PathLike[str], **manager_kwargs: Any) -> None:
        super().__init__()
        self.root = _absolute_root(root)
        if "retention" in manager_kwargs and manager_kwargs["retention"] is not None:
            raise ValueError(
                "AiockptCheckpointIO takes no retention policy: ModelCheckpoint decides which "
                "checkpoints are kept (save_top_k) and removes the others through the plugin"
            )
        if manager_kwargs.get("process_group") is not None or manager_kwargs.get("read_only"):
            raise ValueError(
                "AiockptCheckpointIO chooses the process group and read_only itself: global "
                "rank 0 saves alone, and the other ranks read"
            )
        self._manager_kwargs = dict(manager_kwargs)
        CheckpointManager(self.root, **self._manager_kwargs)  # bad arguments fail now
        self._session: Session | None = None
        #: One session at a time, whatever thread asks (AsyncCheckpointIO saves from its own).
        self._lock = threading.RLock()

    def __getstate__(self) -> dict[str, Any]:
        # ddp_spawn pickles the plugin for its processes: each opens a session of its own.
        state = self.__dict__.copy()
        state["_session"] = None
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

    def _open(self, *, load: bool = False) -> Session:
        """The open session; opened now if there is none: a writer on global rank 0 (with a
        process group of its own rank alone, so that no collective waits for ranks that do
        not save), a reader on the other ranks. For a ``load`` alone, rank 0 takes the lease
        if it is free (never by ``takeover``), and reads beside the writer that holds it
        otherwise: a load needs no lease."""
        with self._lock:
            if self._session is None:
                rank, group = _own_group()
                writer = rank == 0
                if writer and load:
                    options = dict(self._manager_kwargs, takeover=False)
                    try:
                        self._session = Session(self.root, options, process_group=group)
                    except RootLockedError as e:
                        log.info("loading from %s through a read-only manager: %s", self.root, e)
                        writer = False
                if self._session is None:
                    self._session = Session(
                        self.root, self._manager_kwargs, writer=writer, process_group=group
                    )
            return self._session

    def _open_shared(self) -> Session:
        """The open shared session (see Session); opened now, by every rank of the default
        process group at once, if there is none. Called on every rank together."""
        with self._lock:
            if self._session is not None and not self._session.shared:
                raise RuntimeError(
                    "AiockptCheckpointIO already saves on global rank 0 alone in this run: a "
                    "sharded save (AiockptFSDPStrategy) needs every rank's manager from the start"
                )
            if self._session is None:
                rank = _rank()
                # Without deduplication, so that no checkpoint reads from another's files:
                # global rank 0 alone deletes them, and cannot ask aiockpt to (on every rank).
                options = dict(self._manager_kwargs, dedup=False)
                self._session = Session(self.root, options, shared=True, member=rank != 0)
            return self._session

    @contextmanager
    def _using(self, *, load: bool = False) -> Iterator[Session]:
        """The session, for a ``load`` or a removal: one opened for it is closed after it, so
        that a load (each rank's, at a resume) or a removal made outside a run holds no
        root."""
        with self._lock:
            opened = self._session is None
            session = self._open(load=load)
            try:
                yield session
            finally:
                if opened:
                    self._session = None
                    session.close()

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        """Start saving ``checkpoint``; returns once aiockpt has taken its snapshot. Raises
        :class:`aiockpt.UnsupportedValueError` (nothing saved) for values that cannot be
        stored, and the error of an earlier save that failed in the background."""
        if storage_options is not None:
            raise TypeError(
                "AiockptCheckpointIO.save_checkpoint takes no storage_options: give aiockpt's "
                "to AiockptCheckpointIO(root, storage_options=...)"
            )
        target = os.path.abspath(_pointer.local_path(path))
        state = encode(checkpoint)
        # The pointer comes once the save commits; its directory is there at once, as with
        # Lightning's own IO (ModelCheckpoint may link last.ckpt into it right away).
        os.makedirs(os.path.dirname(target), exist_ok=True)
        global_step = _count(checkpoint, "global_step")
        epoch = _count(checkpoint, "epoch")
        with self._lock:
            session = self._open()
            _check_writer(session, "save_checkpoint")
            session.prepare(os.path.dirname(target))
            step = session.next_step(global_step)
            pointer = Pointer(self.root, step, global_step, epoch, session.root_id)
            metadata = {
                "lightning": {
                    "file": os.path.basename(target),
                    "path": target,
                    "global_step": global_step,
                    "epoch": epoch,
                    "root_id": session.root_id,
                }
            }
            session.save(target, state, pointer, metadata)

    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint whose pointer file is at ``path``, as Lightning saved it. Saves
        still pending are waited for first. ``weights_only`` is accepted and needs nothing:
        nothing is unpickled. ``map_location`` may be None (tensors on the CPU) or a device."""
        device = _device(map_location)
        target = os.path.abspath(_pointer.local_path(path))
        self.wait()  # a pointer is written once its save commits
        with self._using(load=True) as session:
            # (Opening a writer put right what a killed run left: the pointer is read after.)
            pointer = self._pointer_at(session, target)
            if not session.writer:
                # A reader sees what the writer puts right as it opens, whether or not the
                # writer has yet: every rank loads the same checkpoint.
                pointer = session.resolve(target, pointer)
            try:
                state = session.manager.load(pointer.step)
            except CheckpointNotFoundError as e:
                raise CheckpointNotFoundError(
                    f"{target} names step {pointer.step} of {self.root} (global step "
                    f"{pointer.global_step}), which holds no committed checkpoint (its save "
                    f"never finished?): {e}"
                ) from e
        checkpoint = decode(state)
        return checkpoint if device is None else _to_device(checkpoint, device)

    def _save_sharded(
        self, checkpoint: dict[str, Any], path: _PATH, sharded: tuple[str, ...]
    ) -> None:
        """Save ``checkpoint`` as one aiockpt checkpoint of every rank, each rank its own
        checkpoint dict: the values at the top-level keys ``sharded`` hold DTensors, whose
        chunks each rank saves once; the rest is each rank's own (Lightning gives every rank
        the same), so that a load on another number of processes finds it the same on every
        rank. Called on every rank together (by AiockptFSDPStrategy); global rank 0 writes the
        pointer at ``path`` once every part has committed. A refusal on any rank raises on
        every rank, and nothing is saved."""
        import torch.distributed as dist

        session = self._open_shared()
        rank = _rank()
        step = None
        problem: str | None = None
        try:
            state = encode(checkpoint, dtensors=True)
            if rank == 0:
                target = os.path.abspath(_pointer.local_path(path))
                global_step = _count(checkpoint, "global_step")
                epoch = _count(checkpoint, "epoch")
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with self._lock:
                    session.prepare(os.path.dirname(target))
                    step = session.next_step(global_step)
        except Exception as e:
            error: Exception | None = e
            problem = f"{type(e).__name__}: {e}"
        else:
            error = None
        # Every rank learns of any rank's refusal (and rank 0's step) before anything is saved.
        said: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(said, (step, problem))
        if error is not None:
            raise error
        failed = {r: p for r, (_, p) in enumerate(said) if p is not None}
        if failed:
            raise RuntimeError(
                "the sharded save was refused on "
                + "; ".join(f"rank {r}: {p}" for r, p in sorted(failed.items()))
            )
        step = said[0][0]
        if rank != 0:
            session.save_part(step, state)
            return
        metadata = {
            "lightning": {
                "file": os.path.basename(target),
                "path": target,
                "global_step": global_step,
                "epoch": epoch,
                # The checkpoint's top-level keys; a checkpoint saved by every rank has them.
                "keys": list(checkpoint),
                "root_id": session.root_id,
            }
        }
        pointer = Pointer(self.root, step, global_step, epoch, session.root_id)
        with self._lock:
            session.save(target, state, pointer, metadata)

    def _load_sharded(
        self,
        path: _PATH,
        targets: dict[str, Any],
        strict: bool = True,
        skip: tuple[str, ...] = (),
    ) -> dict[str, Any]:
        """Load the checkpoint saved by :meth:`_save_sharded` whose pointer is at ``path``:
        the values at the top-level keys of ``targets`` restored in place into them (DTensors
        resharded to this run's layout, each rank reading only what it needs), the rest read
        as saved, except the keys in ``skip`` that ``targets`` does not hold. Called on every
        rank together; global rank 0 reads the pointer."""
        import torch.distributed as dist

        self.wait()  # a pointer is written once its save commits
        session = self._open_shared()
        found: tuple[int, tuple[str, ...]] | None = None
        problem: tuple[str, str] | None = None
        if _rank() == 0:
            try:
                found = self._find_sharded(session, path)
            except Exception as e:
                problem = (type(e).__name__, str(e))
        said = [(found, problem)]
        dist.broadcast_object_list(said, src=0)
        found, problem = said[0]
        if problem is not None:
            kinds = {"FileNotFoundError": FileNotFoundError, "ValueError": ValueError}
            raise kinds.get(problem[0], RuntimeError)(problem[1])
        assert found is not None
        step, keys = found
        missing = [k for k in targets if k not in keys]
        if missing:
            raise KeyError(
                f"{path} holds no {', '.join(map(repr, missing))} (saved without them, "
                "weights_only?): it cannot restore them"
            )
        into = encode(targets, dtensors=True)
        session.manager.load(step, into=into, keys=tuple(into), strict=strict)
        rest = [k for k in keys if k not in targets and k not in skip]
        checkpoint = decode(session.manager.load(step, keys=rest)) if rest else {}
        checkpoint.update(decode(into))
        return {k: checkpoint[k] for k in keys if k in checkpoint}

    def _find_sharded(self, session: Session, path: _PATH) -> tuple[int, tuple[str, ...]]:
        """The step that the pointer at ``path`` names, and the top-level keys of its
        checkpoint, which must have been saved sharded."""
        target = os.path.abspath(_pointer.local_path(path))
        pointer = self._pointer_at(session, target)
        info = session.info(pointer.step)
        if info is None:
            raise FileNotFoundError(
                f"{target} names step {pointer.step} of {self.root} (global step "
                f"{pointer.global_step}), which holds no committed checkpoint (its save "
                "never finished?)"
            )
        if info.keys is None:
            raise ValueError(
                f"{target} names a checkpoint saved by global rank 0 alone (by another "
                "strategy than AiockptFSDPStrategy): AiockptFSDPStrategy resumes only from "
                "the sharded checkpoints it saved"
            )
        return pointer.step, info.keys

    def _pointer_at(self, session: Session, target: str) -> Pointer:
        """The pointer in the file ``target``, of the session's root (by the root's id,
        however either spells the root: see Session.whose)."""
        if not os.path.exists(target):
            raise FileNotFoundError(f"Checkpoint file not found: {target}")
        pointer = _pointer.read(target)
        if pointer is None:
            raise ValueError(
                f"{target} is not an aiockpt-lightning pointer file (a checkpoint written "
                "by torch.save? load it without the AiockptCheckpointIO plugin)"
            )
        whose = session.whose(pointer)
        if whose == "own":
            return pointer
        here = f"this plugin's root is {self.root} (root id {session.root_id or 'none yet'})"
        if whose == "unknown":
            raise ValueError(
                f"{target} names a checkpoint of the aiockpt root {pointer.root}, which cannot "
                f"be read to tell whether it is this plugin's root, and {here}: use "
                f"AiockptCheckpointIO({pointer.root!r}) where that root can be read"
            )
        if pointer.root_id is not None and pointer.root == self.root:
            raise ValueError(
                f"{target} names a checkpoint of the aiockpt root once at {pointer.root} (root "
                f"id {pointer.root_id}), and {here}: the root there is not the one the "
                "pointer was saved for (made again since, or its _root.json replaced)"
            )
        raise ValueError(
            f"{target} names a checkpoint of the aiockpt root {session.describe(pointer)}, "
            f"and {here}: use AiockptCheckpointIO({pointer.root!r})"
        )

    def remove_checkpoint(self, path: _PATH) -> None:
        """Remove the checkpoint at ``path``: the pointer file at once, the aiockpt checkpoint
        it names in the background (after its save has committed), unless another pointer
        file in the same directory (a copy) still names it. A symbolic link is unlinked and
        the file it names kept."""
        target = os.path.abspath(_pointer.local_path(path))
        with self._using() as session:
            _check_writer(session, "remove_checkpoint")
            session.remove(target)  # (a session opened for it finishes as it closes)

    def wait(self) -> None:
        """Block until every save so far is committed and its pointer file written; raise
        the error of a save that failed."""
        session = self._session
        if session is not None:
            session.wait()

    def teardown(self) -> None:
        """Wait for every pending save, then close the aiockpt manager (the next save or load
        opens a new one); raise the error of a save that failed."""
        with self._lock:
            session, self._session = self._session, None
        if session is not None:
            session.close()


def _check_writer(session: Session, what: str) -> None:
    if not session.writer:
        raise RuntimeError(
            f"AiockptCheckpointIO.{what} was called on global rank {_own_group()[0]}: the "
            "plugin saves and removes checkpoints on global rank 0 only, as Lightning's "
            "strategies that use a CheckpointIO do"
        )


#: This process's own one-rank process group, by the default group it was made in.
_GROUPS: dict[int, tuple[Any, Any]] = {}


def _own_group() -> tuple[int, Any]:
    """This process's global rank, and the process group for its manager: None without
    torch.distributed (or with one process), else a gloo group of this rank alone, made once
    (by this rank alone: ``use_local_synchronization``, no other rank takes part)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return 0, None
    rank = dist.get_rank()
    if dist.get_world_size() == 1:
        return rank, None
    world = dist.group.WORLD
    made = _GROUPS.get(id(world))
    if made is None or made[0] is not world:
        group = dist.new_group([rank], backend="gloo", use_local_synchronization=True)
        made = _GROUPS[id(world)] = (world, group)
    return rank, made[1]


def _rank() -> int:
    """This process's global rank (0 without torch.distributed)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _count(checkpoint: Mapping[str, Any], key: str) -> int:
    """``checkpoint[key]``, a non-negative int (0 when absent: a checkpoint not made by the
    Trainer)."""
    value = checkpoint.get(key, 0)
    if type(value) is not int or value < 0:
        raise ValueError(f"the checkpoint's {key!r} must be a non-negative int, not {value!r}")
    return value


def _device(map_location: Any) -> torch.device | None:
    """The device tensors are moved to; None to leave them on the CPU, where aiockpt loads."""
    if map_location is None:
        return None
    if isinstance(map_location, (str, torch.device)):
        device = torch.device(map_location)
        return None if device.type == "cpu" else device
    raise TypeError(
        "AiockptCheckpointIO.load_checkpoint takes map_location as None, a str or a "
        f"torch.device, not {type(map_location).__name__}"
    )


def _to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in it moved to ``device`` (containers rebuilt as they were)."""
    if isinstance(value, torch.Tensor):
        moved = value.to(device)
        if isinstance(value, torch.nn.Parameter):
            return torch.nn.Parameter(moved, requires_grad=value.requires_grad)
        return moved
    if isinstance(value, dict):
        out = type(value)((k, _to_device(v, device)) for k, v in value.items())
        if hasattr(value, "_metadata"):
            out._metadata = value._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    return value
