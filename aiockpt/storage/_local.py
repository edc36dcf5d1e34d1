"""Local filesystems through the os module: O_DIRECT shard writes, fsync, atomic rename.

Nothing under the root is reached through a symbolic link (the root itself may be one: it is
the user's). Reads open a file by its full name with ``O_NOFOLLOW`` and keep it only when
the kernel's name of what was opened is that name (:meth:`LocalStorage._open_direct_path`);
else they open it from a descriptor of the root, one directory at a time, each opened with
``O_NOFOLLOW`` (:meth:`LocalStorage._parent`). So a link planted in the root (a step
directory pointing into another run, a shard pointing at ``/dev/zero``) is refused rather
than followed, whatever happens to the names meanwhile; and reads take only regular
files: opened ``O_NONBLOCK`` (opening a FIFO would otherwise wait for a writer forever) and
checked with ``fstat`` before the first read. Writes and deletes check each directory under
the root with ``lstat`` first (:meth:`LocalStorage._checked`) and never follow a link at the
name itself (``O_NOFOLLOW``, ``O_EXCL``, ``unlink``). They work on paths, not descriptors, so
that every change they make to the file system is one call on a path: the crash-point
checker (tests/crash) records and replays exactly those.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import errno as errno_mod
import os
import shutil
import stat
import threading
from collections.abc import Iterable, Sequence

import crc32c

from ..errors import StorageError
from ._local_paths import _O_CLOEXEC, _UnderRoot

_DIRECT_ALIGN = 4096
_CHUNK = 64 * 1024 * 1024  # O_DIRECT chunk: a multiple of the alignment
_O_DIRECT = getattr(os, "O_DIRECT", 0)
#: Reads of at least this many bytes may go past the page cache (see LocalStorage.readinto).
_DIRECT_MIN = 1024 * 1024
#: An O_DIRECT read is cut into requests of this size, this many in flight: into fresh shared
#: memory, one request at a time leaves the kernel's page faults in line with the I/O, and
#: several spread them over the readers; into memory already faulted in, both read at the
#: disk's speed (see docs/performance.md, "The load path, choice by choice").
_READ_PIECE = 16 * 1024 * 1024
_READERS = 4
#: put_if_absent's temporary name is unique per process: its calls in the process take turns.
_CREATING = threading.Lock()
#: Taken to start a storage's reader threads (see LocalStorage._readers) once.
_STARTING = threading.Lock()


def _address(buf: memoryview) -> int | None:
    """The buffer's address, or None when it cannot be had (read-only memory)."""
    if buf.readonly:
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _write_all(fd: int, buf: memoryview, offset: int) -> None:
    while len(buf):
        n = os.pwrite(fd, buf, offset)
        buf, offset = buf[n:], offset + n


def _read_all(fd: int, buf: memoryview, offset: int, full: str, end: int) -> None:
    """Fill ``buf`` from ``offset``; a file ending first is an EIO naming byte ``end``."""
    done = 0
    while done < len(buf):
        with buf[done:] as rest:
            n = os.preadv(fd, [rest], offset + done)
        if n == 0:
            raise StorageError(
                f"read {full} failed: the file ends before byte {end}",
                path=full,
                errno=errno_mod.EIO,
            )
        done += n


