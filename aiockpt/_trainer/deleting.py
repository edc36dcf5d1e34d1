"""``delete()`` on several ranks: every rank calls it, the ranks agree on what it deletes,
and its outcome is every rank's (the error of the rank that failed, raised on every rank)."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from .. import errors
from .._core.protocol import DeleteReq, StepsReq
from ..errors import CheckpointError, CheckpointNotFoundError, InvalidStepError
from ..tiers import leads_host
from . import dist as _dist
from .supervisor import Supervisor


def agree_on(group: _dist.Group, step: int, allow_latest: bool) -> None:
    """Check that every rank asked for the same ``delete(step, allow_latest)``."""
    asked = group.all_gather((step, allow_latest), f"the ranks' agreement on delete({step})")
    if len(set(asked)) != 1:
        raise InvalidStepError(
            "every rank must delete the same step: "
            + ", ".join(
                f"rank {r}: delete({s}, allow_latest={a})" for r, (s, a) in enumerate(asked)
            )
        )


async def deleted_by_rank_0(
    group: _dist.Group,
    step: int,
    allow_latest: bool,
    delete: Callable[[int, bool], Awaitable[None]],
) -> None:
    """Without local tiers: rank 0's daemon deletes the step from the root (as it applies
    retention, once for everyone), and its outcome is every rank's, as the same class."""
    agree_on(group, step, allow_latest)
    error: Exception | None = None
    if group.rank == 0:
        try:
            await delete(step, allow_latest)
        except Exception as e:  # told to the others before it is raised
            error = e
    said = None if error is None else (type(error).__name__, str(error))
    told = group.all_gather(said, f"the outcome of delete({step})")[0]
    if error is not None:
        raise error
    if told is not None:
        raise _as_raised_on_rank_0(told[0], f"delete({step}) failed on rank 0: {told[1]}")


async def deleted_everywhere(
    group: _dist.Group,
    step: int,
    allow_latest: bool,
    daemons: Supervisor,
    forget: Callable[[int], None],
) -> None:
    """With local tiers: the step goes from the root (rank 0) and from every host's tier
    (each host's first rank), wherever it lies, so that it never comes back from one. It is
    the newest step only where it is the newest that every rank can load, which is what a
    resume loads. It is not committed only when no host found it anywhere: a delete that
    failed half way, asked again, removes what is left. ``forget(step)`` once any host
    deleted it."""
    agree_on(group, step, allow_latest)
    d = await daemons.live()
    loadable = _dist.agreed_steps(group, list(await d.request(StepsReq)))
    if loadable and step == loadable[-1] and not allow_latest:
        raise InvalidStepError(
            f"step {step} is the newest checkpoint every rank can load, which a resume loads; "
            "pass allow_latest=True to delete it"
        )
    found, error = False, None
    if leads_host(daemons.hello.hosts, group.rank):
        request: Any = d.request  # (DeleteReq is answered by the writer, after the saves)
        try:
            found = await request(
                DeleteReq, step=step, allow_latest=True, root=group.rank == 0, missing_ok=True
            )
        except Exception as e:  # told to the others before it is raised
            error = e
    said = (found, None if error is None else (type(error).__name__, str(error)))
    told = group.all_gather(said, f"the outcome of delete({step})")
    if any(f for f, _ in told):
        forget(step)
    if error is not None:
        raise error
    for rank, (_, failed) in enumerate(told):
        if failed is not None:
            kind, shown = failed
            raise CheckpointError(f"delete({step}) failed on rank {rank}: {shown} ({kind})")
    if not any(f for f, _ in told):
        raise CheckpointNotFoundError(
            f"step {step} is not a committed checkpoint in the root nor in any host's tier"
        )


def _as_raised_on_rank_0(kind: str, shown: str) -> CheckpointError:
    """The error of aiockpt's class ``kind`` that rank 0 raised, for another rank to raise;
    a plain CheckpointError for any other."""
    cls = getattr(errors, kind, None)
    if isinstance(cls, type) and issubclass(cls, CheckpointError):
        with contextlib.suppress(TypeError):  # one whose constructor asks for more
            return cls(shown)
    return CheckpointError(f"{shown} ({kind})")
