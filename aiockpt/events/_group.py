"""The process group an event describes: what ``Event.process_group`` holds."""

from __future__ import annotations

from typing import Any


def process_group_info(group: Any = None) -> dict[str, Any]:
    """Backend, name, size and this process's rank in ``group``.

    ``group`` is the group given to the manager; only when none was given is it the default
    group (and then only when torch.distributed is initialized, else the result is empty). Never
    the default group's values for a group that was given: DCP made that mistake (PyTorch PR
    139428 logged the default group's backend instead of the caller's).
    """
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch built without distributed support
        if group is not None:
            raise ValueError(
                "a process group was given, but torch.distributed is missing"
            ) from None
        return {}
    if group is None:
        if not dist.is_available() or not dist.is_initialized():
            return {}
        group = dist.group.WORLD
    elif not isinstance(group, dist.ProcessGroup):
        if type(group) is int and group == dist.GroupMember.NON_GROUP_MEMBER:
            # what new_group() returns in a process outside the group
            raise ValueError("this process is not a member of the process group given")
        raise TypeError(
            f"process_group must be a torch.distributed ProcessGroup, not {type(group).__name__}"
        )
    elif not dist.is_initialized():
        raise ValueError("a process group was given, but torch.distributed is not initialized")
    return {
        "backend": str(dist.get_backend(group)),
        "name": dist._get_process_group_name(group),
        "size": dist.get_world_size(group),
        "rank": dist.get_rank(group),
    }
