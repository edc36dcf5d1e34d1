"""Storage backends: the protocol, the built-in fsspec and local implementations, the registry."""

from __future__ import annotations

from ._base import Storage, UnsafeFileError
from ._counting import CountingStorage
from ._fsspec import FsspecStorage
from ._local import LocalStorage
from ._registry import ENTRY_POINT_GROUP, open_storage, register_storage, registered_protocols

__all__ = [
    "ENTRY_POINT_GROUP",
    "CountingStorage",
    "FsspecStorage",
    "LocalStorage",
    "Storage",
    "UnsafeFileError",
    "open_storage",
    "register_storage",
    "registered_protocols",
]
