"""How the ranks of a multi-rank save tell each other what happened: the signals of a commit.

A commit needs four signals (see :mod:`.coord`): rank r's *part* (its shard's manifest text)
or its *failure* reaches rank 0; rank 0's *outcome* (done, or abort naming the ranks at
fault) reaches every rank. Two ways carry them:

- :class:`StoreRendezvous`, whenever the process group has a c10d store (torchrun's TCPStore,
  a FileStore): the signals are keys of that store, and every wait is the store's own
  blocking wait, so storage sees nothing but each rank's shard, rank 0's manifest and its
  retention pass, however long the slowest rank takes and however many ranks there are.
- :class:`StorageRendezvous`, where no store exists: small files in the step directory,
  polled with backoff.

Both fail a save the same way: every rank raises DistributedSaveError naming the ranks at
fault, and no manifest is written.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .._core import format as fmt
from .._core.storeops import StoreOps, StoreTimeout
from ..errors import DistributedSaveError
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
        """The part's bytes: a JSON head, then the three JSON texts as they are."""
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


class Rendezvous(Protocol):
    """The signals of one rank's commits. ``deadline`` is a time.monotonic() value."""

    def post(self, step: int, uuid: str, part: Part) -> None:
        """Rank r > 0: hand this rank's part to rank 0."""
        ...

    def outcome(self, step: int, uuid: str, deadline: float) -> None:
        """Rank r > 0: return once rank 0 says the save is committed and its retention pass
        over; DistributedSaveError when it says abort, or at the deadline."""
        ...

    def gather(self, step: int, uuid: str, deadline: float) -> list[Part]:
        """Rank 0: every other rank's part. On a failure notice or at the deadline: abort
        (naming the ranks at fault) and raise DistributedSaveError."""
        ...

    def committed(self, step: int, uuid: str) -> None:
        """Rank 0: the manifest is written; drop what the gather left behind."""
        ...

    def finished(self, step: int, uuid: str) -> None:
        """Rank 0: the commit and its retention pass are over; the others may resolve."""
        ...

    def abort(self, step: int, uuid: str, ranks: list[int], message: str) -> None:
        """Rank 0: abandon the save; every waiting rank fails with ``message``."""
        ...

    def publish_failure(self, step: int, uuid: str, message: str) -> None:
        """Tell the other ranks this rank's part of the save failed."""
        ...


def _remaining(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.0)


def _failure_message(step: int, reasons: dict[int, str]) -> str:
    return f"step {step}: the save failed on rank(s) {sorted(reasons)}: " + "; ".join(
        f"rank {r}: {why}" for r, why in sorted(reasons.items())
    )


def _late_message(step: int, missing: list[int], timeout: float) -> str:
    return f"step {step}: rank(s) {missing} did not finish their shard within {timeout} s"


def _rank0_silent(step: int, timeout: float) -> DistributedSaveError:
    return DistributedSaveError(f"step {step}: rank 0 did not commit within {timeout} s", ranks=[0])


# --------------------------------------------------------------------------- the job's store

_PART, _FAILED, _DONE, _ABORT = b"P", b"F", b"D", b"A"


class StoreRendezvous:
    """Signals as keys of the job's c10d store, under ``aiockpt/<uuid>/``.

    Rank r > 0 sets its slot ``r<r>`` to its part, then waits for the key ``outcome``. Rank 0
    waits for every slot at once, reads them in one call and sets ``outcome``. A failing rank
    sets its own slot and every slot still empty to its failure notice (creating only what is
    absent, so no part is overwritten): rank 0's wait ends at once, and a rank that finds its
    slot taken knows the save is abandoned. The outcome too is only ever created, so the
    first word (the daemon's "done", or a failure published after its death) stands.

    Rank 0 deletes the slots once it has read them, and a save's outcome once the next save's
    parts are all in (every rank read it before sending its next part): the store holds at
    most two saves' keys.
    """

    def __init__(
        self, ops: StoreOps, storage: Storage, rank: int, world_size: int, timeout: float
    ) -> None:
        self.ops = ops
        self.storage = storage
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self._last_outcome: str | None = None

    @staticmethod
    def key(uuid: str, name: str) -> str:
        """The store key ``name`` of the save ``uuid``."""
        return f"aiockpt/{uuid}/{name}"

    def _slots(self, uuid: str) -> list[str]:
        return [self.key(uuid, f"r{r}") for r in range(1, self.world_size)]

    def post(self, step: int, uuid: str, part: Part) -> None:
        # A slot taken by a failing rank: the save is abandoned, and rank 0 will say so.
        self.ops.set_if_absent([self.key(uuid, f"r{self.rank}")], _PART + part.encode())

    def outcome(self, step: int, uuid: str, deadline: float) -> None:
        key = self.key(uuid, "outcome")
        try:
            self.ops.wait([key], _remaining(deadline))
        except StoreTimeout:
            if self.storage.exists(f"{fmt.step_dirname(step)}/{fmt.MANIFEST}"):
                return  # committed; rank 0 died before its retention pass ended
            raise _rank0_silent(step, self.timeout) from None
        (value,) = self.ops.get([key])
        if value != _DONE:
            body = json.loads(value[1:])
            raise DistributedSaveError(body["message"], ranks=body["ranks"])

    def gather(self, step: int, uuid: str, deadline: float) -> list[Part]:
        slots = self._slots(uuid)
        try:
            self.ops.wait(slots, _remaining(deadline))
        except StoreTimeout:
            there = self.ops.check(slots)
            missing = [r for r, ok in enumerate(there, start=1) if not ok]
            msg = _late_message(step, missing, self.timeout)
            self.abort(step, uuid, missing, msg)
            raise DistributedSaveError(msg, ranks=missing) from None
        parts, reasons = [], {}
        for value in self.ops.get(slots):
            if value[:1] == _PART:
                parts.append(Part.decode(value[1:]))
            else:
                notice = json.loads(value[1:])
                reasons[notice["rank"]] = notice["message"]
        if reasons:
            msg = _failure_message(step, reasons)
            self.abort(step, uuid, sorted(reasons), msg)
            raise DistributedSaveError(msg, ranks=sorted(reasons))
        return parts

    def committed(self, step: int, uuid: str) -> None:
        old = [self._last_outcome] if self._last_outcome is not None else []
        self.ops.delete(self._slots(uuid) + old)
        self._last_outcome = None

    def finished(self, step: int, uuid: str) -> None:
        self._say(uuid, _DONE)

    def abort(self, step: int, uuid: str, ranks: list[int], message: str) -> None:
        self._say(uuid, _ABORT + json.dumps({"ranks": ranks, "message": message}).encode())

    def _say(self, uuid: str, value: bytes) -> None:
        key = self.key(uuid, "outcome")
        self.ops.set_if_absent([key], value)
        self._last_outcome = key

    def publish_failure(self, step: int, uuid: str, message: str) -> None:
        if self.rank == 0:
            self.abort(step, uuid, [0], _failure_message(step, {0: message}))
            return
        notice = _FAILED + json.dumps({"rank": self.rank, "message": message}).encode()
        own = self.key(uuid, f"r{self.rank}")
        self.ops.set_if_absent([own] + [s for s in self._slots(uuid) if s != own], notice)


