"""The trainer's side of multi-rank saves: which group, which rank, and agreeing on each save.

Only tiny collectives run here, on the caller's thread and in program order (a collective issued
from another thread could interleave with the trainer's own and hang both): one all_gather of
(step, uuid, error) per save, and barriers around start-up cleanup.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import DistributedSaveError, InvalidStepError


@dataclass(frozen=True, slots=True)
class Group:
    """The process group a manager checkpoints, and this process's place in it."""

    pg: Any
    rank: int
    world_size: int

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, by rank."""
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

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
    return Group(pg, rank, world)


def agree(group: Group, step: Any, uuid: str, error: BaseException | None) -> str:
    """Check every rank saves the same step without error; return the save's common uuid."""
    mine = (step if isinstance(step, int) else repr(step), uuid, _describe(error))
    everyone = group.all_gather(mine)
    if error is not None:
        raise error
    failed = {r: why for r, (_, _, why) in enumerate(everyone) if why is not None}
    if failed:
        raise DistributedSaveError(
            f"the save of step {step} was refused on rank(s) {sorted(failed)}: "
            + "; ".join(f"rank {r}: {why}" for r, why in sorted(failed.items())),
            ranks=sorted(failed),
        )
    steps = {r: s for r, (s, _, _) in enumerate(everyone)}
    if len(set(steps.values())) != 1:
        raise InvalidStepError(
            "every rank must save the same step; got "
            + ", ".join(f"rank {r}: {s}" for r, s in steps.items())
        )
    return everyone[0][1]


def _describe(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"
