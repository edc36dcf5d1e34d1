"""How :class:`~aiockpt.storage.LocalStorage` reaches a path under its root: never through a
symbolic link (the root itself may be one: it is the user's), reading regular files only.

Reads open a file by its full name with ``O_NOFOLLOW`` and keep it only when the kernel's name
of what was opened is that name (:meth:`_UnderRoot._open_direct_path`); else they open it from
a descriptor of the root, one directory at a time, each opened with ``O_NOFOLLOW``
(:meth:`_UnderRoot._parent`). Writes and deletes check each directory under the root with
``lstat`` first (:meth:`_UnderRoot._checked`).
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import os
import stat
from collections.abc import Iterator

from ..errors import StorageError
from ._base import UnsafeFileError

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
#: A directory under the root, opened never through a symbolic link.
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _O_CLOEXEC
#: A file to read: not through a link, and without blocking (a FIFO's open waits for a writer).
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _O_CLOEXEC

_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFDIR: "a directory",
    stat.S_IFLNK: "a symbolic link",
}


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


class _UnderRoot:
    """How :class:`LocalStorage` reaches a path under its root: never through a symbolic
    link, reading regular files only (kept apart only to keep each class short)."""

    root: str
    _real_root: str

    def _full(self, path: str) -> str:
        return os.path.join(self.root, path) if path else self.root

    def _names(self, path: str) -> list[str]:
        """The components of ``path`` under the root; ``..`` would leave it and is refused."""
        names = [n for n in path.split("/") if n and n != "."]
        if ".." in names:
            full = self._full(path)
            raise StorageError(
                f"{full}: a path under the root cannot hold '..'", path=full, errno=errno_mod.EINVAL
            )
        return names

    def _checked(self, op: str, path: str) -> str:
        """The full path of ``path``, once no directory between the root and it is a
        symbolic link (each is ``lstat``-ed; a missing one stops the check, and the call
        then fails, or not, as it would): else an :class:`UnsafeFileError` (``ELOOP``)."""
        names = self._names(path)
        here = self.root
        for i, name in enumerate(names[:-1]):
            here = os.path.join(here, name)
            try:
                mode = os.lstat(here).st_mode
            except FileNotFoundError:
                break
            except OSError as e:
                raise self._error(op, path, e) from None
            if stat.S_ISLNK(mode):
                raise self._link_error(op, path, "/".join(names[: i + 1]))
        return self._full(path)

    @contextlib.contextmanager
    def _parent(self, op: str, path: str) -> Iterator[tuple[int, str]]:
        """A descriptor of the directory that holds ``path``, and the last component's name
        (``"."`` for the root itself). Each directory under the root is opened from the one
        above it with ``O_NOFOLLOW``: one that is a symbolic link is an
        :class:`UnsafeFileError` (``ELOOP``) naming ``path``, and no later rename can send
        the call elsewhere."""
        names = self._names(path)
        try:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | _O_CLOEXEC)
        except OSError as e:
            raise self._error(op, path, e) from None
        try:
            for i, name in enumerate(names[:-1]):
                try:
                    sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except OSError as e:
                    # O_DIRECTORY | O_NOFOLLOW on a link is ENOTDIR (or ELOOP): say which.
                    if e.errno in (errno_mod.ENOTDIR, errno_mod.ELOOP) and _is_link(name, fd):
                        raise self._link_error(op, path, "/".join(names[: i + 1])) from None
                    raise self._error(op, path, e) from None
                os.close(fd)
                fd = sub
            yield fd, names[-1] if names else "."
        finally:
            os.close(fd)

    def _link_error(self, op: str, path: str, link: str) -> UnsafeFileError:
        full = self._full(path)
        where = "" if link == path else f": {self._full(link)} is a symbolic link"
        what = "is a symbolic link" if link == path else "lies under a symbolic link"
        return UnsafeFileError(
            f"{op} {full} refused: it {what}{where}; aiockpt never follows a symbolic link "
            "under the root",
            path=full,
            errno=errno_mod.ELOOP,
        )

    def _open_regular(self, op: str, path: str) -> tuple[int, os.stat_result]:
        """A read-only descriptor of the regular file ``path`` (the caller closes it) and its
        fstat, opened without following a symbolic link and without blocking; anything else
        (a FIFO, a socket, a device, a directory, a link) is an :class:`UnsafeFileError`
        naming it, refused before any read."""
        fd = self._open_direct_path(path)
        if fd is None:  # not plainly the file under the root: open it step by step, or say why
            with self._parent(op, path) as (parent, name):
                fd = self._open_in(op, path, parent, name)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise self._not_regular(op, path, st.st_mode)
        except BaseException:
            os.close(fd)
            raise
        return fd, st

    def _open_direct_path(self, path: str) -> int | None:
        """``path`` opened by its full name (one system call where :meth:`_parent` makes one
        per directory: a load makes a read per run of tensors), when that reached the file
        the name says: no link at its last component (``O_NOFOLLOW``) nor among the
        directories, which the kernel's own name of what was opened, read from
        ``/proc/self/fd``, shows (a link resolved on the way gives another name). None
        otherwise, or when the open failed, for :meth:`_parent` to open it again or to say
        what is in the way."""
        names = self._names(path)
        try:
            fd = os.open(self._full(path), _READ_FLAGS)
        except OSError:
            return None
        try:
            opened = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            opened = None
        if opened != os.path.join(self._real_root, *names):
            os.close(fd)
            return None
        return fd

    def _open_in(self, op: str, path: str, parent: int, name: str) -> int:
        """``name`` in the directory ``parent`` opened to read, as :meth:`_open_regular`
        does."""
        try:
            return os.open(name, _READ_FLAGS, dir_fd=parent)
        except OSError as e:
            if e.errno == errno_mod.ELOOP:
                raise self._link_error(op, path, path) from None
            # A socket cannot be opened at all (ENXIO), nor can a device without its
            # driver: say what is there rather than the open's errno.
            try:
                mode = os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode
            except OSError:
                mode = stat.S_IFREG
            if not stat.S_ISREG(mode):
                raise self._not_regular(op, path, mode) from None
            raise self._error(op, path, e) from None

    def _not_regular(self, op: str, path: str, mode: int) -> UnsafeFileError:
        full = self._full(path)
        kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
        return UnsafeFileError(
            f"{op} {full} refused: it is {kind}, not a regular file",
            path=full,
            errno=errno_mod.EISDIR if stat.S_ISDIR(mode) else errno_mod.EINVAL,
        )

    def _error(self, op: str, path: str, e: OSError) -> StorageError:
        full = self._full(path)
        err = StorageError(f"{op} {full} failed: {e.strerror or e}", path=full, errno=e.errno)
        err.__cause__ = e
        return err
