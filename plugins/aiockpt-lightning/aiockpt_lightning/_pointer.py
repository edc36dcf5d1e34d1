"""Pointer files: what lies at the path Lightning names, once its checkpoint is committed.

A pointer is a small JSON file naming the aiockpt root and step that hold the checkpoint.
Lightning keeps treating checkpoints as files (it lists them, compares their modification
times for ``ckpt_path="last"``, links ``last.ckpt`` to one), and aiockpt holds the data.

A pointer records the root's id (see docs/format.md, "The root's identity") beside the path
or URL it was saved through, and is matched to a root by that id, never by the spelling. The
id was added to format 1 as a key of its own, so that a plugin older than it still reads the
pointers written now (it ignores the key); the pointers it wrote lack the key, and are still
read (see Session.whose for how they are matched).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from aiockpt._core.identity import is_id

__all__ = [
    "FORMAT",
    "Pointer",
    "UnreadablePointerError",
    "local_path",
    "read",
    "scan",
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


class UnreadablePointerError(ValueError):
    """A file marked as a pointer (it holds the key ``aiockpt-lightning``) that this version
    cannot read: of another format version, or damaged. It may name any checkpoint."""


@dataclass(frozen=True, slots=True)
class Pointer:
    """Where a Lightning checkpoint lives in aiockpt, and what it is."""

    #: The root's path or URL, as the run that wrote the pointer spelled it.
    root: str
    step: int
    global_step: int
    epoch: int
    #: The root's id (32 hex digits); None in a pointer written before pointers had one.
    root_id: str | None = None

    def to_json(self) -> bytes:
        """The file's bytes."""
        body: dict[str, Any] = {
            FORMAT: VERSION,
            "root": self.root,
            "root_id": self.root_id,
            "step": self.step,
            "global_step": self.global_step,
            "epoch": self.epoch,
        }
        if self.root_id is None:
            del body["root_id"]
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
    FileNotFoundError when there is no file, and UnreadablePointerError for a file marked as
    a pointer that this version cannot read."""
    if os.path.getsize(path) > MAX_BYTES:
        return None
    with open(path, "rb") as f:
        data = f.read(MAX_BYTES + 1)
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(body, dict) or FORMAT not in body:
        return None
    if body[FORMAT] != VERSION:
        raise UnreadablePointerError(
            f"{path} is a pointer file of format {body[FORMAT]!r}, which this version of "
            f"aiockpt-lightning (format {VERSION}) cannot read"
        )
    root = body.get("root")
    root_id = body.get("root_id")
    counts = [body.get(key) for key in ("step", "global_step", "epoch")]
    if (
        not isinstance(root, str)
        or not all(type(n) is int and n >= 0 for n in counts)
        or not (root_id is None or is_id(root_id))
    ):
        raise UnreadablePointerError(f"{path} is a damaged pointer file: {body!r}")
    step, global_step, epoch = (int(n) for n in counts)  # type: ignore[arg-type]
    return Pointer(root, step, global_step, epoch, root_id)


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


def scan(directory: str) -> tuple[dict[str, Pointer], list[str]]:
    """The pointer files in ``directory`` by name, and the names of the files marked as
    pointers that cannot be read (see UnreadablePointerError). Symbolic links and temporary
    files are left out: a link names a file, not a step. Raises FileNotFoundError when
    ``directory`` does not exist."""
    pointers: dict[str, Pointer] = {}
    unreadable: list[str] = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if temp_owner(name) is not None or os.path.islink(path) or not os.path.isfile(path):
            continue
        try:
            pointer = read(path)
        except FileNotFoundError:
            continue  # removed meanwhile
        except (OSError, UnreadablePointerError):
            unreadable.append(name)
            continue
        if pointer is not None:
            pointers[name] = pointer
    return pointers, unreadable
