"""Pointer files: what lies at the path Lightning names, once its checkpoint is committed.

A pointer is a small JSON file naming the aiockpt root and step that hold the checkpoint.
Lightning keeps treating checkpoints as files (it lists them, compares their modification
times for ``ckpt_path="last"``, links ``last.ckpt`` to one), and aiockpt holds the data.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FORMAT",
    "Pointer",
    "local_path",
    "read",
    "referenced_in",
    "steps_named_in",
    "temp_owner",
    "write",
]

#: The key and version that mark a pointer file.
FORMAT = "aiockpt-lightning"
VERSION = 1
#: What write() adds to a path for its temporary file, before the writing process's id.
TEMP = ".aiockpt-tmp-"
#: A pointer is a few hundred bytes; a larger file is not one (a torch.save checkpoint, say).
MAX_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class Pointer:
    """Where a Lightning checkpoint lives in aiockpt, and what it is."""

    root: str
    step: int
    global_step: int
    epoch: int

    def to_json(self) -> bytes:
        """The file's bytes."""
        body: dict[str, Any] = {
            FORMAT: VERSION,
            "root": self.root,
            "step": self.step,
            "global_step": self.global_step,
            "epoch": self.epoch,
        }
        return (json.dumps(body, indent=1) + "\n").encode()


def local_path(path: str | os.PathLike[str]) -> str:
    """``path`` as a local filesystem path; ValueError for a URL other than ``file://``."""
    text = os.fspath(path)
    if text.startswith("file://"):
        return text[len("file://") :]
    if "://" in text:
        raise ValueError(
            f"{text}: aiockpt-lightning keeps its pointer files on a local filesystem (the "
            "checkpoint data itself may go to any aiockpt root, s3:// included): give "
            "ModelCheckpoint a local dirpath"
        )
    return text


def read(path: str) -> Pointer | None:
    """The pointer in the file at ``path``; None when that file is not a pointer. Raises
    FileNotFoundError when there is no file."""
    if os.path.getsize(path) > MAX_BYTES:
        return None
    with open(path, "rb") as f:
        data = f.read(MAX_BYTES + 1)
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(body, dict) or body.get(FORMAT) != VERSION:
        return None
    root = body.get("root")
    counts = [body.get(key) for key in ("step", "global_step", "epoch")]
    if not isinstance(root, str) or not all(type(n) is int and n >= 0 for n in counts):
        return None
    step, global_step, epoch = (int(n) for n in counts)  # type: ignore[arg-type]
    return Pointer(root, step, global_step, epoch)


def write(path: str, pointer: Pointer) -> None:
    """Write ``pointer`` to ``path`` atomically and durably, replacing what was there (a
    symbolic link is replaced, not followed)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}{TEMP}{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(pointer.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_owner(name: str) -> int | None:
    """The id of the process whose temporary pointer file is named ``name``; None when
    ``name`` is not one."""
    base, sep, pid = name.rpartition(TEMP)
    return int(pid) if sep and base and pid.isdigit() else None


def steps_named_in(directory: str, root: str) -> set[int]:
    """The steps of ``root`` that the pointer files in ``directory`` name (symbolic links
    are not followed: they name a file, not a step)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return set()
    steps = set()
    for name in names:
        path = os.path.join(directory, name)
        if temp_owner(name) is not None or os.path.islink(path) or not os.path.isfile(path):
            continue
        try:
            pointer = read(path)
        except OSError:
            continue
        if pointer is not None and pointer.root == root:
            steps.add(pointer.step)
    return steps


def referenced_in(directory: str, root: str, step: int) -> bool:
    """Whether a pointer file in ``directory`` (not a symbolic link) names ``root``'s
    ``step``: a copy of a pointer keeps its checkpoint alive."""
    return step in steps_named_in(directory, root)
