"""The Storage protocol: what the daemon needs from a backend, and nothing more."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from ..errors import CorruptCheckpointError, StorageError


class UnsafeFileError(StorageError, CorruptCheckpointError):
    """A path under the root that is not a regular file reached without a symbolic link: a
    FIFO, a socket, a device, a directory where a file should be, or a symbolic link at the
    file or at a directory between it and the root. Refused before a byte of it is read
    (opening a FIFO alone would block forever), and before anything is deleted through it.

    It is a :class:`StorageError` (``errno`` ``ELOOP`` for a symbolic link, ``EISDIR`` for
    a directory, ``EINVAL`` for the rest) and a
    :class:`~aiockpt.errors.CorruptCheckpointError`: a checkpoint holding one is damaged or
    hostile, and loads and ``aiockpt verify`` report it as such, naming the path."""

    def __init__(self, message: str, *, path: str | None = None, errno: int | None = None) -> None:
        StorageError.__init__(self, message, path=path, errno=errno)
        self.key = None


@runtime_checkable
class Storage(Protocol):
    """A checkpoint root. Paths are relative to it and use "/"; the daemon is the only user.

    Every method raises :class:`aiockpt.errors.StorageError` (carrying the errno of an OS error)
    on failure, and :class:`FileNotFoundError`-derived errors never escape raw.
    """

    #: The root's URL, as given to the factory.
    url: str

    def write_file(self, path: str, buffers: Sequence[memoryview]) -> None:
        """Create the file ``path`` holding the concatenation of ``buffers``, durably (its
        bytes and its name), without copying the bytes into one buffer first.

        It creates; it never replaces: when something is at ``path`` already the write fails
        with a StorageError whose ``errno`` is ``errno.EEXIST`` and leaves what is there as
        it was, byte for byte. Where the backend can, the check and the creation are one
        atomic step (a racing writer of the same name cannot be replaced either); where it
        cannot, the storage documents the window. A failed write leaves no file of its own
        behind, and never removes one it did not create."""

    def put_atomic(self, path: str, data: bytes) -> None:
        """Publish a small file atomically and durably: readers see all of it or nothing."""

    # Optional, where the backend can do it atomically (local files, S3, memory):
    #
    #     def put_if_absent(self, path: str, data: bytes) -> bool:
    #         """Create a small file atomically and durably unless something is at ``path``
    #         (then return False, changing nothing); two callers never both get True."""
    #
    # It makes the root's lease and its commits safe against two writers (docs/reliability.md).
    #
    # Optional, where write_file can take its pieces from an iterator:
    #
    #     writes_in_order = True
    #
    # meaning write_file asks for the pieces in order, each once, and has written or copied a
    # piece, keeping no view of it, before it asks for the next. A save staged in windows
    # (``staging_memory`` below the shard's size: docs/design.md) needs it: its pieces are
    # made as the trainer stages them, and each window's memory is reused once passed on.

    def read_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of a file."""

    def readinto(self, path: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` from the file at ``offset``; a short file is an error."""

    def size(self, path: str) -> int:
        """A file's size in bytes."""

    def exists(self, path: str) -> bool:
        """Whether a file or directory is there, never from a stale cache."""
        ...

    def list_dir(self, path: str) -> list[str]:
        """Names directly under a directory ("" is the root), never from a stale cache;
        an empty list when it does not exist."""

    def makedirs(self, path: str) -> None:
        """Make a directory and its parents where the backend has directories."""

    def delete(self, path: str, *, recursive: bool = False) -> None:
        """Remove a file, or a directory and everything under it, durably where the backend
        can (done before the call returns); missing is not an error."""

    def close(self) -> None:
        """Release connections and caches; the storage is not used after this."""
        ...
