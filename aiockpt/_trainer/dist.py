"""The trainer's side of multi-rank saves: which group, which rank, and agreeing on each save.

Only tiny collectives run here, on the caller's thread and in program order (a collective issued
from another thread could interleave with the trainer's own and hang both): one all_gather of
a few bytes per save (see agree), and barriers around start-up cleanup.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import DistributedSaveError, InvalidStepError, UnsupportedValueError


@dataclass(frozen=True, slots=True)
class Group:
    """The process group a manager checkpoints, and this process's place in it."""

    pg: Any
    rank: int
    world_size: int
    #: The global ranks of the group's members, by group rank.
    ranks: tuple[int, ...] = ()

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, by rank."""
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, by rank, when it is as long on every rank: one all_gather of
        a byte tensor, where all_gather_object runs two (the sizes, then the pickles) and
        pickles (4 gloo ranks on 2 cores: 4.2-4.6 ms against 8.2-8.5 ms)."""
        import torch
        import torch.distributed as dist

        # The device torch's object collectives use for this group: CPU for gloo, the
        # current GPU for a group that is NCCL alone.
        device = torch.device(dist.distributed_c10d._get_object_coll_device(self.pg))
        mine = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(out, mine, group=self.pg)
        return [bytes(t.cpu().numpy()) for t in out]

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        import torch.distributed as dist

        dist.barrier(group=self.pg)


def resolve_group(process_group: Any) -> Group | None:
    """The group given, else the default one if torch.distributed is initialized, else None."""
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
    return Group(pg, rank, world, tuple(dist.get_process_group_ranks(pg)))


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
    rank runs it, in the same order)."""
    refused = error is not None
    mine = _SAY.pack(
        -1 if refused else step,
        refused,
        bytes.fromhex(uuid),
        bytes(16) if refused else _signature(dtensors),
    )
    everyone = [_SAY.unpack(said) for said in group.all_gather_bytes(mine)]
    if any(r for _, r, _, _ in everyone):
        whys = group.all_gather(_describe(error))
        if error is not None:
            raise error
        failed = {r: why for r, why in enumerate(whys) if why is not None}
        raise DistributedSaveError(
            f"the save of step {step} was refused on rank(s) {sorted(failed)}: "
            + "; ".join(f"rank {r}: {why}" for r, why in sorted(failed.items())),
            ranks=sorted(failed),
        )
    steps = {r: s for r, (s, _, _, _) in enumerate(everyone)}
    if len(set(steps.values())) != 1:
        raise InvalidStepError(
            "every rank must save the same step; got "
            + ", ".join(f"rank {r}: {s}" for r, s in steps.items())
        )
    if len({sig for _, _, _, sig in everyone}) != 1:
        # Rare, so only now the details: every rank learns the same offending key.
        _refuse_disagreement(group, group.all_gather(_details(dtensors)))
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
                f"rank {r}: {f[0]}{list(f[1])} {list(f[2])}" for r, f in facts.items() if f
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
