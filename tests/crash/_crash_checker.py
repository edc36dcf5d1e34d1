"""The checker: every crash state of a recording (or a seeded sample), each checked.

A recording with two writers (``meta["fenced"]`` names the one fenced off, see
:func:`~_crash_record.record_two_writers`) is checked in every interleaving of what the fenced
writer did after its pause with what the other writer did meanwhile (:func:`interleavings`).
"""

from __future__ import annotations

import itertools
import os
import random
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _crash_check import (
    Scratch,
    TierOpen,
    coarse,
    inspect,
    materialize,
    open_and_check,
    written_files,
)
from _crash_model import (
    ABSENT,
    DATA_KINDS,
    ENTRY_KINDS,
    HALF,
    ZEROS,
    FsModel,
    object_states,
    signature,
)
from _crash_record import EXPECTED, LEASE_TTL, Recording

#: ``AIOCKPT_CRASH_ALL=1``: every state of every crash point, and a fresh manager on one
#: state of every class; otherwise a seeded sample of both.
FULL = os.environ.get("AIOCKPT_CRASH_ALL", "") not in ("", "0")
_MANIFEST = re.compile(r"step_(\d{12})/manifest\.json$")


@dataclass
class Report:
    """What was checked, and what failed."""

    points: int = 0  # crash points
    logs: int = 0  # interleavings checked (1 for a run with one writer)
    states: int = 0  # crash states checked (in-process)
    trees: int = 0  # distinct trees among them
    opened: int = 0  # states a fresh manager opened
    violations: list[str] = field(default_factory=list)


@dataclass
class Budget:
    """How much to check: states per crash point and manager opens (None: all)."""

    per_point: int | None
    opens: int | None
    #: Two writers: interleavings checked besides the one with the fenced writer's operations
    #: last (None: all).
    interleavings: int | None = None


def required(records: list[dict[str, Any]], point: int) -> set[int]:
    """The steps that must be there after a crash at ``point``: those whose ``await handle``
    had returned, less those whose deletion by retention had begun."""
    done, deleting = set(), set()
    for r in records[:point]:
        if r["op"] == "mark" and "durable" in r:
            done.add(r["durable"])
        elif (r["op"] == "unlink" or r.get("call") == "delete") and (
            m := _MANIFEST.match(r.get("path", ""))
        ):
            deleting.add(int(m.group(1)))
    return done - deleting


def persisted(records: list[dict[str, Any]], point: int, every: int) -> set[int]:
    """A local tier's run: the steps the root must hold after a crash at ``point``, those of
    the promised ones due there (the root of the recorded run keeps every step)."""
    done = {r["durable"] for r in records[:point] if r["op"] == "mark" and "durable" in r}
    return {s for s in done if s % every == 0}


def tier_open(meta: dict[str, Any], records: list[dict[str, Any]], point: int, to: str) -> TierOpen:
    """How a fresh manager opens a crash state of a local tier's run at ``point``: with a
    copy, at ``to``, of the root as the last promise before the point left it (an empty
    root before the first)."""
    done = [r["durable"] for r in records[:point] if r["op"] == "mark" and "durable" in r]
    if done:
        shutil.copytree(os.path.join(meta["snapshots"], str(done[-1])), to)
    else:
        os.makedirs(to)
    return TierOpen(to, meta["every"], meta["keep"])


def _path(record: dict[str, Any]) -> str:
    return str(record.get("path", record.get("dst", "")))


@dataclass
class Log:
    """One order of a recording's records to check: the records, the recorded position of
    each (``#N`` in reports), the first crash point not checked already in another order, and
    that order in words (empty: the recorded one)."""

    records: list[dict[str, Any]]
    where: list[int]
    start: int = 0
    label: str = ""


def describe(model: FsModel | None, log: Log, point: int, landed: Any) -> str:
    """A crash state in words: the order, the point, the last record before it, and how the
    operations that were not durable there landed (the others landed in full). Records are
    named ``#N`` by their place in the recorded log."""
    records = log.records
    last = records[point - 1] if point else {"op": "start"}
    after = f"#{log.where[point - 1]}" if point else "none"
    where = f"crash point {point} (after record {after}: {last['op']} {_path(last)})"
    if log.label:
        where = f"{log.label}, {where}"
    if model is None or not landed:
        return where
    names = {ABSENT: "lost", HALF: "torn to half", ZEROS: "zeros"}
    ways = [
        f"#{log.where[model.ops[i].pos]} {model.ops[i].kind} "
        f"{_path(records[model.ops[i].pos])}: {names[how]}"
        for i, how in landed
        if how in names
    ]
    return where + "; " + ("; ".join(ways) or "every pending operation landed")


def _states(
    log: Log, model: str, per_point: int | None
) -> Iterator[tuple[int, dict, str, FsModel | None]]:
    if model == "objects":
        for point, tree in object_states(log.records):
            if point >= log.start:
                yield point, tree, describe(None, log, point, ()), None
        return
    fs = FsModel(log.records, model)
    seed = f"{model}:{log.label}" if log.label else model
    for point in range(log.start, len(log.records) + 1):
        for state in fs.states(point, per_point, seed=seed):
            yield point, fs.tree(state), describe(fs, log, point, state.landed), fs


#: What changes a crash state, by model: file-system operations, barriers and promises, or
#: Storage calls and promises.
_MOVED = {"objects": ("api",), "fs": DATA_KINDS + ENTRY_KINDS}
_KEPT = {
    "objects": ("api", "mark"),
    "fs": (*DATA_KINDS, *ENTRY_KINDS, "fsync", "fsync_dir", "mark"),
}


