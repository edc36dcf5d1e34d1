"""The retention pass: after each commit, delete what the policy lets go.

The pass keeps an index of the committed steps' records (commit time and metrics), filled
from storage by the first pass and then kept up to date by the commits and deletions of this
daemon, so a pass after the first reads no manifest. In a multi-rank save only rank 0 runs it.
"""

from __future__ import annotations

import threading

from .._core.catalog import Catalog
from .._core.pruning import plan_prune
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidStepError,
    LeaseLostError,
    StepExistsError,
)
from ..retention import CheckpointRecord, RetentionPolicy
from .coord import Fence, no_fence
from .pipe import Outbox, remote_error
from .shared import InFlight


class Pruner:
    """Applies one retention policy to a root, through its catalog. ``policy`` None keeps
    everything (and so does a rank other than 0, which is given None)."""

    def __init__(
        self,
        catalog: Catalog,
        policy: RetentionPolicy | None,
        in_flight: InFlight,
        outbox: Outbox,
        fence: Fence = no_fence,
    ) -> None:
        self.catalog = catalog
        self.fence = fence
        self.policy = policy
        self.in_flight = in_flight
        self.outbox = outbox
        #: Records of the committed steps; filled by the first pass.
        self.index: dict[int, CheckpointRecord] = {}
        self.indexed = False
        self._lock = threading.Lock()  # guards index

    def committed(self, record: CheckpointRecord) -> None:
        """This daemon committed ``record.step``."""
        with self._lock:
            self.index[record.step] = record

    def scan_index(self) -> None:
        """What retention sees of earlier runs: every committed checkpoint whose record reads.
        Done by the first pass, not at start-up: a run may hold hundreds of checkpoints, and
        a manager must open without reading each one."""
        for step in self.catalog.committed_steps():
            if step in self.index:
                continue
            try:
                record = self.catalog.read_record(step)
            except CorruptCheckpointError:
                continue
            with self._lock:
                self.index.setdefault(step, record)
        self.indexed = True

    def apply(self, uuid: str, step: int) -> tuple[list[int], BaseException | None]:
        """Delete what the policy lets go, manifest first: the steps deleted, and the error
        (ready for the pipe) that stopped the pass, if one did. Runs only after the commit of
        ``step``, which it never deletes (nor the newest step, nor one in flight)."""
        if self.policy is None:
            return [], None
        try:
            if not self.indexed:
                self.scan_index()
            # Steps deleted behind our back (``aiockpt prune``) must not count for the policy.
            # A stale listing can only hide steps, and a hidden step is never deleted.
            present = set(self.catalog.listed_steps())
        except Exception as e:
            err = CheckpointError(
                f"step {step} was committed, but retention could not list "
                f"{self.catalog.storage.url}: {e}; nothing was deleted"
            )
            return [], remote_error(err)
        with self._lock:
            for gone in [s for s in self.index if s not in present and s != step]:
                del self.index[gone]
            records = list(self.index.values())
        protected = {step, *self.in_flight.snapshot()}
        try:
            doomed = plan_prune(self.policy, records, protected=protected).doomed
        except Exception as e:
            err = CheckpointError(
                f"step {step} was committed, but the retention policy {self.policy!r} failed: "
                f"{type(e).__name__}: {e}; nothing was deleted"
            )
            return [], remote_error(err)
        return self._delete(uuid, step, doomed)

    def _delete(
        self, uuid: str, step: int, doomed: list[int]
    ) -> tuple[list[int], BaseException | None]:
        deleted: list[int] = []

        def uncommitted(old: int) -> None:
            # No longer a checkpoint, whatever becomes of its files: reported as deleted.
            with self._lock:
                self.index.pop(old, None)
            deleted.append(old)

        try:
            for old in doomed:
                self.fence(f"delete step {old}")  # a writer fenced off stops deleting at once
                self.catalog.delete_step(old, uncommitted=uncommitted)
                self.outbox.event("retention.delete", uuid, old, where="daemon")
        except LeaseLostError as e:
            return deleted, remote_error(e)
        except Exception as e:  # whatever it is, the commit stands and the caller must hear it
            err = CheckpointError(f"step {step} was committed, but retention failed to delete: {e}")
            return deleted, remote_error(err)
        return deleted, None

    def delete(self, step: int, allow_latest: bool) -> None:
        """``delete(step)`` asked by the trainer: the committed ``step`` deleted as retention
        deletes (manifest first, the bytes a kept step reads kept), on the writer's thread,
        so after every save queued before it. Refuses a step that is not committed, one
        being saved and, unless ``allow_latest``, the newest committed step."""
        self.fence(f"delete step {step}")
        committed = self.catalog.committed_steps()
        where = self.catalog.storage.url
        if step not in committed:
            raise CheckpointNotFoundError(f"step {step} is not a committed checkpoint in {where}")
        if step in self.in_flight.snapshot():
            raise StepExistsError(f"step {step} is being saved")
        if step == committed[-1] and not allow_latest:
            raise InvalidStepError(
                f"step {step} is the newest committed checkpoint in {where}, which a resume "
                "loads; pass allow_latest=True to delete it"
            )

        def uncommitted(old: int) -> None:
            with self._lock:
                self.index.pop(old, None)

        self.catalog.delete_step(step, uncommitted=uncommitted)
