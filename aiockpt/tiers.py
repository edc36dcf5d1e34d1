"""A local tier: every save committed to a directory on each host, the root less often.

``AsyncCheckpointManager(root, local=LocalTier(path, keep=2), persist_every=10)`` commits
every save to ``path`` (an aiockpt root of its own on local disk, with the same manifest-last
rule and checksums as the root) and every 10th step to the root as well. See docs/tiers.md.

Shared, pure code: the trainer checks it, the daemon and the CLI read it; no torch here.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

__all__ = ["HOST_ID_ENV", "LocalTier", "host_id", "leads_host", "machine_id"]

#: The environment variable that names this host, where set (tests simulate hosts with it).
HOST_ID_ENV = "AIOCKPT_HOST_ID"

#: Where Linux keeps the id of the current boot: a host that rebooted is a new host.
_BOOT_ID = "/proc/sys/kernel/random/boot_id"
#: Where systemd (and dbus) keep the id of the installation.
_MACHINE_IDS = ("/etc/machine-id", "/var/lib/dbus/machine-id")


@dataclass(frozen=True, slots=True, init=False)
class LocalTier:
    """A directory on local disk (NVMe, or a tmpfs) on each host where every save lands.

    ``keep``: the committed steps kept there per host (the oldest goes when a save commits,
    so there are at most ``keep + 1`` right after one). ``replicas``: the ranks on *other*
    hosts that also hold a copy of each rank's shard (0: none, for one process or one host).
    The ranks of one host share the directory; an existing empty directory is a new tier.
    ``path`` may be a URL whose registered storage is a local directory (a
    :class:`~aiockpt.storage.LocalStorage`); the daemon refuses any other as it opens.
    """

    path: str
    keep: int
    replicas: int

    def __init__(self, path: str | os.PathLike[str], *, keep: int = 2, replicas: int = 0) -> None:
        text = os.fspath(path)
        if not isinstance(text, str) or not text:
            raise ValueError(f"a local tier's path must be a non-empty path, not {path!r}")
        _count("keep", keep, 1)
        _count("replicas", replicas, 0)
        object.__setattr__(self, "path", _where(text))
        object.__setattr__(self, "keep", keep)
        object.__setattr__(self, "replicas", replicas)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_make, (self.path, self.keep, self.replicas))


def _make(path: str, keep: int, replicas: int) -> LocalTier:
    return LocalTier(path, keep=keep, replicas=replicas)


def _where(text: str) -> str:
    """A path made absolute; a URL kept as it is where a storage registered with aiockpt
    serves its protocol (the daemon checks, as it opens the tier, that this storage is a
    local directory); any other URL refused."""
    protocol, sep, rest = text.partition("://")
    if not sep:
        return os.path.abspath(text)
    if protocol in ("file", "local"):
        return os.path.abspath(rest)
    from .storage import registered_protocols

    if protocol not in registered_protocols():
        raise ValueError(
            f"a local tier is a local directory, not a URL: {text!r} (a URL is taken only "
            "where a storage registered with aiockpt serves it from a local directory)"
        )
    return text


def _count(name: str, value: object, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"LocalTier's {name} must be an int of at least {least}, not {value!r}")


def leads_host(hosts: tuple[str, ...], rank: int) -> bool:
    """Whether ``rank`` is the first rank of its host (``hosts``: each rank's, by rank; empty
    for one process): the one that commits, prunes and cleans its host's tier."""
    if not hosts:
        return rank == 0
    return hosts.index(hosts[rank]) == rank


def host_id() -> str:
    """This host's identity: ``$AIOCKPT_HOST_ID`` where set, else the hostname and the boot
    id (a rebooted host is a new one, its tmpfs gone). Never the local rank or world size:
    those say nothing of which ranks share a disk."""
    env = os.environ.get(HOST_ID_ENV)
    if env:
        return env
    boot = _read_first((_BOOT_ID,))
    name = socket.gethostname()
    return f"{name}/{boot}" if boot else name


def machine_id() -> str:
    """What tells this machine from another, whatever ``$AIOCKPT_HOST_ID`` says: the
    installation's machine id and the current boot's id (two processes that share a disk
    see the same ones). Ranks that give the same host id must give the same machine id."""
    parts = [_read_first(_MACHINE_IDS), _read_first((_BOOT_ID,))]
    return "/".join(parts)


def _read_first(paths: tuple[str, ...]) -> str:
    for path in paths:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text:
            return text
    return ""
