"""What every command shares: its two errors, and a root's committed steps as it reads them
(through :class:`~aiockpt._core.catalog.Catalog`, as the daemon does)."""

from __future__ import annotations

import argparse
import errno
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._core import format as fmt
from .._core.catalog import Catalog
from ..errors import CheckpointError, StorageError
from ..storage import open_storage
from ..storage._registry import PLUGIN_HINTS, registered_protocols, split_protocol
from .output import plural

#: The step argument that names the newest committed step.
LATEST = "latest"


class UsageError(Exception):
    """A mistake of the user's: reported in one line on stderr, exit code 2."""


class Failure(Exception):
    """The storage failed (an outage, missing credentials) or a checkpoint is unreadable:
    reported in one line on stderr, exit code 1."""


@dataclass(slots=True)
class Entry:
    """A committed step directory: its manifest, or why it could not be read."""

    step: int
    manifest: fmt.Manifest | None = None
    error: str | None = None

    @property
    def dirname(self) -> str:
        """The step directory's name."""
        return fmt.step_dirname(self.step)


@dataclass(slots=True)
class Root:
    """What a scan found in a root, named by ``url`` as the user gave it."""

    catalog: Catalog
    url: str
    committed: list[Entry]
    partials: list[int]

    def where(self, path: str = "") -> str:
        """The URL of ``path`` under the root as the user named it (the root when empty)."""
        base = self.url.rstrip("/")
        return f"{base}/{path}" if path else base


def open_root(url: str, options: dict[str, Any]) -> Catalog:
    """The catalog of the root at ``url``; a root that cannot be opened is a usage error."""
    try:
        return Catalog(open_storage(url, options))
    except CheckpointError as e:
        if served(url):  # the storage failed, or found no credentials
            raise Failure(f"cannot open {url}: {e}") from None
        raise UsageError(f"cannot open {url}: {e}") from None  # no storage for the URL
    except (ValueError, TypeError, ImportError) as e:
        raise UsageError(f"cannot open {url}: {e}") from None


def served(url: str) -> bool:
    """Whether a storage serves ``url``'s protocol: local paths, a registered storage or an
    installed plugin, and fsspec's protocols but those that need an aiockpt plugin."""
    protocol = split_protocol(url)[0]
    if protocol == "file" or protocol in registered_protocols():
        return True
    import fsspec

    return protocol not in PLUGIN_HINTS and protocol in fsspec.available_protocols()


def scan(
    catalog: Catalog, url: str, *, steps: Sequence[int] | None = None, heads: bool = False
) -> Root:
    """The step directories of a root; manifests are read for ``steps`` (all when None),
    only their heads with ``heads`` (a listing: see Catalog.read_head)."""
    try:
        listed = catalog.listed_steps()
    except CheckpointError as e:
        if isinstance(e, StorageError) and e.errno == errno.ENOTDIR:  # a file, not a root
            raise UsageError(f"cannot list {url}: {e}") from None
        raise Failure(f"cannot list {url}: {e}") from None
    committed: list[Entry] = []
    partials: list[int] = []
    for step in listed:
        if not catalog.is_committed(step):
            partials.append(step)
            continue
        entry = Entry(step)
        if steps is None or step in steps:
            read_entry(catalog, entry, head=heads)
        committed.append(entry)
    return Root(catalog, url, committed, partials)


def read_entry(catalog: Catalog, entry: Entry, *, head: bool = False) -> None:
    """Read the entry's manifest (its head alone with ``head``), or why it cannot be read."""
    try:
        entry.manifest = (
            catalog.read_head(entry.step) if head else catalog.read_manifest(entry.step)
        )
    except CheckpointError as e:  # corrupt, or gone since it was listed
        entry.error = str(e)


def no_checkpoints(root: Root) -> str:
    """The line that says a root holds no committed checkpoint (and how many partials)."""
    extra = f" ({plural(len(root.partials), 'partial step dir')})" if root.partials else ""
    return f"no checkpoints in {root.url}{extra}"


def require_exists(root: Root) -> None:
    """A usage error when the root is not there (most likely a typo), as its storage says: a
    local directory that is not there, a prefix with nothing under it on an object store. A
    root with step directories exists, whatever the storage says of directories."""
    if not root.committed and not root.partials and not root.catalog.storage.exists(""):
        raise UsageError(f"{root.url} does not exist")


def require_checkpoints(root: Root) -> None:
    """A usage error unless the root holds a committed checkpoint: one that says the root
    does not exist, when it does not."""
    if not root.committed:
        require_exists(root)
        raise UsageError(no_checkpoints(root))


def require_step(root: Root, step: int) -> Entry:
    """The entry of ``step``; a usage error, naming what is committed, when it is not."""
    for entry in root.committed:
        if entry.step == step:
            return entry
    steps = [e.step for e in root.committed]
    shown = ", ".join(map(str, steps[-10:]))
    partial = " (its directory is a partial save)" if step in root.partials else ""
    raise UsageError(
        f"step {step} is not a committed checkpoint in {root.url}{partial}; committed: "
        f"{shown if len(steps) <= 10 else '…, ' + shown}"
    )


def show_entry(args: argparse.Namespace) -> tuple[Root, Entry]:
    """The root and the entry a command of one step (``show``, ``export``, ``copy``, and
    ``verify`` of one) asks for, its manifest read (``latest``: the newest committed step)."""
    catalog = open_root(args.root, args.storage_options)
    if args.step != LATEST:
        root = scan(catalog, args.root, steps=[args.step])
        require_checkpoints(root)
        return root, require_step(root, args.step)
    root = scan(catalog, args.root, steps=[])  # one manifest is read, once the newest is known
    require_checkpoints(root)
    entry = root.committed[-1]
    read_entry(catalog, entry)
    return root, entry
