"""The local tier's commit on several ranks (see docs/tiers.md): the tier's manifest
committed on every host, each host's ranks waiting for their host's commit."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._core.catalog import manifest_path
from .._core.protocol import Hello
from .._core.storeops import StoreOps
from ..errors import CheckpointError
from ..storage import Storage
from .coord import Coordinator, Part, publish_manifest
from .peers import Peers
from .rendezvous import StoreRendezvous

if TYPE_CHECKING:
    from .server import Daemon

__all__ = ["HostCoordinator", "local_coordinator"]


class HostCoordinator(Coordinator):
    """The local tier's commit on several hosts: rank 0 merges every rank's part into the
    manifest, as for the root, and commits it in its host's tier; it hands the manifest to
    the first rank of each other host through the job's store, and that rank commits it in
    its own host's tier once every shard of the step is durable (rank 0's word says so), then
    says so to the other ranks of its host, whose saves end then. So each host's tier holds
    the full manifest and the shards written on that host, and a save that has ended on a
    rank is listed there."""

    def __init__(self, storage: Storage, cfg: Hello, ops: StoreOps, timeout: float) -> None:
        via = StoreRendezvous(ops, storage, cfg.rank, cfg.world_size, timeout)
        super().__init__(storage, cfg.rank, cfg.world_size, timeout, via=via)
        self.ops = ops
        hosts = cfg.hosts or ("",) * cfg.world_size
        #: The first rank of this rank's host, and of every host.
        self.leader = hosts.index(hosts[cfg.rank])
        self.leaders = sorted({hosts.index(h) for h in hosts})
        self._last: list[str] = []  # the keys of the last save, rank 0's to delete
        #: The copies of this rank's shards to other hosts' tiers, where asked for.
        self.peers: Peers | None = None

    def commit(
        self,
        *,
        step: int,
        uuid: str,
        part: Part,
        metrics: dict[str, Any],
        metadata: dict[str, Any],
        replacing: bool = False,
    ) -> float:
        if self.peers is not None:  # before its part: no save ends before its replicas are in
            self.peers.replicate(step, part.shard["file"], part.shard["crc32c"])
        created_at = super().commit(
            step=step,
            uuid=uuid,
            part=part,
            metrics=metrics,
            metadata=metadata,
            replacing=replacing,
        )
        key = StoreRendezvous.key(uuid, "manifest")
        path = manifest_path(step)
        with self._store_failures(step):
            if self.rank == 0:  # before its word that the save is over: the others read it then
                data = self.storage.read_range(path, 0, self.storage.size(path))
                self.ops.set_if_absent([key], data)
                self.ops.delete(self._last)  # every rank read them before its part of this one
                self._last = [key] + [self._host_key(uuid, r) for r in self.leaders[1:]]
            elif self.rank == self.leader:
                self._publish(step, uuid, key)
            elif self.leader != 0:
                self._hosted(step, uuid)
        return created_at

    @staticmethod
    def _host_key(uuid: str, leader: int) -> str:
        return StoreRendezvous.key(uuid, f"host{leader}")

    def _publish(self, step: int, uuid: str, key: str) -> None:
        """The first rank of a host but rank 0's: commit the manifest in this host's tier,
        and tell the host's other ranks how that went."""
        try:
            (data,) = self.ops.get([key])
            publish_manifest(self.storage, manifest_path(step), data, step)
        except BaseException as e:
            note = f"F{type(e).__name__}: {e}".encode()
            self.ops.set_if_absent([self._host_key(uuid, self.rank)], note)
            raise
        self.ops.set_if_absent([self._host_key(uuid, self.rank)], b"D")

    def _hosted(self, step: int, uuid: str) -> None:
        """Another rank of a host but rank 0's: wait for the host's commit."""
        key = self._host_key(uuid, self.leader)
        self.ops.wait([key], self.timeout)
        (said,) = self.ops.get([key])
        if said != b"D":
            raise CheckpointError(
                f"step {step}: rank {self.leader} could not commit this host's local tier: "
                f"{said[1:].decode(errors='replace')}"
            )


def local_coordinator(d: Daemon, storage: Storage) -> Coordinator | None:
    """The local tier's multi-rank commit, through the job's store where the root's goes
    through it (its keys apart, by the uuid's suffix), else through files in the tier (one
    host only: the files must be seen by every rank)."""
    cfg = d.cfg
    if cfg.world_size == 1:
        return None
    assert cfg.dist_timeout is not None
    if d.store_ops is not None:
        return HostCoordinator(storage, cfg, d.store_ops, cfg.dist_timeout)
    if len(set(cfg.hosts)) > 1:
        raise CheckpointError(
            "a local tier on several hosts commits through the job's c10d store, and this "
            "process group has none"
        )
    return Coordinator(storage, cfg.rank, cfg.world_size, cfg.dist_timeout)
