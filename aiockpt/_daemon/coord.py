"""Multi-rank commit: the daemons agree through the checkpoint's own storage.

Every rank's daemon writes its shard, then a small *part* file next to it describing the shard
(its record, tensor entries and tree, as manifest-ready JSON text). Rank 0's daemon waits until
every part is there, splices them into one manifest and writes it: the commit. The other
daemons wait for that manifest. A daemon whose save fails writes a *failed* notice; rank 0
answers any notice, or a deadline, with an *abort* marker, and no manifest is written.

Why storage and not a gloo group of the daemons' own: nothing to rendezvous (no ports to probe,
no MASTER_PORT inherited from the trainer to collide with), nothing that outlives the trainers'
process group, and a dead peer costs a bounded wait instead of a hung collective. The files are
named by the save's uuid, agreed by all ranks in ``save()``, so a retried step never sees a
stale marker. They live in the step directory and start with a dot. Rank 0 removes the parts
after the commit and, once its retention pass is over, leaves an empty *done* marker: the
other ranks resolve on that, so ``steps()`` is exact on every rank when its handle resolves.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._core import dtable
from .._core import format as fmt
from .._core.blocks import needs_refs_version
from ..errors import DistributedSaveError, StepExistsError
from ..storage import Storage


@dataclass(frozen=True, slots=True)
class Part:
    """One rank's contribution to a manifest, as pre-encoded JSON text."""

    rank: int
    shard: dict[str, Any]
    tensors_json: str
    tree_json: str
    #: This rank's entries of the distributed-tensor table (dtable.rank_json), "" for none.
    dtensors_json: str = ""

    def encode(self) -> bytes:
        """The part file's bytes: a JSON head, then the three JSON texts as they are."""
        head = json.dumps(
            {
                "rank": self.rank,
                "shard": self.shard,
                "tensors": len(self.tensors_json),
                "tree": len(self.tree_json),
            }
        )
        return "\n".join((head, self.tensors_json, self.tree_json, self.dtensors_json)).encode()

    @classmethod
    def decode(cls, data: bytes) -> Part:
        """The part that :meth:`encode` wrote as ``data``."""
        head_text, rest = data.decode().split("\n", 1)
        head = json.loads(head_text)
        n, t = head["tensors"], head["tree"]
        tree_end = n + 1 + t
        return cls(
            head["rank"], head["shard"], rest[:n], rest[n + 1 : tree_end], rest[tree_end + 1 :]
        )


def part_name(uuid: str, rank: int) -> str:
    """The name of ``rank``'s part file of the save ``uuid``."""
    return f".{uuid}.r{rank:05d}.part"


def failed_name(uuid: str, rank: int) -> str:
    """The name of ``rank``'s notice that its part of the save ``uuid`` failed."""
    return f".{uuid}.r{rank:05d}.failed"


def abort_name(uuid: str) -> str:
    """The name of rank 0's marker that the save ``uuid`` is abandoned."""
    return f".{uuid}.abort"


def done_name(uuid: str) -> str:
    """The name of rank 0's marker that the save ``uuid`` and its retention pass are over."""
    return f".{uuid}.done"


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
    version = max(fmt.tree_version(p.tree_json) for p in parts)
    if any(needs_refs_version(p.shard) for p in parts):
        version = fmt.REFS_VERSION
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
        version=max(version, fmt.VERSION if dtensors is None else fmt.DTENSOR_VERSION),
    )


#: Raises LeaseLostError unless this writer still holds its root's lease, before the action
#: it names (see lease.LeaseKeeper.check).
Fence = Callable[[str], None]


def no_fence(what: str) -> None:
    """The fence of a daemon that holds no lease (a read-only manager, a rank other than 0)."""


def publish_manifest(storage: Storage, path: str, manifest: bytes, step: int) -> None:
    """Commit: create the manifest, conditionally where the storage can (so of two writers
    committing one step, one wins and the other hears StepExistsError)."""
    put_if_absent = getattr(storage, "put_if_absent", None)
    if put_if_absent is None:
        storage.put_atomic(path, manifest)
    elif not put_if_absent(path, manifest):
        raise StepExistsError(
            f"step {step} was committed in {storage.url} by another writer while this save "
            "ran; this save's shard was left in place"
        )


