"""What a retention pass deletes from a root, planned before anything is deleted.

A plan is pure: it is made from the committed steps' records and the root's step directories
as the catalog lists them, and reads nothing. The daemon (its retention pass and its collection
of partial saves) and ``aiockpt prune`` act on the same plan, so both let the same steps go
and leave the same partial directories. Deleting is the catalog's (manifest first, the files a
kept step reads kept: see :meth:`Catalog.delete_step` and :meth:`Catalog.sweep`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..retention import CheckpointRecord, RetentionPolicy, collectable_partials, select_deletions
from . import format as fmt

__all__ = ["PrunePlan", "held_files", "plan_prune"]


@dataclass(frozen=True, slots=True)
class PrunePlan:
    """The steps a pass deletes and keeps, and the partial step directories it removes."""

    #: Committed steps the policy lets go, ascending.
    doomed: list[int]
    #: Committed steps that stay, ascending (those without a record among them: a step whose
    #: manifest cannot be read is never deleted on a guess).
    kept: list[int]
    #: Partial step directories no save can still be writing, ascending: removed, but for the
    #: files a kept step reads from.
    partials: list[int]
    #: Partial step directories left, ascending: a save may still be writing them.
    spared: list[int]


def plan_prune(
    policy: RetentionPolicy | None,
    records: Sequence[CheckpointRecord],
    step_dirs: Mapping[int, bool] | None = None,
    *,
    protected: Collection[int] = frozenset(),
    busy: Collection[int] = (),
    everything: bool = False,
) -> PrunePlan:
    """The plan for a root whose committed steps have ``records`` (those that read) and whose
    ``step_dirs`` map each step directory's step to whether it holds a manifest (by default,
    the steps of ``records``, all committed). ``policy`` None keeps every checkpoint; the
    newest and ``protected`` steps are always kept (see :func:`select_deletions`); partial
    directories go as :func:`collectable_partials` says, ``busy`` steps being saved."""
    if step_dirs is None:
        step_dirs = {r.step: True for r in sorted(records, key=lambda r: r.step)}
    doomed = select_deletions(policy, records, protected)
    gone = set(doomed)
    partials = collectable_partials(step_dirs, busy, everything=everything)
    swept = set(partials)
    return PrunePlan(
        doomed=doomed,
        kept=sorted(s for s, committed in step_dirs.items() if committed and s not in gone),
        partials=partials,
        spared=sorted(s for s, committed in step_dirs.items() if not committed and s not in swept),
    )


def held_files(refs: Iterable[str], step: int) -> list[str]:
    """The files of ``step``'s directory among ``refs`` (paths relative to the root, such as
    :meth:`Catalog.referenced` gives): those a partial directory's removal must leave."""
    prefix = fmt.step_dirname(step) + "/"
    return [path for path in refs if path.startswith(prefix)]
