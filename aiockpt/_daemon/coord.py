"""Multi-rank commit: every rank's shard, then one manifest, or none at all.

Every rank's daemon writes its shard, then hands rank 0 its *part*: the shard's record, tensor
entries and tree as manifest-ready JSON text. Rank 0's daemon waits for every part, splices
them into one manifest and writes it: the commit. After its retention pass it tells the other
ranks, which resolve then, so ``steps()`` is exact on every rank when its handle resolves. A
daemon whose save fails publishes a *failure* notice; rank 0 answers any notice, a deadline,
or ranks that disagree on a DTensor with an *abort*, and no manifest is written.

The signals travel through the job's c10d store where the process group has one, else through
small files in the step directory (:mod:`.rendezvous`). Not through a gloo group of the daemons'
own: nothing to rendezvous (no ports to probe, no MASTER_PORT inherited from the trainer to
collide with), nothing that outlives the trainers' process group, and a dead peer costs a
bounded wait instead of a hung collective. Every signal is named by the save's uuid, agreed by
all ranks in ``save()``, so a retried step never sees a stale one.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

from .._core import dtable
from .._core import format as fmt
from .._core.catalog import publish_manifest
from .._core.storeops import StoreTimeout, StoreUnreachable
from ..errors import DistributedSaveError
from .rendezvous import Part, Rendezvous, StorageRendezvous

__all__ = ["Coordinator", "Fence", "Part", "merge", "no_fence", "publish_manifest"]


def merge(
    parts: list[Part],
    *,
    step: int,
    created_at: float,
    metrics: dict[str, Any],
    metadata: dict[str, Any],
) -> bytes:
    """The manifest of all ranks' parts: string splicing, linear in the number of ranks, and
    the merge of their distributed-tensor entries (raises dtable.Disagreement)."""
    parts = sorted(parts, key=lambda p: p.rank)
    tensors = ",".join(f"{json.dumps(p.shard['file'])}:{p.tensors_json}" for p in parts)
    trees = ",".join(f'"{p.rank}":{p.tree_json}' for p in parts)
    dtensors = dtable.merge([(p.shard["file"], p.dtensors_json) for p in parts])
    return fmt.manifest_json(
        step=step,
        created_at=created_at,
        world_size=len(parts),
        shards=[p.shard for p in parts],
        tensors_json="{" + tensors + "}",
        trees_json="{" + trees + "}",
        metrics=metrics,
        metadata=metadata,
        dtensors_json=dtensors,
        version=fmt.NAMES_VERSION,  # every shard file is named by its attempt
    )


#: Raises LeaseLostError unless this writer still holds its root's lease, before the action
#: it names (see lease.LeaseKeeper.check).
Fence = Callable[[str], None]


def no_fence(what: str) -> None:
    """The fence of a daemon that holds no lease (a read-only manager, a rank other than 0)."""


class Coordinator:
    """The daemon's side of a multi-rank commit; ``via`` carries its signals (by default,
    files in the step directory)."""

    def __init__(
        self,
        storage: Any,
        rank: int,
        world_size: int,
        timeout: float,
        fence: Fence = no_fence,
        via: Rendezvous | None = None,
    ) -> None:
        self.storage = storage
        self.fence = fence
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.via = via or StorageRendezvous(storage, rank, world_size, timeout)

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
        """Publish this rank's part and return the commit time once the manifest is written
        (``replacing``: over a committed step's, atomically: ``save(overwrite=True)``)."""
        deadline = time.monotonic() + self.timeout
        with self._store_failures(step):
            if self.rank != 0:
                self.via.post(step, uuid, part)
                # Rank 0's deadline runs from its own start: its word on a late rank (naming
                # that rank) comes first, unless rank 0 itself is gone.
                self.via.outcome(step, uuid, deadline + min(self.timeout, 5.0))
                return time.time()
            parts = self.via.gather(step, uuid, deadline)
            created_at = time.time()
            try:
                manifest = merge(
                    [part, *parts],
                    step=step,
                    created_at=created_at,
                    metrics=metrics,
                    metadata=metadata,
                )
            except dtable.Disagreement as e:
                ranks = list(range(self.world_size))
                self.via.abort(step, uuid, ranks, f"step {step}: {e}")
                raise DistributedSaveError(f"step {step}: {e}", ranks=ranks) from None
            self.fence(f"{'replace' if replacing else 'commit'} step {step}")
            path = f"{fmt.step_dirname(step)}/{fmt.MANIFEST}"
            if replacing:
                self.storage.put_atomic(path, manifest)
            else:
                publish_manifest(self.storage, path, manifest, step)
            self.via.committed(step, uuid)
            return created_at

    def finished(self, step: int, uuid: str) -> None:
        """Rank 0: the commit and its retention pass are over; the other ranks may resolve."""
        with self._store_failures(step):
            self.via.finished(step, uuid)

    def publish_failure(self, step: int, uuid: str, message: str) -> None:
        """Tell the other ranks this rank's part of the save failed."""
        with self._store_failures(step):
            self.via.publish_failure(step, uuid, message)

    @contextlib.contextmanager
    def _store_failures(self, step: int) -> Iterator[None]:
        """The job's store gone (or the trainer relaying it): the save fails on this rank,
        and on the others as they find the store gone or their deadline passed."""
        try:
            yield
        except (StoreUnreachable, StoreTimeout) as e:
            ranks = list(range(self.world_size))
            raise DistributedSaveError(
                f"step {step}: the ranks could not agree through the job's store: {e}",
                ranks=ranks,
            ) from None
