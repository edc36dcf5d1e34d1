"""The trainer's side of multi-rank saves: which group, which rank, and agreeing on each save.

Only tiny collectives run here, on the caller's thread and in program order (a collective issued
from another thread could interleave with the trainer's own and hang both): one all_gather of
a few bytes per save (see agree), and barriers around start-up cleanup.
"""

from __future__ import annotations

import hashlib
import itertools
import pickle
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ..errors import CheckpointError, DistributedSaveError, InvalidStepError, UnsupportedValueError

#: What a wait across ranks that failed raises: ``error(message, late_ranks)``.
Fail = Callable[[str, list[int]], Exception]


def agreed_steps(group: Group | None, steps: list[int]) -> list[int]:
    """The steps every rank of ``group`` can load: with a local tier, a rank lists the steps
    whose manifest and the shards a load needs it can read, which differ from host to host."""
    if group is None:
        return steps
    told = group.all_gather(steps, "the steps' agreement")
    return sorted(set.intersection(*(set(s) for s in told)))


def save_failed(message: str, ranks: list[int]) -> Exception:
    return DistributedSaveError(message, ranks=ranks)


@dataclass(frozen=True, slots=True)
class Group:
    """The process group a manager checkpoints, and this process's place in it.

    Every collective here is bounded by ``timeout`` (the manager's ``dist_timeout``): a rank
    that does not join one in time is named in the error, found through the group's store
    (see :meth:`_late`). The collective itself stays pending in torch, so after such an error
    the ranks are out of step and the group is not to be used for checkpoints again."""

    pg: Any
    rank: int
    world_size: int
    #: The global ranks of the group's members, by group rank.
    ranks: tuple[int, ...] = ()
    #: Seconds any rank waits for the others in a collective (None: torch's own timeout).
    timeout: float | None = None
    #: Numbers this rank's collectives, in the order every rank runs them.
    _seq: Iterator[int] = field(default_factory=itertools.count, compare=False, repr=False)

    def all_gather(self, obj: Any, what: str = "a collective", fail: Fail = save_failed) -> list:
        """Every rank's ``obj`` (pickled), by rank: the sizes, then the padded pickles."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        sizes = [
            _SIZE.unpack(b)[0] for b in self.all_gather_bytes(_SIZE.pack(len(data)), what, fail)
        ]
        padded = data + bytes(max(sizes) - len(data))
        gathered = self.all_gather_bytes(padded, what, fail)
        return [pickle.loads(b[:n]) for b, n in zip(gathered, sizes, strict=True)]

    def all_gather_bytes(
        self, data: bytes, what: str = "a collective", fail: Fail = save_failed
    ) -> list[bytes]:
        """Every rank's ``data``, by rank, when it is as long on every rank: one all_gather of
        a byte tensor, where all_gather_object runs two (the sizes, then the pickles) and
        pickles; one collective and no pickling take about half the time."""
        import torch
        import torch.distributed as dist

        # The device torch's object collectives use for this group: CPU for gloo, the
        # current GPU for a group that is NCCL alone.
        device = torch.device(dist.distributed_c10d._get_object_coll_device(self.pg))
        mine = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._wait(dist.all_gather(out, mine, group=self.pg, async_op=True), what, fail)
        return [bytes(t.cpu().numpy()) for t in out]

    def barrier(self, what: str = "a barrier", fail: Fail = save_failed) -> None:
        """Wait until every rank gets here."""
        import torch.distributed as dist

        self._wait(dist.barrier(group=self.pg, async_op=True), what, fail)

    def _wait(self, work: Any, what: str, fail: Fail) -> None:
        seq = next(self._seq)
        try:
            if self.timeout is None:
                work.wait()
            else:
                work.wait(timeout=timedelta(seconds=self.timeout))
        except RuntimeError as e:
            late = self._late(seq)
            if "timed out" in str(e).lower():
                raise fail(
                    f"{what}: rank(s) {late} did not join the other ranks within "
                    f"dist_timeout={self.timeout:g} s",
                    late,
                ) from None
            gone = f" (rank(s) {late} did not answer)" if late else ""
            raise fail(f"{what} failed between the ranks{gone}: {e}", late) from e

    def _late(self, seq: int) -> list[int]:
        """The ranks that did not get to collective ``seq`` (late, or gone), by the marks the
        ranks it failed on leave in the group's store (each waits a moment for the others')."""
        from .storeproxy import group_store

        store = group_store(self.pg)
        if store is None:
            return []
        prefix = f"aiockpt/late/{getattr(self.pg, 'group_name', '')}/{seq}/r"
        try:
            store.set(f"{prefix}{self.rank}", b"1")
            deadline = time.monotonic() + min(_MARK_WAIT, self.timeout or _MARK_WAIT)
            while True:
                late = [r for r in range(self.world_size) if not store.check([f"{prefix}{r}"])]
                if not late or time.monotonic() >= deadline:
                    return late
                time.sleep(0.05)
        except Exception:  # the store is gone too: nothing to name
            return []


#: Seconds a rank that timed out in a collective waits for the others to mark it (see _late).
_MARK_WAIT = 5.0
_SIZE = struct.Struct("<q")


def resolve_group(process_group: Any, timeout: float | None = None) -> Group | None:
    """The group given, else the default one if torch.distributed is initialized, else None;
    its collectives bounded by ``timeout`` seconds."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        if process_group is not None:
            raise ValueError("process_group was given but torch.distributed is not initialized")
        return None
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"process_group must be a torch.distributed ProcessGroup, not "
            f"{type(process_group).__name__}"
        )
    pg = process_group if process_group is not None else dist.group.WORLD
    world = dist.get_world_size(pg)
    rank = dist.get_rank(pg)
    if rank < 0:
        raise ValueError("this process is not a member of the process_group given")
    return Group(pg, rank, world, tuple(dist.get_process_group_ranks(pg)), timeout)


