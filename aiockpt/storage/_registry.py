"""Which Storage serves a URL: code registrations, then entry points, then fsspec.

Entry points (group ``aiockpt.storage``, name = URL protocol, value = a factory
``(url, storage_options) -> Storage``) are read lazily as strings and a plugin is imported only
when its protocol is first used, as fsspec's own registry does.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from ..errors import StorageError
from ._base import Storage
from ._fsspec import FsspecStorage
from ._local import LocalStorage

ENTRY_POINT_GROUP = "aiockpt.storage"
StorageFactory = Callable[[str, dict[str, Any]], Storage]

#: Protocols whose storage lives in a plugin distribution, with how to install it.
PLUGIN_HINTS = {
    "s3": "pip install 'aiockpt[s3]' (the aiockpt-s3 plugin, from plugins/aiockpt-s3)",
    "s3a": "pip install 'aiockpt[s3]' (the aiockpt-s3 plugin, from plugins/aiockpt-s3)",
}

_lock = threading.Lock()
_registered: dict[str, StorageFactory] = {}


def register_storage(protocol: str, factory: StorageFactory, *, clobber: bool = False) -> None:
    """Serve ``protocol://`` URLs with ``factory``; refuses to replace one unless ``clobber``."""
    if not protocol or (not protocol.isidentifier() and not protocol.replace("-", "").isalnum()):
        raise ValueError(f"bad protocol name {protocol!r}")
    if not callable(factory):
        raise TypeError(f"the factory for {protocol!r} is not callable")
    with _lock:
        if protocol in _registered and not clobber:
            raise ValueError(f"a storage is already registered for {protocol!r}; pass clobber=True")
        _registered[protocol] = factory


def registered_protocols() -> list[str]:
    """Protocols served by code registrations and installed entry points."""
    names = set(_registered) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return sorted(names)


def split_protocol(url: str) -> tuple[str, str]:
    """("file", "/abs/path") for local paths, else (protocol, url)."""
    if "://" not in url:
        return "file", os.path.abspath(os.path.expanduser(url))
    protocol, rest = url.split("://", 1)
    if protocol in ("file", "local"):
        return "file", os.path.abspath(rest)
    return protocol, url


def _factory_for(protocol: str) -> StorageFactory | None:
    with _lock:
        if protocol in _registered:
            return _registered[protocol]
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == protocol:
            try:
                factory = ep.load()
            except ImportError as e:
                raise StorageError(
                    f"the storage plugin for {protocol}:// ({ep.value}) failed to import: {e}"
                ) from e
            with _lock:
                _registered.setdefault(protocol, factory)
            return factory
    return None


def open_storage(url: str, storage_options: dict[str, Any] | None = None) -> Storage:
    """The Storage for ``url``."""
    options = dict(storage_options or {})
    protocol, target = split_protocol(url)
    factory = _factory_for(protocol)
    if factory is not None:
        storage = factory(target, options)
        if not isinstance(storage, Storage):
            raise TypeError(
                f"the storage factory for {protocol}:// returned {type(storage).__qualname__}, "
                "which does not implement aiockpt.storage.Storage"
            )
        return storage
    if protocol == "file":
        if options:
            raise ValueError(f"local paths take no storage_options (got {sorted(options)})")
        return LocalStorage(target, url=url)
    if protocol in PLUGIN_HINTS:
        raise StorageError(
            f"{protocol}:// needs a storage plugin that is not installed: {PLUGIN_HINTS[protocol]}"
        )
    import fsspec

    if protocol not in fsspec.available_protocols():
        raise StorageError(f"no storage knows the protocol {protocol!r} of {url!r}")
    return FsspecStorage(url, options)