def fenced_tail(rec: Recording) -> tuple[int, list[int]]:
    """The position of the fenced writer's pause and of what it recorded after it (none in a
    run with one writer)."""
    fenced = rec.meta.get("fenced")
    records = rec.records
    if fenced is None:
        return len(records), []
    pause = next(
        i for i, r in enumerate(records) if r["op"] == "pause" and r.get("writer") == fenced
    )
    return pause, [i for i in range(pause + 1, len(records)) if records[i].get("writer") == fenced]


def _moved(records: list[dict[str, Any]], where: list[int], head: int, fenced: str) -> str:
    """Where an order put the fenced writer's operations, in words."""
    return "; ".join(
        f"fenced #{where[slot]} {records[where[slot]]['op']} moved after #{where[slot - 1]}"
        for slot in range(head, len(where))
        if records[where[slot]].get("writer") == fenced
    )


def interleavings(rec: Recording, model: str, limit: int | None) -> list[Log]:
    """The orders in which to check ``rec`` under ``model``.

    One writer: the recorded order. Two: the records up to the fenced writer's pause as
    recorded, then its later operations merged, in their own order, at every position among
    the other writer's operations since the pause. Its barriers (fsync, fsync_dir) are left
    out: a barrier only ever removes crash states, so the states of every placement of one
    are among those of the order without it. Records that change no state in the model
    (Storage calls in the file-system models, file-system operations in ``objects``, pauses)
    are left out too. The order with the fenced writer's operations last comes first and is
    checked at every crash point; each other order only from the point its first moved
    operation happened, where it starts to differ. ``limit``: how many of the other orders
    a seeded draw takes (None: all; ``objects``, whose orders are few, takes all always)."""
    records = rec.records
    pause, tail = fenced_tail(rec)
    if not tail:
        return [Log(list(records), list(range(len(records))))]
    kind = "objects" if model == "objects" else "fs"
    head = list(range(pause))
    mine = set(tail)
    others = [
        i
        for i in range(pause + 1, len(records))
        if i not in mine and records[i]["op"] in _KEPT[kind]
    ]
    moved = [i for i in tail if records[i]["op"] in _MOVED[kind]]
    n, k = len(others) + len(moved), len(moved)
    last = tuple(range(len(others), n))
    choices = [c for c in itertools.combinations(range(n), k) if c != last]
    if limit is not None and len(choices) > limit and model != "objects":
        picked = set(random.Random(f"{model}:interleavings").sample(range(len(choices)), limit))
        choices = [c for j, c in enumerate(choices) if j in picked]
    logs = []
    for places in (last, *choices):
        order, a, b = [], iter(moved), iter(others)
        for slot in range(n):
            order.append(next(a) if slot in places else next(b))
        where = head + order
        start = 0 if places == last else len(head) + places[0] + 1
        label = (
            "fenced writer last"
            if places == last
            else _moved(records, where, len(head), rec.meta["fenced"])
        )
        logs.append(Log([records[i] for i in where], where, start, label))
    return logs


def spread(items: list[Any], n: int | None) -> list[Any]:
    """``n`` items evenly spread over ``items`` (all of them when None or enough)."""
    if n is None or len(items) <= n:
        return items
    if n == 1:
        return items[-1:]
    return [items[round(i * (len(items) - 1) / (n - 1))] for i in range(n)]


async def check(rec: Recording, model: str, tmp: Path, budget: Budget) -> Report:
    """Check the crash states of ``rec`` under ``model`` (see the module docs)."""
    report = Report()
    # What the fenced writer wrote after its pause no manifest may refer to: it is no
    # reference for any committed file.
    late = set(fenced_tail(rec)[1])
    reference = written_files([r for i, r in enumerate(rec.records) if i not in late])
    seen: dict[str, tuple[set[int], list[str]]] = {}
    scratch = Scratch(str(tmp / "state"))
    classes: dict[str, tuple[dict, int, str, list[dict[str, Any]]]] = {}
    points = set()
    for log in interleavings(rec, model, budget.interleavings):
        report.logs += 1
        for point, tree, what, _ in _states(log, model, budget.per_point):
            points.add((log.label, point))
            report.states += 1
            sig = signature(tree)
            if sig not in seen:
                seen[sig] = inspect(scratch.become(tree), reference)
            committed, problems = seen[sig]
            missing = required(log.records, point) - committed
            if missing:
                problems = [
                    *problems,
                    f"steps {sorted(missing)} were promised durable but are gone",
                ]
            report.violations += [f"{model}, {what}: {p}" for p in problems]
            classes.setdefault(signature(coarse(tree)), (tree, point, what, log.records))
    report.points, report.trees = len(points), len(seen)
    for n, (tree, point, what, records) in enumerate(spread(list(classes.values()), budget.opens)):
        where = materialize(tree, str(tmp / f"b{n}"))
        expected = EXPECTED[rec.meta.get("state", "plain")]
        promised = required(records, point)
        tier = None
        if "tier" in rec.meta:
            tier = tier_open(rec.meta["tier"], records, point, str(tmp / f"r{n}"))
            promised |= persisted(records, point, tier.every)
        listed, problems = await open_and_check(where, expected, LEASE_TTL, tier)
        shutil.rmtree(where)
        if tier is not None:
            shutil.rmtree(tier.root)
        missing = promised - listed
        if missing:
            problems.append(f"steps {sorted(missing)} were promised durable but are not listed")
        report.opened += 1
        report.violations += [f"{model}, {what}, opened by a manager: {p}" for p in problems]
    return report