class _Fd:
    """A descriptor to close at the end of a ``with contextlib.closing(...)`` block."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def close(self) -> None:
        os.close(self.fd)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStorage(_UnderRoot):
    """A checkpoint root on a local (or locally mounted) filesystem."""

    #: write_file writes each piece before it asks for the next, and keeps no view of it.
    writes_in_order = True

    def __init__(self, root: str, *, url: str | None = None, direct_io: bool = True) -> None:
        self.root = os.path.abspath(root)
        self.url = url or self.root
        self.direct_io = direct_io and bool(_O_DIRECT)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # see _read_direct
        #: The root with its links resolved: the kernel's name of a file opened under it.
        self._real_root = os.path.realpath(self.root)

    # ----------------------------------------------------------------- writes

    def write_file(self, path: str, buffers: Sequence[memoryview]) -> None:
        """Create ``path`` (``O_CREAT | O_EXCL | O_NOFOLLOW``: never a file that is there, nor
        through a symbolic link) holding the concatenation of ``buffers``, and make it
        durable. Onto anything already at ``path`` it fails with ``EEXIST`` and touches
        nothing; a write that fails later removes the file it created, and only that one."""
        full = self._checked("create", path)
        try:
            fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise self._error("create", path, e) from None
        direct: list[int] = []  # the O_DIRECT descriptor, opened at the first aligned piece
        try:
            mine = os.fstat(fd)
            offset = 0
            for buf in buffers:
                buf = memoryview(buf).cast("B")
                self._write_buffer(fd, full, mine, buf, offset, direct)
                offset += len(buf)
            # One fsync for the file, whichever descriptor wrote its bytes: fsync is of the
            # file (its data and size), not of a descriptor.
            os.fsync(fd)
            # The file's name too: else a crash may keep a manifest linked after this write
            # and lose the shard's directory entry (found by tests/crash, POSIX model).
            _fsync_dir(os.path.dirname(full))
        except BaseException as e:
            # Remove the file this call created, if the name still holds it (not one put
            # there since: that is not ours to remove).
            with contextlib.suppress(OSError):
                if os.path.samestat(os.lstat(full), os.fstat(fd)):
                    os.unlink(full)
            if isinstance(e, OSError) and not isinstance(e, StorageError):
                raise self._error("write", path, e) from None
            raise
        finally:
            for dfd in direct:
                os.close(dfd)
            os.close(fd)

    def _write_buffer(
        self,
        fd: int,
        full: str,
        mine: os.stat_result,
        buf: memoryview,
        offset: int,
        direct: list[int],
    ) -> None:
        # O_DIRECT skips the page-cache copy for the aligned body; the tail goes through fd.
        body = len(buf) // _DIRECT_ALIGN * _DIRECT_ALIGN if self.direct_io else 0
        addr = _address(buf) if body else None
        if addr is None or addr % _DIRECT_ALIGN or offset % _DIRECT_ALIGN:
            body = 0
        if body and not direct:
            try:
                dfd = os.open(full, os.O_WRONLY | _O_DIRECT | os.O_NOFOLLOW)
            except OSError as e:
                if e.errno != errno_mod.EINVAL:  # EINVAL: this filesystem has no O_DIRECT
                    raise
                self.direct_io = False
                body = 0
            else:
                direct.append(dfd)
                # The name opened again must still be the file this write created.
                if not os.path.samestat(os.fstat(dfd), mine):
                    raise OSError(errno_mod.ESTALE, "the file was replaced while written")
        for start in range(0, body, _CHUNK):
            _write_all(direct[0], buf[start : min(start + _CHUNK, body)], offset + start)
        _write_all(fd, buf[body:], offset + body)

    def put_atomic(self, path: str, data: bytes) -> None:
        full = self._checked("write", path)
        tmp = full + ".tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, full)
            _fsync_dir(os.path.dirname(full))
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise self._error("write", path, e) from None

    def put_if_absent(self, path: str, data: bytes, *, mode: int | None = None) -> bool:
        """Create ``path`` holding ``data``, atomically and durably, unless something is there:
        False then. The file is written and synced under a temporary name and linked into
        place, and link(2) never replaces an existing name. ``mode``: its permission bits,
        set before anything is written (a secret is never readable by others, even for a
        moment)."""
        full = self._checked("create", path)
        tmp = f"{full}.{os.getpid()}.new"  # unique per process; calls in it take turns
        with _CREATING:
            try:
                with open(tmp, "wb") as f:
                    if mode is not None:
                        os.fchmod(f.fileno(), mode)
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                try:
                    os.link(tmp, full)
                except FileExistsError:
                    return False
                _fsync_dir(os.path.dirname(full))
                return True
            except OSError as e:
                raise self._error("create", path, e) from None
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    def receive(self, path: str, pieces: Iterable[bytes], crc: int) -> bool:
        """Create ``path`` from ``pieces``, a stream (a peer replica arriving, see
        ``_daemon/peers.py``), unless something is there: False then. As :meth:`put_if_absent`
        does, but a piece at a time: written and synced under a temporary name of this
        thread's, its crc32c checked against ``crc`` (a mismatch is a :class:`StorageError`
        and leaves nothing behind), then linked into place, which never replaces a name, and
        its directory synced. What reading ``pieces`` raises goes up as it is."""
        full = self._checked("create", path)
        tmp = f"{full}.{os.getpid()}.{threading.get_ident()}.peer"
        try:
            got = 0
            with open(tmp, "xb") as out:
                for piece in pieces:
                    got = crc32c.crc32c(piece, got)
                    out.write(piece)
                out.flush()
                os.fsync(out.fileno())
            if got != crc:
                raise StorageError(
                    f"{path}: crc32c {got:#010x} where {crc:#010x} was sent", path=full
                )
            try:
                os.link(tmp, full)
            except FileExistsError:
                return False
            _fsync_dir(os.path.dirname(full))
            return True
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def makedirs(self, path: str) -> None:
        full = self._full(path)
        try:
            existed = os.path.isdir(full)
            os.makedirs(full, exist_ok=True)
            if not existed:
                _fsync_dir(os.path.dirname(full))
        except OSError as e:
            raise self._error("mkdir", path, e) from None

    def delete(self, path: str, *, recursive: bool = False) -> None:
        """Remove the file ``path``, or with ``recursive`` the directory and all under it,
        durably. Never through a symbolic link: a link among the directories between the
        root and ``path`` is an :class:`UnsafeFileError` (``ELOOP``) and nothing is removed;
        ``path`` itself being a link removes the link alone, never what it points to, and a
        directory's removal unlinks the links it finds inside (:func:`shutil.rmtree` walks
        it by descriptors and never follows one)."""
        full = self._checked("delete", path)
        try:
            if recursive and stat.S_ISDIR(os.lstat(full).st_mode):
                shutil.rmtree(full)
            else:
                os.unlink(full)
            # Durable before the caller goes on: deleting a step unlinks its manifest first,
            # and a crash must never keep the manifest while losing a shard's unlink.
            _fsync_dir(os.path.dirname(full))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise self._error("delete", path, e) from None

    # ----------------------------------------------------------------- reads

    def read_range(self, path: str, start: int, end: int) -> bytes:
        out = bytearray(end - start)
        self.readinto(path, start, memoryview(out))
        return bytes(out)

    def readinto(self, path: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the file's bytes from ``offset``. A large read whose start is
        aligned in the file and in memory goes past the page cache (O_DIRECT), in pieces read
        :data:`_READERS` at a time; the rest is read through the page cache."""
        full = self._full(path)
        fd, st = self._open_regular("open", path)
        with contextlib.closing(_Fd(fd)), memoryview(out).cast("B") as view:
            try:
                body = self._direct_body(view, offset)
                if body:
                    with view[:body] as head:  # released on the way out, an error included
                        body = self._read_direct(fd, st, head, offset, full)
                with view[body:] as rest:
                    _read_all(fd, rest, offset + body, full, offset + len(view))
            except OSError as e:
                if isinstance(e, StorageError):
                    raise
                raise self._error("read", path, e) from None

    def _direct_body(self, view: memoryview, offset: int) -> int:
        """How many bytes from the start of ``view`` to read with O_DIRECT: none for a small
        read, unaligned memory or an unaligned offset."""
        if not self.direct_io or len(view) < _DIRECT_MIN or offset % _DIRECT_ALIGN:
            return 0
        addr = _address(view)
        if addr is None or addr % _DIRECT_ALIGN:
            return 0
        return len(view) // _DIRECT_ALIGN * _DIRECT_ALIGN

    def _read_direct(
        self, fd: int, st: os.stat_result, body: memoryview, offset: int, full: str
    ) -> int:
        """Read ``body`` with O_DIRECT, :data:`_READ_PIECE` bytes a request and
        :data:`_READERS` requests in flight (into memory nobody touched yet, the readers also
        share the work of faulting its pages in); the bytes read, 0 where the filesystem has
        no O_DIRECT. The O_DIRECT descriptor is ``fd``'s file opened again through
        /proc/self/fd, so it is the same file whatever became of its name."""
        try:
            dfd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | _O_DIRECT | _O_CLOEXEC)
        except OSError as e:
            if e.errno == errno_mod.EINVAL:  # this filesystem has no O_DIRECT
                self.direct_io = False
                return 0
            if e.errno in (errno_mod.ENOENT, errno_mod.EACCES):  # no /proc: the page cache
                return 0
            raise
        if not os.path.samestat(os.fstat(dfd), st):
            os.close(dfd)
            raise OSError(errno_mod.ESTALE, "the file was replaced while it was open")
        end = offset + len(body)

        def piece(start: int) -> None:
            with body[start : start + _READ_PIECE] as part:
                _read_all(dfd, part, offset + start, full, end)

        try:
            starts = range(0, len(body), _READ_PIECE)
            if len(starts) == 1:
                piece(0)
            else:
                futures = [self._readers().submit(piece, start) for start in starts]
                concurrent.futures.wait(futures)
                for f in futures:
                    f.result()  # the first failure, once none is still reading
        finally:
            os.close(dfd)
        return len(body)

    def _readers(self) -> concurrent.futures.ThreadPoolExecutor:
        with _STARTING:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    _READERS, thread_name_prefix="aiockpt-read"
                )
            return self._pool

    def size(self, path: str) -> int:
        """The size of the regular file ``path``: what :meth:`readinto` would open (never a
        link, a FIFO or a device; see :class:`UnsafeFileError`)."""
        fd, st = self._open_regular("stat", path)
        os.close(fd)
        return st.st_size

    def exists(self, path: str) -> bool:
        return os.path.exists(self._full(path))

    def list_dir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(self._full(path)))
        except FileNotFoundError:
            return []
        except OSError as e:
            raise self._error("list", path, e) from None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