# --------------------------------------------------------------------------- storage


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


class StorageRendezvous:
    """Signals as small files in the step directory, for a group without a store.

    They are named by the save's uuid, so a retried step never sees a stale one, and start
    with a dot. Rank 0 lists the directory until every part is there; the other ranks check
    for its *done* or *abort* marker, each with backoff up to 0.1 s. Rank 0 removes the parts
    after the commit and leaves the empty *done* marker.
    """

    def __init__(self, storage: Storage, rank: int, world_size: int, timeout: float) -> None:
        self.storage = storage
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout

    @staticmethod
    def _poll(check: Callable[[], Any], deadline: float) -> Any:
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

    def post(self, step: int, uuid: str, part: Part) -> None:
        path = f"{fmt.step_dirname(step)}/{part_name(uuid, self.rank)}"
        self.storage.put_atomic(path, part.encode())

    def outcome(self, step: int, uuid: str, deadline: float) -> None:
        step_dir = fmt.step_dirname(step)
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
            if self.storage.exists(f"{step_dir}/{fmt.MANIFEST}"):
                return  # committed; rank 0 died before its retention pass ended
            raise _rank0_silent(step, self.timeout) from None
        if state == "abort":
            raise DistributedSaveError(body["message"], ranks=body["ranks"])

    def gather(self, step: int, uuid: str, deadline: float) -> list[Part]:
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
            msg = _late_message(step, missing, self.timeout)
            self.abort(step, uuid, missing, msg)
            raise DistributedSaveError(msg, ranks=missing) from None
        if state == "failed":
            reasons = {r: self._read_text(f"{step_dir}/{failed_name(uuid, r)}") for r in bad}
            msg = _failure_message(step, reasons)
            self.abort(step, uuid, bad, msg)
            raise DistributedSaveError(msg, ranks=bad)
        return [Part.decode(self._read(f"{step_dir}/{n}")) for n in wanted]

    def committed(self, step: int, uuid: str) -> None:
        for r in range(1, self.world_size):
            self.storage.delete(f"{fmt.step_dirname(step)}/{part_name(uuid, r)}")

    def finished(self, step: int, uuid: str) -> None:
        self.storage.put_atomic(f"{fmt.step_dirname(step)}/{done_name(uuid)}", b"")

    def abort(self, step: int, uuid: str, ranks: list[int], message: str) -> None:
        body = json.dumps({"ranks": ranks, "message": message}).encode()
        self.storage.put_atomic(f"{fmt.step_dirname(step)}/{abort_name(uuid)}", body)

    def publish_failure(self, step: int, uuid: str, message: str) -> None:
        step_dir = fmt.step_dirname(step)
        self.storage.makedirs(step_dir)
        if self.rank == 0:
            self.abort(step, uuid, [0], _failure_message(step, {0: message}))
        else:
            self.storage.put_atomic(f"{step_dir}/{failed_name(uuid, self.rank)}", message.encode())

    def _read(self, path: str) -> bytes:
        return self.storage.read_range(path, 0, self.storage.size(path))

    def _read_text(self, path: str) -> str:
        size = min(self.storage.size(path), 1 << 20)
        return self.storage.read_range(path, 0, size).decode(errors="replace")