class Coordinator:
    """The daemon's side of a multi-rank commit."""

    def __init__(
        self, storage: Any, rank: int, world_size: int, timeout: float, fence: Fence = no_fence
    ) -> None:
        self.storage = storage
        self.fence = fence
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout

    @staticmethod
    def _poll(check: Any, deadline: float) -> Any:
        """Call ``check`` with backoff until it answers; TimeoutError at the deadline."""
        delay = 0.002
        while True:
            result = check()
            if result is not None:
                return result
            if time.monotonic() > deadline:
                raise TimeoutError
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def commit(
        self,
        *,
        step: int,
        uuid: str,
        part: Part,
        metrics: dict[str, Any],
        metadata: dict[str, Any],
    ) -> float:
        """Publish this rank's part and return the commit time once the manifest is written."""
        step_dir = fmt.step_dirname(step)
        deadline = time.monotonic() + self.timeout
        if self.rank != 0:
            self.storage.put_atomic(f"{step_dir}/{part_name(uuid, self.rank)}", part.encode())
            return self._await_commit(step, uuid, deadline)
        parts = self._gather(step, uuid, deadline)
        created_at = time.time()
        try:
            manifest = merge(
                [part, *parts], step=step, created_at=created_at, metrics=metrics, metadata=metadata
            )
        except dtable.Disagreement as e:
            ranks = list(range(self.world_size))
            self.abort(step, uuid, ranks, f"step {step}: {e}")
            raise DistributedSaveError(f"step {step}: {e}", ranks=ranks) from None
        self.fence(f"commit step {step}")
        publish_manifest(self.storage, f"{step_dir}/{fmt.MANIFEST}", manifest, step)
        for r in range(1, self.world_size):
            self.storage.delete(f"{step_dir}/{part_name(uuid, r)}")
        return created_at

    def _gather(self, step: int, uuid: str, deadline: float) -> list[Part]:
        step_dir = fmt.step_dirname(step)
        wanted = {part_name(uuid, r): r for r in range(1, self.world_size)}
        failed = {failed_name(uuid, r): r for r in range(self.world_size)}

        def check():
            names = set(self.storage.list_dir(step_dir))
            bad = sorted(r for n, r in failed.items() if n in names)
            if bad:
                return ("failed", bad)
            if names.issuperset(wanted):
                return ("ok", None)
            return None

        try:
            state, bad = self._poll(check, deadline)
        except TimeoutError:
            names = set(self.storage.list_dir(step_dir))
            missing = sorted(r for n, r in wanted.items() if n not in names)
            msg = (
                f"step {step}: rank(s) {missing} did not finish their shard within {self.timeout} s"
            )
            self.abort(step, uuid, missing, msg)
            raise DistributedSaveError(msg, ranks=missing) from None
        if state == "failed":
            reasons = {r: self._read_text(f"{step_dir}/{failed_name(uuid, r)}") for r in bad}
            msg = f"step {step}: the save failed on rank(s) {bad}: " + "; ".join(
                f"rank {r}: {why}" for r, why in reasons.items()
            )
            self.abort(step, uuid, bad, msg)
            raise DistributedSaveError(msg, ranks=bad)
        return [Part.decode(self._read(f"{step_dir}/{n}")) for n in wanted]

    def finished(self, step: int, uuid: str) -> None:
        """Rank 0: the commit and its retention pass are over; the other ranks may resolve."""
        self.storage.put_atomic(f"{fmt.step_dirname(step)}/{done_name(uuid)}", b"")

    def _await_commit(self, step: int, uuid: str, deadline: float) -> float:
        step_dir = fmt.step_dirname(step)
        manifest = f"{step_dir}/{fmt.MANIFEST}"
        done = f"{step_dir}/{done_name(uuid)}"
        abort = f"{step_dir}/{abort_name(uuid)}"

        def check():
            # Waiting for rank 0's "done" rather than the manifest makes steps() exact on
            # every rank once its handle resolves: retention has run by then.
            if self.storage.exists(done):
                return ("ok", None)
            if self.storage.exists(abort):
                return ("abort", json.loads(self._read_text(abort)))
            return None

        try:
            state, body = self._poll(check, deadline)
        except TimeoutError:
            if self.storage.exists(manifest):
                return time.time()  # committed; rank 0 died before its retention pass ended
            msg = f"step {step}: rank 0 did not commit within {self.timeout} s"
            raise DistributedSaveError(msg, ranks=[0]) from None
        if state == "abort":
            raise DistributedSaveError(body["message"], ranks=body["ranks"])
        return time.time()

    def abort(self, step: int, uuid: str, ranks: list[int], message: str) -> None:
        """Rank 0: abandon the save, naming the ranks at fault; every waiting rank fails."""
        body = json.dumps({"ranks": ranks, "message": message}).encode()
        self.storage.put_atomic(f"{fmt.step_dirname(step)}/{abort_name(uuid)}", body)

    def publish_failure(self, step: int, uuid: str, message: str) -> None:
        """Tell the other ranks this rank's part of the save failed."""
        step_dir = fmt.step_dirname(step)
        self.storage.makedirs(step_dir)
        if self.rank == 0:
            why = f"step {step}: the save failed on rank(s) [0]: rank 0: {message}"
            self.abort(step, uuid, [0], why)
        else:
            self.storage.put_atomic(f"{step_dir}/{failed_name(uuid, self.rank)}", message.encode())

    def _read(self, path: str) -> bytes:
        return self.storage.read_range(path, 0, self.storage.size(path))

    def _read_text(self, path: str) -> str:
        size = min(self.storage.size(path), 1 << 20)
        return self.storage.read_range(path, 0, size).decode(errors="replace")
