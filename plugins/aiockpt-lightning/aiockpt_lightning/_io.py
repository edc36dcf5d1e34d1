"""AiockptCheckpointIO: Lightning's CheckpointIO plugin, saving through aiockpt."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import CheckpointIO

from aiockpt import CheckpointManager
from aiockpt.errors import CheckpointNotFoundError

from . import _pointer
from ._codec import decode, encode
from ._pointer import Pointer
from ._session import SAVES_PER_GLOBAL_STEP, Session

__all__ = ["SAVES_PER_GLOBAL_STEP", "AiockptCheckpointIO"]


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
    goes on in aiockpt's daemon. Once it has committed, a small pointer file is written at the
    path Lightning named (``epoch=0-step=10.ckpt``), naming the aiockpt step that holds the
    checkpoint: ``global_step * SAVES_PER_GLOBAL_STEP + n``, ``n`` counting the saves at that
    global step. ``load_checkpoint`` reads such a pointer; ``remove_checkpoint`` deletes the
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
        self._manager_kwargs = dict(manager_kwargs)
        CheckpointManager(self.root, **self._manager_kwargs)  # bad arguments fail now
        self._session: Session | None = None

    def _open(self) -> Session:
        if self._session is None:
            self._session = Session(self.root, self._manager_kwargs)
        return self._session

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
        session = self._open()
        pointer = Pointer(self.root, session.next_step(global_step), global_step, epoch)
        metadata = {
            "lightning": {
                "file": os.path.basename(target),
                "global_step": global_step,
                "epoch": epoch,
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
        if not os.path.exists(target):
            raise FileNotFoundError(f"Checkpoint file not found: {target}")
        pointer = _pointer.read(target)
        if pointer is None:
            raise ValueError(
                f"{target} is not an aiockpt-lightning pointer file (a checkpoint written by "
                "torch.save? load it without the AiockptCheckpointIO plugin)"
            )
        if pointer.root != self.root:
            raise ValueError(
                f"{target} names a checkpoint of the aiockpt root {pointer.root}, and this "
                f"plugin's root is {self.root}: use AiockptCheckpointIO({pointer.root!r})"
            )
        try:
            state = self._open().manager.load(pointer.step)
        except CheckpointNotFoundError as e:
            raise CheckpointNotFoundError(
                f"{target} names step {pointer.step} of {self.root} (global step "
                f"{pointer.global_step}), which holds no committed checkpoint: {e}"
            ) from e
        checkpoint = decode(state)
        return checkpoint if device is None else _to_device(checkpoint, device)

    def remove_checkpoint(self, path: _PATH) -> None:
        """Remove the checkpoint at ``path``: the pointer file at once, the aiockpt checkpoint
        it names in the background (after its save has committed), unless another pointer
        file in the same directory (a copy) still names it. A symbolic link is unlinked and
        the file it names kept."""
        target = os.path.abspath(_pointer.local_path(path))
        self._open().remove(target)

    def wait(self) -> None:
        """Block until every save so far is committed and its pointer file written; raise
        the error of a save that failed."""
        if self._session is not None:
            self._session.wait()

    def teardown(self) -> None:
        """Wait for every pending save, then close the aiockpt manager (the next save or load
        opens a new one); raise the error of a save that failed."""
        session, self._session = self._session, None
        if session is not None:
            session.close()


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