#: A rank's say in a save (see agree): the step, whether it refused, its uuid and the
#: signature of its DTensors.
_SAY = struct.Struct("<q?16s16s")


def agree(
    group: Group,
    step: Any,
    uuid: str,
    error: BaseException | None,
    dtensors: Sequence[Any] = (),
) -> str:
    """Check every rank saves the same step without error, and the same DTensors (dtensor.Held)
    where they hold them; return the save's common uuid (rank 0's).

    One all_gather of :data:`_SAY` per save; only when a rank refused, or the DTensors
    differ, does a second one gather what each rank has to say, at once (so that every
    rank runs it, in the same order). ``error``: what this rank met before the agreement.
    A refusal of aiockpt's own (a CheckpointError) is raised as it is on its rank; anything
    else, and every failure on the other ranks, as DistributedSaveError naming each failing
    rank and its error."""
    refused = error is not None
    mine = _SAY.pack(
        -1 if refused else step,
        refused,
        bytes.fromhex(uuid),
        bytes(16) if refused else _signature(dtensors),
    )
    what = f"the ranks' agreement on the save of step {step!r}"
    everyone = [_SAY.unpack(said) for said in group.all_gather_bytes(mine, what)]
    if any(r for _, r, _, _ in everyone):
        whys = group.all_gather(_describe(error), what)
        failed = {r: why for r, why in enumerate(whys) if why is not None}
        if isinstance(error, CheckpointError):
            raise error  # a refusal of aiockpt's own: it names what is wrong
        raise DistributedSaveError(
            f"the save of step {step!r} failed on rank(s) {sorted(failed)}: "
            + "; ".join(f"rank {r}: {why}" for r, why in sorted(failed.items())),
            ranks=sorted(failed),
        ) from error
    steps = {r: s for r, (s, _, _, _) in enumerate(everyone)}
    if len(set(steps.values())) != 1:
        raise InvalidStepError(
            "every rank must save the same step; got "
            + ", ".join(f"rank {r}: {s}" for r, s in steps.items())
        )
    if len({sig for _, _, _, sig in everyone}) != 1:
        # Rare, so only now the details: every rank learns the same offending key.
        _refuse_disagreement(group, group.all_gather(_details(dtensors), what))
    return everyone[0][2].hex()


def check_meshes(group: Group, dtensors: Sequence[Any]) -> None:
    """Refuse a DTensor whose mesh holds ranks outside the manager's process group: its
    chunks would be written by processes that are not saving this checkpoint."""
    members = set(group.ranks)
    for h in dtensors:
        outside = sorted(set(h.mesh_ranks) - members)
        if outside:
            raise UnsupportedValueError(
                h.name,
                f"the DTensor's device mesh holds global ranks {outside}, which are not in "
                f"the manager's process group (global ranks {sorted(members)})",
            )


def _signature(dtensors: Sequence[Any]) -> bytes:
    """A digest of what a rank holds of its DTensors that every rank must agree on."""
    text = repr([_fact(h) for h in dtensors])
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def _fact(h: Any) -> tuple:
    return (h.name, str(h.tensor.dtype), h.shape, h.placements, h.mesh_ranks)


