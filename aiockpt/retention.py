"""Retention policies: which committed checkpoints to keep.

A policy sees every committed checkpoint of the root, oldest step first, and answers one bool
each (``True`` = keep). Policies combine with ``|``: a checkpoint is kept when any policy keeps
it. The daemon applies the policy after each commit; whatever a policy says, the newest
committed checkpoint and any checkpoint still being saved are never deleted.

Policies are pickled to the daemon by reference, so a policy of your own must be defined in an
importable module (not in the ``__main__`` script)::

    @dataclass(frozen=True)
    class KeepEven:
        def keep(self, checkpoints):
            return [c.step % 2 == 0 for c in checkpoints]
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

__all__ = [
    "AnyOf",
    "BestN",
    "CheckpointRecord",
    "EveryNSeconds",
    "EveryNSteps",
    "LatestN",
    "RetentionPolicy",
    "best_order",
    "collectable_partials",
    "select_deletions",
]


@dataclass(frozen=True, slots=True)
class CheckpointRecord:
    """What a policy sees of one committed checkpoint."""

    step: int
    time: float  # commit time, seconds since the epoch
    metrics: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class RetentionPolicy(Protocol):
    def keep(self, checkpoints: Sequence[CheckpointRecord]) -> list[bool]:
        """One bool per checkpoint, in the order given (ascending step)."""


class _Combinable:
    def __or__(self, other: RetentionPolicy) -> AnyOf:
        if not isinstance(other, RetentionPolicy):
            return NotImplemented
        mine = self.policies if isinstance(self, AnyOf) else (self,)
        theirs = other.policies if isinstance(other, AnyOf) else (other,)
        return AnyOf(*mine, *theirs)

    def __ror__(self, other: RetentionPolicy) -> AnyOf:
        if not isinstance(other, RetentionPolicy):
            return NotImplemented
        return AnyOf(other) | self


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, not {value!r}")


@dataclass(frozen=True, slots=True)
class LatestN(_Combinable):
    """Keep the ``n`` newest checkpoints."""

    n: int

    def __post_init__(self) -> None:
        _positive_int("LatestN's n", self.n)

    def keep(self, checkpoints: Sequence[CheckpointRecord]) -> list[bool]:
        # By step, not by position: correct even when called with checkpoints in any order.
        newest = set(sorted((c.step for c in checkpoints), reverse=True)[: self.n])
        return [c.step in newest for c in checkpoints]


@dataclass(frozen=True, slots=True)
class EveryNSteps(_Combinable):
    """Keep every checkpoint whose step is a multiple of ``n``."""

    n: int

    def __post_init__(self) -> None:
        _positive_int("EveryNSteps's n", self.n)

    def keep(self, checkpoints: Sequence[CheckpointRecord]) -> list[bool]:
        return [c.step % self.n == 0 for c in checkpoints]


@dataclass(frozen=True, slots=True)
class EveryNSeconds(_Combinable):
    """Keep the first checkpoint committed in each window of ``seconds`` (windows start at the
    epoch, so what was kept stays kept as older checkpoints go)."""

    seconds: float

    def __post_init__(self) -> None:
        if isinstance(self.seconds, bool) or not (
            isinstance(self.seconds, (int, float))
            and math.isfinite(self.seconds)
            and self.seconds > 0
        ):
            raise ValueError(
                f"EveryNSeconds's seconds must be a positive number, not {self.seconds!r}"
            )

    def keep(self, checkpoints: Sequence[CheckpointRecord]) -> list[bool]:
        first: dict[int, int] = {}
        for i, c in enumerate(checkpoints):
            window = math.floor(c.time / self.seconds)
            if window not in first or c.time < checkpoints[first[window]].time:
                first[window] = i
        chosen = set(first.values())
        return [i in chosen for i in range(len(checkpoints))]


@dataclass(frozen=True, slots=True)
class BestN(_Combinable):
    """Keep the ``n`` best checkpoints by ``metric``; those without it are not counted as best."""

    n: int
    metric: str
    mode: Literal["min", "max"] = "min"

    def __post_init__(self) -> None:
        _positive_int("BestN's n", self.n)
        if not isinstance(self.metric, str) or not self.metric:
            raise ValueError(f"BestN's metric must be a non-empty str, not {self.metric!r}")
        if self.mode not in ("min", "max"):
            raise ValueError(f"BestN's mode must be 'min' or 'max', not {self.mode!r}")

    def keep(self, checkpoints: Sequence[CheckpointRecord]) -> list[bool]:
        ranked = best_order(checkpoints, self.metric, self.mode)
        chosen = set(ranked[: self.n])
        return [i in chosen for i in range(len(checkpoints))]


def best_order(checkpoints: Sequence[CheckpointRecord], metric: str, mode: str) -> list[int]:
    """Indices of checkpoints that have a finite ``metric``, best first (ties: newer first)."""
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', not {mode!r}")
    scored = []
    for i, c in enumerate(checkpoints):
        v = c.metrics.get(metric)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            continue
        scored.append(((v if mode == "min" else -v), -c.step, i))
    return [i for _, _, i in sorted(scored)]


@dataclass(frozen=True, slots=True, init=False)
class AnyOf(_Combinable):
    """Keep a checkpoint when any of ``policies`` keeps it (what ``a | b`` builds)."""

    policies: tuple[RetentionPolicy, ...]

    def __init__(self, *policies: RetentionPolicy) -> None:
        if not policies:
            raise ValueError("AnyOf needs at least one policy")
        for p in policies:
            if not isinstance(p, RetentionPolicy):
                raise TypeError(f"{p!r} is not a retention policy (it has no keep() method)")
        object.__setattr__(self, "policies", tuple(policies))

    def keep(self, checkpoints: Sequence[CheckpointRecord]) -> list[bool]:
        out = [False] * len(checkpoints)
        for p in self.policies:
            out = [a or b for a, b in zip(out, _checked(p, checkpoints), strict=True)]
        return out


def _checked(policy: RetentionPolicy, checkpoints: Sequence[CheckpointRecord]) -> list[bool]:
    flags = policy.keep(checkpoints)
    # Strict on purpose: a truthy string or a numpy array would silently keep (or drop) the wrong
    # checkpoints, and deletion cannot be undone.
    if (
        not isinstance(flags, (list, tuple))
        or len(flags) != len(checkpoints)
        or not all(isinstance(f, bool) for f in flags)
    ):
        raise ValueError(
            f"retention policy {policy!r} must return a list of {len(checkpoints)} bools, "
            f"one per checkpoint; it returned {flags!r:.200}"
        )
    return list(flags)


def select_deletions(
    policy: RetentionPolicy | None,
    checkpoints: Sequence[CheckpointRecord],
    protected: Collection[int] = frozenset(),
) -> list[int]:
    """Steps to delete, ascending: those the policy does not keep, never ``protected`` ones, and
    never the newest (neither the highest step nor the latest commit, which differ when a run
    resumed from an earlier step)."""
    if policy is None or not checkpoints:
        return []
    for c in checkpoints:
        if not isinstance(c, CheckpointRecord):
            raise TypeError(f"expected CheckpointRecord items, got {type(c).__name__}")
    ordered = sorted(checkpoints, key=lambda c: c.step)
    if len({c.step for c in ordered}) != len(ordered):
        raise ValueError("checkpoints must have distinct steps")
    flags = _checked(policy, ordered)
    spared = {ordered[-1].step, max(ordered, key=lambda c: (c.time, c.step)).step, *protected}
    return [
        c.step for c, keep in zip(ordered, flags, strict=True) if not keep and c.step not in spared
    ]


def collectable_partials(
    step_dirs: Mapping[int, bool], busy: Collection[int] = (), *, everything: bool = False
) -> list[int]:
    """Partial steps that may be removed, ascending. ``step_dirs`` maps each step directory's
    step to whether it holds a manifest; ``busy`` steps are being saved.

    A partial below the newest committed step is dead: a writer commits its steps in order, so
    nothing still writes there. One at or above the newest commit may be a save in flight (of
    this run, or of a daemon finishing the staged saves of a trainer that died), so it is kept
    unless ``everything``; a later save of the same step overwrites it, and it becomes
    collectable once a newer step commits.
    """
    committed = [s for s, has_manifest in step_dirs.items() if has_manifest]
    newest = max(committed, default=-1)
    return sorted(
        s
        for s, has_manifest in step_dirs.items()
        if not has_manifest and s not in busy and (everything or s < newest)
    )
