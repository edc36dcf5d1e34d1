"""Local filesystems through the os module: O_DIRECT shard writes, fsync, atomic rename."""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import errno as errno_mod
import os
import shutil
import threading
from collections.abc import Sequence

from ..errors import StorageError

_DIRECT_ALIGN = 4096
_CHUNK = 64 * 1024 * 1024  # O_DIRECT chunk: a multiple of the alignment
_O_DIRECT = getattr(os, "O_DIRECT", 0)
#: Reads of at least this many bytes may go past the page cache (see LocalStorage.readinto).
_DIRECT_MIN = 1024 * 1024
#: An O_DIRECT read is cut into requests of this size, this many in flight: measured on a
#: virtio disk at 1 GiB, one request at a time into fresh shared memory read at 0.5-0.7 GB/s
#: (most of the time faulting pages in), four at a time at 1.2 GB/s; into memory already
#: faulted in, both at the disk's 2 GB/s.
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


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStorage:
    """A checkpoint root on a local (or locally mounted) filesystem."""

    #: write_file writes each piece before it asks for the next, and keeps no view of it.
    writes_in_order = True

    def __init__(self, root: str, *, url: str | None = None, direct_io: bool = True) -> None:
        self.root = os.path.abspath(root)
        self.url = url or self.root
        self.direct_io = direct_io and bool(_O_DIRECT)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # see _read_direct

    def _full(self, path: str) -> str:
        return os.path.join(self.root, path) if path else self.root

    def _error(self, op: str, path: str, e: OSError) -> StorageError:
        full = self._full(path)
        err = StorageError(f"{op} {full} failed: {e.strerror or e}", path=full, errno=e.errno)
        err.__cause__ = e
        return err

    # ----------------------------------------------------------------- writes

    def write_file(self, path: str, buffers: Sequence[memoryview]) -> None:
        full = self._full(path)
        try:
            fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as e:
            raise self._error("create", path, e) from None
        direct: list[int] = []  # the O_DIRECT descriptor, opened at the first aligned piece
        try:
            offset = 0
            for buf in buffers:
                buf = memoryview(buf).cast("B")
                self._write_buffer(fd, full, buf, offset, direct)
                offset += len(buf)
            # One fsync for the file, whichever descriptor wrote its bytes: fsync is of the
            # file (its data and size), not of a descriptor.
            os.fsync(fd)
            # The file's name too: else a crash may keep a manifest linked after this write
            # and lose the shard's directory entry (found by tests/crash, POSIX model).
            _fsync_dir(os.path.dirname(full))
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(full)
            raise self._error("write", path, e) from None
        finally:
            for dfd in direct:
                os.close(dfd)
            os.close(fd)

    def _write_buffer(
        self, fd: int, full: str, buf: memoryview, offset: int, direct: list[int]
    ) -> None:
        # O_DIRECT skips the page-cache copy for the aligned body; the tail goes through fd.
        body = len(buf) // _DIRECT_ALIGN * _DIRECT_ALIGN if self.direct_io else 0
        addr = _address(buf) if body else None
        if addr is None or addr % _DIRECT_ALIGN or offset % _DIRECT_ALIGN:
            body = 0
        if body and not direct:
            try:
                direct.append(os.open(full, os.O_WRONLY | _O_DIRECT))
            except OSError as e:
                if e.errno != errno_mod.EINVAL:  # EINVAL: this filesystem has no O_DIRECT
                    raise
                self.direct_io = False
                body = 0
        for start in range(0, body, _CHUNK):
            _write_all(direct[0], buf[start : min(start + _CHUNK, body)], offset + start)
        _write_all(fd, buf[body:], offset + body)

    def put_atomic(self, path: str, data: bytes) -> None:
        full = self._full(path)
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

    def put_if_absent(self, path: str, data: bytes) -> bool:
        """Create ``path`` holding ``data``, atomically and durably, unless something is there:
        False then. The file is written and synced under a temporary name and linked into
        place, and link(2) never replaces an existing name."""
        full = self._full(path)
        tmp = f"{full}.{os.getpid()}.new"  # unique per process; calls in it take turns
        with _CREATING:
            try:
                with open(tmp, "wb") as f:
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
        full = self._full(path)
        try:
            if recursive and os.path.isdir(full):
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
        try:
            fd = os.open(full, os.O_RDONLY)
        except OSError as e:
            raise self._error("open", path, e) from None
        view = memoryview(out).cast("B")
        try:
            body = self._direct_body(view, offset)
            if body:
                with view[:body] as head:  # released on the way out, an error included
                    body = self._read_direct(full, head, offset)
            with view[body:] as rest:
                _read_all(fd, rest, offset + body, full, offset + len(view))
        except OSError as e:
            if isinstance(e, StorageError):
                raise
            raise self._error("read", path, e) from None
        finally:
            view.release()
            os.close(fd)

    def _direct_body(self, view: memoryview, offset: int) -> int:
        """How many bytes from the start of ``view`` to read with O_DIRECT: none for a small
        read, unaligned memory or an unaligned offset."""
        if not self.direct_io or len(view) < _DIRECT_MIN or offset % _DIRECT_ALIGN:
            return 0
        addr = _address(view)
        if addr is None or addr % _DIRECT_ALIGN:
            return 0
        return len(view) // _DIRECT_ALIGN * _DIRECT_ALIGN

    def _read_direct(self, full: str, body: memoryview, offset: int) -> int:
        """Read ``body`` with O_DIRECT, :data:`_READ_PIECE` bytes a request and
        :data:`_READERS` requests in flight (into memory nobody touched yet, the readers also
        share the work of faulting its pages in); the bytes read, 0 where the filesystem has
        no O_DIRECT."""
        try:
            dfd = os.open(full, os.O_RDONLY | _O_DIRECT)
        except OSError as e:
            if e.errno != errno_mod.EINVAL:  # EINVAL: this filesystem has no O_DIRECT
                raise
            self.direct_io = False
            return 0
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
        try:
            return os.stat(self._full(path)).st_size
        except OSError as e:
            raise self._error("stat", path, e) from None

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
