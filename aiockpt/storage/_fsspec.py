"""Any fsspec filesystem as a checkpoint root.

``write_file`` creates and never replaces (see :class:`~aiockpt.storage.Storage`). fsspec's
exclusive mode ``"xb"`` is implementation-dependent ("whether it is checked up front or on
commit, and whether it is atomic"), and a filesystem that does not implement it may write over
a file as ``"wb"`` would. So it is used only where it is known to hold: the local filesystem
(``open(..., "xb")``, ``O_CREAT | O_EXCL``) and the memory filesystem (a check and an insert in
the one process that sees the store). Every other filesystem gets an ``exists()`` check before
the write, which keeps out a file that is there before the write starts, but not one another
writer creates between the check and the end of this write: that one is replaced.
:attr:`FsspecStorage.creates_atomically` says which holds.
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
from collections.abc import Sequence
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from ..errors import StorageError

#: Filesystems whose ``open(path, "xb")`` creates a file only where none is, in one step. The
#: exact types: a subclass may open files its own way.
_EXCLUSIVE_OPEN = (LocalFileSystem, MemoryFileSystem)


class FsspecStorage:
    """A root on any fsspec filesystem. Durability is what the filesystem's close() gives."""

    #: write_file hands each piece to the file's write(), which writes or copies it, before
    #: it asks for the next.
    writes_in_order = True

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        except (ImportError, ValueError) as e:
            raise StorageError(f"cannot open {url}: {e}", path=url) from e
        self.root = self.root.rstrip("/")
        #: Whether write_file's "nothing is there" check and its creation are one step, so
        #: that a racing writer's file is never replaced either (see the module's docstring).
        self.creates_atomically = type(self.fs) in _EXCLUSIVE_OPEN
        if isinstance(self.fs, MemoryFileSystem):
            # Its create mode is one check-and-insert under the GIL: atomic in this process,
            # the only one that sees the filesystem. Elsewhere fsspec's create mode is an
            # exists() then a write, which two writers can both pass: not offered.
            self.put_if_absent = self._put_if_absent

    def _full(self, path: str) -> str:
        return f"{self.root}/{path}" if path else self.root

    def _error(self, op: str, path: str, e: Exception) -> StorageError:
        full = self._full(path)
        code = getattr(e, "errno", None)
        if isinstance(e, FileNotFoundError) and code is None:
            code = errno_mod.ENOENT
        err = StorageError(
            f"{op} {self.fs.unstrip_protocol(full)} failed: {e}", path=full, errno=code
        )
        err.__cause__ = e
        return err

    def write_file(self, path: str, buffers: Sequence[memoryview]) -> None:
        """Create ``path`` holding the concatenation of ``buffers``; onto a file that is there
        it fails with ``EEXIST`` and leaves it as it was. Atomically where
        :attr:`creates_atomically`, else checked with ``exists()`` first (see the module's
        docstring). A write that fails after creating the file removes it."""
        full = self._full(path)
        if not self.creates_atomically and self.exists(path):
            raise self._exists_error(path)
        try:
            f = self.fs.open(full, "xb" if self.creates_atomically else "wb")
        except FileExistsError:
            raise self._exists_error(path) from None
        except Exception as e:
            raise self._error("create", path, e) from None
        try:
            with f:
                for buf in buffers:
                    f.write(buf)
        except Exception as e:
            # The file is this call's own: it was created above (exclusively, or where the
            # check found nothing).
            with contextlib.suppress(Exception):
                self.fs.rm(full)
            raise self._error("write", path, e) from None

    def _exists_error(self, path: str) -> StorageError:
        full = self._full(path)
        return StorageError(
            f"create {self.fs.unstrip_protocol(full)} failed: a file is there already "
            "(a write never replaces one)",
            path=full,
            errno=errno_mod.EEXIST,
        )

    def put_atomic(self, path: str, data: bytes) -> None:
        try:
            self.fs.pipe_file(self._full(path), data)
        except Exception as e:
            raise self._error("write", path, e) from None

    def _put_if_absent(self, path: str, data: bytes) -> bool:
        try:
            self.fs.pipe_file(self._full(path), data, mode="create")
        except FileExistsError:
            return False
        except Exception as e:
            raise self._error("create", path, e) from None
        return True

    def read_range(self, path: str, start: int, end: int) -> bytes:
        try:
            data = self.fs.cat_file(self._full(path), start=start, end=end)
        except Exception as e:
            raise self._error("read", path, e) from None
        if len(data) != end - start:
            raise StorageError(
                f"read {self._full(path)} failed: the file ends before byte {end}",
                path=self._full(path),
                errno=errno_mod.EIO,
            )
        return data

    def readinto(self, path: str, offset: int, out: memoryview) -> None:
        out = memoryview(out).cast("B")
        step = 64 * 1024 * 1024
        for start in range(0, len(out), step):
            stop = min(start + step, len(out))
            out[start:stop] = self.read_range(path, offset + start, offset + stop)

    def size(self, path: str) -> int:
        try:
            return int(self.fs.size(self._full(path)))
        except Exception as e:
            raise self._error("stat", path, e) from None

    def exists(self, path: str) -> bool:
        try:
            return bool(self.fs.exists(self._full(path)))
        except Exception as e:
            raise self._error("stat", path, e) from None

    def list_dir(self, path: str) -> list[str]:
        full = self._full(path)
        try:
            self.fs.invalidate_cache(full)
            entries = self.fs.ls(full, detail=False)
        except FileNotFoundError:
            return []
        except Exception as e:
            raise self._error("list", path, e) from None
        names = {e.rstrip("/").rsplit("/", 1)[-1] for e in entries}
        names.discard("")
        return sorted(names)

    def makedirs(self, path: str) -> None:
        try:
            self.fs.makedirs(self._full(path), exist_ok=True)
        except Exception as e:
            raise self._error("mkdir", path, e) from None

    def delete(self, path: str, *, recursive: bool = False) -> None:
        full = self._full(path)
        try:
            self.fs.rm(full, recursive=recursive)
        except FileNotFoundError:
            pass
        except Exception as e:
            raise self._error("delete", path, e) from None

    def close(self) -> None:
        pass
