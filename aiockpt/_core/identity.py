"""A root's identity, and the secret of its peer network (see docs/format.md, "The root's
identity").

A root gets a random id at its first writable open: ``_root.json``, created once and never
replaced. Whatever refers to a root (a local tier, a Lightning pointer file, a peer's replica)
records that id and is matched by it, never by the spelling of the root's path or URL: two
spellings of one directory are one root, two roots of one name (a directory removed and made
again) are two. The same open writes ``_peer.key``, 32 random bytes that the daemons of a job
with peer replicas authenticate each other with (``_daemon/peers.py``): whoever can read the
root holds it, and nobody else. On a local disk it is readable by its owner alone.

Both are written by the holder of the root's lease, so no two writers race for them; where
the storage can create a file conditionally, the one there wins anyway.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from ..errors import CorruptCheckpointError, StorageError
from ..storage import Storage

__all__ = ["KEY_FILE", "ROOT_FILE", "claim_root", "read_peer_key", "read_root_id"]

#: The root's identity: ``{"format": "aiockpt-root", "id": <32 hex digits>}``.
ROOT_FILE = "_root.json"
#: The peer network's secret: 32 random bytes, mode 0600 on a local disk.
KEY_FILE = "_peer.key"
KEY_BYTES = 32

_ID = re.compile(r"[0-9a-f]{32}")
_FORMAT = "aiockpt-root"
#: Larger than any identity file aiockpt writes: a bigger one is not read.
_MAX_BYTES = 4096


def new_id() -> str:
    """A fresh random id: 128 bits, as 32 lowercase hex digits."""
    return secrets.token_hex(16)


def is_id(value: Any) -> bool:
    return isinstance(value, str) and _ID.fullmatch(value) is not None


def read_root_id(storage: Storage) -> str | None:
    """The id of the root ``storage`` serves, or None where it has none yet (a root never
    opened for writing since ids were introduced, or no root at all). A file that is there
    but is not an identity is a :class:`CorruptCheckpointError`."""
    if not storage.exists(ROOT_FILE):
        return None
    return parse_root_file(_read_small(storage, ROOT_FILE), _where(storage, ROOT_FILE))


def parse_root_file(data: bytes, where: str) -> str:
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptCheckpointError(f"{where}: not JSON: {e}", path=where) from None
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT or not is_id(doc.get("id")):
        raise CorruptCheckpointError(
            f"{where}: not an aiockpt root identity (a JSON object with format "
            f'"{_FORMAT}" and a 32-hex-digit id)',
            path=where,
        )
    return str(doc["id"])


def root_file(root_id: str) -> bytes:
    return json.dumps({"format": _FORMAT, "id": root_id}).encode()


def claim_root(storage: Storage) -> str:
    """The root's id, made at its first writable open (and at the next writable open of a
    root older than ids), with its peer key; called by the lease's holder."""
    root_id = read_root_id(storage)
    if root_id is None:
        _create(storage, ROOT_FILE, root_file(new_id()))
        root_id = read_root_id(storage)  # the winner's, had another writer raced us
        assert root_id is not None
    if not storage.exists(KEY_FILE):
        _create(storage, KEY_FILE, secrets.token_bytes(KEY_BYTES), private=True)
    return root_id


def read_peer_key(storage: Storage) -> bytes:
    """The root's peer key; a :class:`StorageError` where it has none or it is not one."""
    where = _where(storage, KEY_FILE)
    if not storage.exists(KEY_FILE):
        raise StorageError(
            f"{where} does not exist: the root has no peer key (it is written at the root's "
            "writable open)",
            path=where,
        )
    key = _read_small(storage, KEY_FILE)
    if len(key) != KEY_BYTES:
        raise StorageError(f"{where}: a peer key of {len(key)} bytes, not {KEY_BYTES}")
    return key


def _read_small(storage: Storage, path: str) -> bytes:
    size = storage.size(path)
    if size > _MAX_BYTES:
        where = _where(storage, path)
        raise CorruptCheckpointError(f"{where}: {size} bytes, too large to be read", path=where)
    return storage.read_range(path, 0, size)


def _create(storage: Storage, path: str, data: bytes, *, private: bool = False) -> None:
    """Create ``path`` unless something is there (then leave it as it is)."""
    put = getattr(storage, "put_if_absent", None)
    if put is None:
        if not storage.exists(path):
            storage.put_atomic(path, data)
    elif private and _is_local(storage):
        put(path, data, mode=0o600)
    else:
        put(path, data)


def _is_local(storage: Storage) -> bool:
    from ..storage._local import LocalStorage

    inner = getattr(storage, "inner", storage)  # a CountingStorage's
    return isinstance(inner, LocalStorage)


def _where(storage: Storage, path: str) -> str:
    return f"{storage.url.rstrip('/')}/{path}"