def _details(dtensors: Sequence[Any]) -> dict[str, tuple]:
    return {h.name: _fact(h)[1:] for h in dtensors}


def _refuse_disagreement(group: Group, details: list[dict[str, tuple]]) -> None:
    """Raise UnsupportedValueError naming the first key the ranks disagree on."""
    names = sorted({name for d in details for name in d})
    for name in names:
        facts = {r: d.get(name) for r, d in enumerate(details)}
        holders = {r for r, f in facts.items() if f is not None}
        mesh = set(next(f for f in facts.values() if f is not None)[3])
        expected = {r for r, g in enumerate(group.ranks) if g in mesh}
        if len({f for f in facts.values() if f is not None}) > 1:
            shown = "; ".join(
                f"rank {r}: {f[0]}{list(f[1])} {list(f[2])} on mesh ranks {list(f[3])}"
                for r, f in facts.items()
                if f
            )
            raise UnsupportedValueError(name, f"the ranks hold different DTensors here: {shown}")
        if holders != expected:
            raise UnsupportedValueError(
                name,
                f"a DTensor on ranks {sorted(holders)} but not on ranks "
                f"{sorted(expected - holders)} of its mesh (a plain tensor or nothing there)",
            )
    raise UnsupportedValueError("", "the ranks hold different DTensors")


def _describe(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"


#: A rank's say in a load's agreement (see LoadAgreement): the step it read, whether it failed.
_LOAD_SAY = struct.Struct("<q?")


def load_failed(message: str, ranks: list[int]) -> Exception:
    return CheckpointError(message)


class LoadAgreement:
    """The ranks' two agreements on one load, so that what fails on one rank fails on all.

    ``checked``: once this rank has read and verified its bytes and planned its restore, and
    before any target changes: a corrupt shard or a mismatch on any rank fails the load on
    every rank, every target untouched. ``restored``: once the targets are restored (at once,
    for a load without one, so that every load runs both, whatever each rank loads into): a
    module's ``load_state_dict`` raising on one rank is raised on every rank, the targets
    possibly partly restored. A rank that fails before an agreement still
    takes part in it (``failed``), saying why, so the ranks stay in step. Without a group of
    several ranks, each is a no-op."""

    def __init__(self, group: Group | None, step: int | None) -> None:
        self._group = group if group is not None and group.world_size > 1 else None
        self._step = step
        self._stages = ["checked", "restored"]

    def checked(self, step: int) -> None:
        """Every rank read step ``step`` without error, or raise."""
        self._agree("checked", step, None)

    def restored(self, step: int) -> None:
        """Every rank restored step ``step`` without error, or raise."""
        self._agree("restored", step, None)

    def failed(self, error: Exception) -> None:
        """Tell the other ranks of ``error`` at the next agreement still to come, and raise
        what every rank raises then; nothing when none is left."""
        if self._stages:
            self._agree(self._stages[0], -1, error)

    def _agree(self, stage: str, step: int, error: Exception | None) -> None:
        if self._group is None:
            self._stages.clear()
            return
        del self._stages[: self._stages.index(stage) + 1]
        try:
            self._gather(stage, step, error)
        except BaseException:
            self._stages.clear()  # the ranks are told: no agreement follows a failed one
            raise

    def _gather(self, stage: str, step: int, error: Exception | None) -> None:
        assert self._group is not None
        group = self._group
        shown = "the latest step" if self._step is None else f"step {self._step}"
        what = f"the ranks' agreement on the load of {shown}"
        said = group.all_gather_bytes(_LOAD_SAY.pack(step, error is not None), what, load_failed)
        everyone = [_LOAD_SAY.unpack(s) for s in said]
        if any(failed for _, failed in everyone):
            whys = group.all_gather(_describe(error), what, load_failed)
            failed = {r: why for r, why in enumerate(whys) if why is not None}
            if isinstance(error, CheckpointError) and stage == "checked":
                raise error  # aiockpt's own finding: it names what is wrong
            raise CheckpointError(
                f"the load of {shown} failed on rank(s) {sorted(failed)}: "
                + "; ".join(f"rank {r}: {why}" for r, why in sorted(failed.items()))
                + ("" if stage == "checked" else " (the targets may be partly restored)")
            ) from error
        steps = {r: s for r, (s, _) in enumerate(everyone)}
        if len(set(steps.values())) != 1:
            raise CheckpointError(
                "every rank must load the same step; read "
                + ", ".join(f"rank {r}: step {s}" for r, s in steps.items())
            )
