"""Which Storage serves a URL: code registrations, then entry points, then fsspec.

Entry points (group ``aiockpt.storage``, name = URL protocol, value = a factory
``(url, storage_options) -> Storage``) are read lazily as strings and a plugin is imported only
when its protocol is first used, as fsspec's own registry does.

Storage is used only in the daemon, a separate process. A factory registered in code is
therefore recorded by its import path in the environment variable ``AIOCKPT_STORAGE_FACTORIES``
(``proto=module:attr;...``), which the daemon inherits and reads: the factory must be
importable by name, which rules out lambdas, local functions and anything in ``__main__``.
"""

from __future__ import annotations

import importlib
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
ENV_VAR = "AIOCKPT_STORAGE_FACTORIES"
StorageFactory = Callable[[str, dict[str, Any]], Storage]

_S3_HINT = (
    "install the aiockpt-s3 distribution (it brings s3fs): from an aiockpt checkout, "
    "pip install ./plugins/aiockpt-s3"
)
#: Protocols whose storage lives in a plugin distribution, with how to install it.
PLUGIN_HINTS = {"s3": _S3_HINT, "s3a": _S3_HINT}

_lock = threading.Lock()
_registered: dict[str, str] = {}  # protocol -> "module:attr", from code or the environment
_loaded: dict[str, StorageFactory] = {}  # imported factories, by protocol


def _reference(factory: StorageFactory | str) -> str:
    """The import path "module:attr" of a factory, checked to lead back to it."""
    if isinstance(factory, str):
        module, sep, attr = factory.partition(":")
        if not sep or not module or not attr:
            raise ValueError(
                f"a factory given by name must look like 'module:attr', not {factory!r}"
            )
        return factory
    if not callable(factory):
        raise TypeError(f"the storage factory {factory!r} is not callable")
    where: str | None = getattr(factory, "__module__", None)
    qualname = getattr(factory, "__qualname__", None)
    ref = f"{where}:{qualname}"
    try:
        found = _import(ref) if where and where != "__main__" else None
    except (ImportError, AttributeError):
        found = None
    if found is not factory:
        raise ValueError(
            f"the storage factory {ref} cannot be imported by name, and the daemon process "
            "imports it by name: define it at the top level of an importable module (not "
            "__main__, not a lambda or local function), or register it by entry point"
        )
    return ref


def _import(ref: str) -> Any:
    module, _, attr = ref.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def register_storage(
    protocol: str, factory: StorageFactory | str, *, clobber: bool = False
) -> None:
    """Serve ``protocol://`` URLs with ``factory`` (a callable or "module:attr"), in this
    process and in the daemons it starts; refuses to replace one unless ``clobber``."""
    if not protocol or not protocol.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"bad protocol name {protocol!r}")
    ref = _reference(factory)
    with _lock:
        _read_environment()
        if protocol in _registered and _registered[protocol] != ref and not clobber:
            raise ValueError(f"a storage is already registered for {protocol!r}; pass clobber=True")
        _registered[protocol] = ref
        _loaded.pop(protocol, None)
        if not isinstance(factory, str):
            _loaded[protocol] = factory
        os.environ[ENV_VAR] = ";".join(f"{p}={r}" for p, r in sorted(_registered.items()))


def _read_environment() -> None:
    """Registrations inherited from the process that started this one (caller holds _lock)."""
    for item in filter(None, os.environ.get(ENV_VAR, "").split(";")):
        protocol, sep, ref = item.partition("=")
        if not sep or ":" not in ref:
            raise StorageError(f"malformed entry {item!r} in ${ENV_VAR}")
        _registered.setdefault(protocol, ref)


def registered_protocols() -> list[str]:
    """Protocols served by code registrations and installed entry points."""
    with _lock:
        _read_environment()
        names = set(_registered)
    names |= {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
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
        _read_environment()
        if protocol in _loaded:
            return _loaded[protocol]
        ref = _registered.get(protocol)
    where = f"the storage factory {ref} registered for {protocol}://"
    if ref is None:
        eps = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == protocol]
        if not eps:
            return None
        if len({ep.value for ep in eps}) > 1:
            values = ", ".join(sorted(ep.value for ep in eps))
            raise StorageError(f"several installed plugins serve {protocol}://: {values}")
        ref = eps[0].value
        where = f"the storage plugin for {protocol}:// ({ref})"
    try:
        factory = _import(ref)  # the plugin is imported here, on first use of its protocol
    except (ImportError, AttributeError) as e:
        raise StorageError(f"{where} failed to import: {type(e).__name__}: {e}") from e
    if not callable(factory):
        raise StorageError(f"{where} is not callable")
    with _lock:
        _loaded.setdefault(protocol, factory)
    return factory


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
