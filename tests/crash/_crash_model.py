"""Crash states of a recorded run, in two file-system models and an object-store model.

A crash at point ``k`` of a log means its first ``k`` records happened. What survives:

- ``posix``: what POSIX promises. A file's data and size are durable once an fsync of that
  file follows them; a directory entry (create, link, rename, unlink, mkdir, rmdir) once an
  fsync of its parent directory follows it. The state is the durable state plus any subset
  of the operations before ``k`` that are not yet durable, applied in order; a write not yet
  durable may also be torn (only its first half landed, or zeros of its length).
- ``ordered``: a journaling file system (ext4 ``data=ordered``, XFS): an fsync, of a file or a
  directory, commits the journal, so every directory operation before it is durable; the
  directory operations not yet durable survive as a prefix, in order. File data as above.
- ``objects`` (:func:`object_states`): the Storage calls, each atomic (write_file,
  put_atomic, put_if_absent, receive), a recursive delete removing its objects one at a time, no
  directories; a crash leaves a prefix of the calls.

Files are modelled as inodes and directory entries as (parent directory, name) -> inode, so
an entry that survives points to an inode whose data is whatever of it survived.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

ROOT = 0
#: How a write that is not yet durable may have landed.
ABSENT, FULL, HALF, ZEROS = range(4)
DATA_KINDS = ("write", "truncate")
ENTRY_KINDS = ("create", "mkdir", "link", "rename", "unlink", "rmdir")


@dataclass(frozen=True)
class FsOp:
    """One file-system operation, its inodes as replay ids."""

    pos: int  # its record's position in the log
    kind: str
    inode: int
    parents: tuple[int, ...] = ()  # the directories whose entries it changes
    name: str = ""  # the entry it adds or removes
    src_name: str = ""  # rename: the entry it removes
    offset: int = 0
    data: bytes = b""

    @property
    def is_data(self) -> bool:
        return self.kind in DATA_KINDS


def fs_ops(records: Sequence[dict[str, Any]]) -> list[FsOp]:
    """The file-system operations of a log; a new inode (create, mkdir) gets a fresh replay id,
    so an inode number the file system reuses is never confused with its earlier file."""
    ids: dict[int, int] = {}
    fresh = itertools.count(1)

    def of(ino: int) -> int:
        if ino not in ids:
            ids[ino] = next(fresh)
        return ids[ino]

    ops = []
    for pos, r in enumerate(records):
        kind = r["op"]
        if kind == "hello" and r.get("root_ino") is not None:
            ids.setdefault(r["root_ino"], ROOT)
            continue
        if kind in ("create", "mkdir"):
            ids[r["ino"]] = next(fresh)
        if kind in ("write", "truncate", "fsync", "fsync_dir"):
            ops.append(
                FsOp(pos, kind, of(r["ino"]), offset=r.get("offset", 0), data=r.get("data", b""))
            )
        elif kind == "rename":
            parents = (of(r["src_parent"]), of(r["parent"]))
            name, src = os.path.basename(r["dst"]), os.path.basename(r["src"])
            ops.append(FsOp(pos, kind, of(r["ino"]), parents, name, src))
        elif kind in ENTRY_KINDS:
            ops.append(
                FsOp(pos, kind, of(r["ino"]), (of(r["parent"]),), os.path.basename(r["path"]))
            )
    return ops


def covered_at(ops: Sequence[FsOp], model: str) -> dict[int, float]:
    """For each changing operation (by index in ``ops``), the position of the first barrier
    that makes it durable (infinity: none does)."""
    out: dict[int, float] = {}
    for i, op in enumerate(ops):
        if op.kind in ("fsync", "fsync_dir"):
            continue
        need = {op.inode} if op.is_data else set(op.parents)
        found = float("inf")
        for later in ops[i + 1 :]:
            if op.is_data:
                hit = later.kind == "fsync" and later.inode in need
            elif model == "ordered":
                hit = later.kind in ("fsync", "fsync_dir")
            else:
                hit = later.kind == "fsync_dir" and later.inode in need
            if hit:
                need.discard(later.inode)
                if not need or model == "ordered":
                    found = later.pos
                    break
        out[i] = found
    return out


def _options(op: FsOp) -> tuple[int, ...]:
    return (ABSENT, FULL, HALF, ZEROS) if op.kind == "write" else (ABSENT, FULL)


@dataclass(frozen=True)
class CrashState:
    """One state a crash may leave: the crash point, and how each operation that was not yet
    durable there landed (``(index in ops, variant)``; the others landed in full)."""

    point: int
    landed: tuple[tuple[int, int], ...]


class FsModel:
    """The crash states of one log under the ``posix`` or ``ordered`` model."""

    def __init__(self, records: Sequence[dict[str, Any]], model: str) -> None:
        assert model in ("posix", "ordered")
        self.model = model
        self.records = records
        self.ops = fs_ops(records)
        self.cover = covered_at(self.ops, model)

    def pending(self, point: int) -> list[int]:
        """The operations before ``point`` that are not durable there."""
        return [i for i, c in self.cover.items() if self.ops[i].pos < point and c >= point]

    def _digits(self, point: int) -> tuple[list[int], list[list[tuple[tuple[int, int], ...]]]]:
        """The pending operations as digits of a mixed radix: each digit's values are the
        ways its operations may have landed (in ``ordered``, the pending directory
        operations are one digit: how long a prefix of them survived)."""
        pending = self.pending(point)
        entries = [i for i in pending if not self.ops[i].is_data]
        singles = pending if self.model == "posix" else [i for i in pending if self.ops[i].is_data]
        digits = [[((i, v),) for v in _options(self.ops[i])] for i in singles]
        if self.model == "ordered" and entries:
            digits.append(
                [
                    tuple((i, FULL if n < j else ABSENT) for n, i in enumerate(entries))
                    for j in range(len(entries) + 1)
                ]
            )
        return pending, digits

    def count(self, point: int) -> int:
        n = 1
        for d in self._digits(point)[1]:
            n *= len(d)
        return n

    def states(self, point: int, limit: int | None, seed: str) -> Iterator[CrashState]:
        """Every state at ``point``, or ``limit`` of them drawn without repeats (seeded)."""
        _, digits = self._digits(point)
        total = self.count(point)
        if limit is None or total <= limit:
            numbers: Sequence[int] = range(total)
        else:
            numbers = sorted(random.Random(f"{seed}:{point}").sample(range(total), limit))
        for number in numbers:
            landed: list[tuple[int, int]] = []
            for d in digits:
                number, which = divmod(number, len(d))
                landed.extend(d[which])
            yield CrashState(point, tuple(sorted(landed)))

    def tree(self, state: CrashState) -> dict[str, bytes | None]:
        """The files (path -> bytes) and directories (path -> None) of ``state``."""
        landed = dict(state.landed)
        dirs: dict[int, dict[str, int]] = {ROOT: {}}
        files: dict[int, bytearray] = {}
        for i, op in enumerate(self.ops):
            if op.pos >= state.point:
                break
            if op.kind == "create":
                files[op.inode] = bytearray()
            elif op.kind == "mkdir":
                dirs[op.inode] = {}
            how = landed.get(i, FULL)
            if how != ABSENT and op.kind not in ("fsync", "fsync_dir"):
                _apply(op, how, dirs, files)
        out: dict[str, bytes | None] = {}
        _walk(ROOT, "", dirs, files, out)
        return out


def _apply(
    op: FsOp, how: int, dirs: dict[int, dict[str, int]], files: dict[int, bytearray]
) -> None:
    if op.kind == "write":
        data = (
            op.data[: len(op.data) // 2]
            if how == HALF
            else bytes(len(op.data))
            if how == ZEROS
            else op.data
        )
        buf = files[op.inode]
        if op.offset > len(buf):
            buf.extend(bytes(op.offset - len(buf)))
        buf[op.offset : op.offset + len(data)] = data
    elif op.kind == "truncate":
        files[op.inode].clear()
    elif op.kind in ("create", "mkdir", "link"):
        dirs[op.parents[0]][op.name] = op.inode
    elif op.kind == "rename":
        src = dirs[op.parents[0]]
        if src.get(op.src_name) == op.inode:
            del src[op.src_name]
        dirs[op.parents[1]][op.name] = op.inode
    elif dirs[op.parents[0]].get(op.name) == op.inode:  # unlink, rmdir
        del dirs[op.parents[0]][op.name]


def _walk(
    d: int,
    prefix: str,
    dirs: dict[int, dict[str, int]],
    files: dict[int, bytearray],
    out: dict[str, bytes | None],
) -> None:
    for name, inode in sorted(dirs[d].items()):
        path = prefix + name
        if inode in dirs:
            out[path] = None
            _walk(inode, path + "/", dirs, files, out)
        else:
            out[path] = bytes(files[inode])


def signature(tree: dict[str, bytes | None]) -> str:
    """A digest of a tree: equal trees, equal digests."""
    h = hashlib.sha256()
    for path, data in sorted(tree.items()):
        h.update(path.encode() + b"\0")
        h.update(b"/" if data is None else hashlib.sha256(data).digest())
    return h.hexdigest()


def object_states(
    records: Sequence[dict[str, Any]],
) -> Iterator[tuple[int, dict[str, bytes | None]]]:
    """The ``objects`` model: after each prefix of the completed Storage calls (a recursive
    delete as one call per object), the crash point (the position of the first call left out:
    everything before it had happened) and the tree, directories being the objects' prefixes."""
    ops: list[tuple[int, str, bytes | None]] = []
    for pos, r in enumerate(records):
        if r["op"] != "api":
            continue
        call = r["call"]
        if call in ("write_file", "put_atomic") or (
            call in ("put_if_absent", "receive") and r["result"]
        ):
            ops.append((pos, r["path"], r["data"]))
        elif call == "delete":
            ops.extend((pos, obj, None) for obj in r["objects"])
    objects: dict[str, bytes] = {}
    for j in range(len(ops) + 1):
        tree: dict[str, bytes | None] = {}
        for path, data in objects.items():
            parts = path.split("/")
            for n in range(1, len(parts)):
                tree["/".join(parts[:n])] = None
            tree[path] = data
        yield (ops[j][0] if j < len(ops) else len(records)), tree
        if j < len(ops):
            _, path, data = ops[j]
            if data is None:
                objects.pop(path, None)
            else:
                objects[path] = data
