"""Storages for tests, registered under protocols of their own (``register_storage``): the
daemon imports their factories by name, so they live in a module it can import."""

from __future__ import annotations

import errno
import os
import time
from typing import Any

from aiockpt.errors import StorageError
from aiockpt.storage import LocalStorage


class UnorderedStorage(LocalStorage):
    """A local root that does not declare ``writes_in_order``, as a storage whose upload must
    have every piece at once."""

    writes_in_order = False


def open_unordered(url: str, storage_options: dict[str, Any]) -> UnorderedStorage:
    return UnorderedStorage(url.partition("://")[2])


class GatedStorage(LocalStorage):
    """A local root whose shard writes stop half way until a gate file exists: a writer
    paused in the middle of a shard (SIGSTOP, a slow disk) without timing anything.

    The storage options name the gate (``gate``, a path) and a file this storage creates once
    a write has reached the gate (``reached``), so a test knows the writer is paused there."""

    def __init__(self, root: str, gate: str, reached: str) -> None:
        super().__init__(root)
        self.gate, self.reached = gate, reached

    def write_file(self, path: str, buffers: Any) -> None:
        if "/shard_r" not in path or os.path.exists(self.gate):
            super().write_file(path, buffers)
            return
        data = b"".join(bytes(b) for b in buffers)
        half = len(data) // 2

        def pieces() -> Any:
            yield memoryview(data[:half])
            with open(self.reached, "w"):
                pass
            while not os.path.exists(self.gate):
                time.sleep(0.01)
            yield memoryview(data[half:])

        super().write_file(path, pieces())


def open_gated(url: str, storage_options: dict[str, Any]) -> GatedStorage:
    return GatedStorage(
        url.partition("://")[2], storage_options["gate"], storage_options["reached"]
    )


class FullDiskStorage(LocalStorage):
    """A local root whose disk is full while a flag file exists: at the commit (every
    manifest creation fails with ENOSPC, after the shard was written; storage option
    ``flag``), or at the shard's write (option ``write_flag``); and whose reads of paths
    holding ``read_match`` fail while ``read_flag`` exists; and where, while ``taken_flag``
    exists, a shard's name turns out taken by another attempt's file (EEXIST)."""

    def __init__(
        self,
        root: str,
        flag: str | None,
        write_flag: str | None,
        read_flag: str | None = None,
        read_match: str = "",
        taken_flag: str | None = None,
    ) -> None:
        super().__init__(root)
        self.flag, self.write_flag = flag, write_flag
        self.read_flag, self.read_match = read_flag, read_match
        self.taken_flag = taken_flag

    @staticmethod
    def _no_space(path: str) -> StorageError:
        return StorageError(f"{path}: no space left on device", path=path, errno=errno.ENOSPC)

    def write_file(self, path: str, buffers: Any) -> None:
        if "/shard_r" in path and self.write_flag and os.path.exists(self.write_flag):
            raise self._no_space(path)
        if "/shard_r" in path and self.taken_flag and os.path.exists(self.taken_flag):
            # Another attempt's file is already at this very name: the create is refused.
            super().write_file(path, [memoryview(b"another attempt's bytes")])
            raise StorageError(f"create {path} refused: it exists", path=path, errno=errno.EEXIST)
        super().write_file(path, buffers)

    def readinto(self, path: str, offset: int, out: memoryview) -> None:
        # An outage of reads, of the files under ``read_match`` alone, while ``read_flag``
        # exists: the storage failing, not the checkpoint.
        if self.read_flag and os.path.exists(self.read_flag) and self.read_match in path:
            raise StorageError(f"read {path} failed: connection reset", path=path, errno=errno.EIO)
        super().readinto(path, offset, out)

    def put_if_absent(self, path: str, data: bytes, *, mode: int | None = None) -> bool:
        if path.endswith("/manifest.json") and self.flag and os.path.exists(self.flag):
            raise self._no_space(path)
        return super().put_if_absent(path, data, mode=mode)


def open_full_disk(url: str, storage_options: dict[str, Any]) -> FullDiskStorage:
    options = dict(storage_options)
    return FullDiskStorage(
        url.partition("://")[2],
        options.get("flag"),
        options.get("write_flag"),
        options.get("read_flag"),
        options.get("read_match", ""),
        options.get("taken_flag"),
    )


class VanishingStorage(LocalStorage):
    """A local root where, while the flag file ``vanish`` exists, the first read of a file of
    a step deletes that step first (its manifest, then its directory): retention, or aiockpt
    prune, deleting the step a load is reading."""

    def __init__(self, root: str, vanish: str) -> None:
        super().__init__(root)
        self.vanish = vanish

    def readinto(self, path: str, offset: int, out: memoryview) -> None:
        step_dir, _, name = path.partition("/")
        if name.startswith("shard_r") and os.path.exists(self.vanish):
            os.unlink(self.vanish)
            super().delete(f"{step_dir}/manifest.json")
            super().delete(step_dir, recursive=True)
        super().readinto(path, offset, out)


def open_vanishing(url: str, storage_options: dict[str, Any]) -> VanishingStorage:
    return VanishingStorage(url.partition("://")[2], storage_options["vanish"])


def open_in_memory(url: str, storage_options: dict[str, Any]) -> Any:
    """fsspec's in-memory file system: a storage that is not a local directory."""
    from aiockpt.storage import FsspecStorage

    return FsspecStorage("memory://" + url.partition("://")[2], storage_options)
