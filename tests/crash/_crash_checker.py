"""The checker: every crash state of a recording (or a seeded sample), each checked."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _crash_check import coarse, inspect, materialize, open_and_check, written_files
from _crash_model import ABSENT, HALF, ZEROS, FsModel, object_states, signature
from _crash_record import EXPECTED, LEASE_TTL, Recording

#: ``AIOCKPT_CRASH_ALL=1``: every state of every crash point, and a fresh manager on one
#: state of every class; otherwise a seeded sample of both.
FULL = os.environ.get("AIOCKPT_CRASH_ALL", "") not in ("", "0")
_MANIFEST = re.compile(r"step_(\d{12})/manifest\.json$")


@dataclass
class Report:
    """What was checked, and what failed."""

    points: int = 0  # crash points
    states: int = 0  # crash states checked (in-process)
    trees: int = 0  # distinct trees among them
    opened: int = 0  # states a fresh manager opened
    violations: list[str] = field(default_factory=list)


@dataclass
class Budget:
    """How much to check: states per crash point and manager opens (None: all)."""

    per_point: int | None
    opens: int | None


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


def _path(record: dict[str, Any]) -> str:
    return str(record.get("path", record.get("dst", "")))


def describe(model: FsModel | None, records: list[dict[str, Any]], point: int, landed: Any) -> str:
    """A crash state in words: the point, the last record before it, and how the operations
    that were not durable there landed (the others landed in full)."""
    last = records[point - 1] if point else {"op": "start"}
    where = f"crash point {point} (after record {point - 1}: {last['op']} {_path(last)})"
    if model is None or not landed:
        return where
    names = {ABSENT: "lost", HALF: "torn to half", ZEROS: "zeros"}
    ways = [
        f"#{model.ops[i].pos} {model.ops[i].kind} {_path(records[model.ops[i].pos])}: {names[how]}"
        for i, how in landed
        if how in names
    ]
    return where + "; " + ("; ".join(ways) or "every pending operation landed")


def _states(
    rec: Recording, model: str, per_point: int | None
) -> Iterator[tuple[int, dict, str, FsModel | None]]:
    if model == "objects":
        for point, tree in object_states(rec.records):
            yield point, tree, describe(None, rec.records, point, ()), None
        return
    fs = FsModel(rec.records, model)
    for point in range(len(rec.records) + 1):
        for state in fs.states(point, per_point, seed=model):
            yield point, fs.tree(state), describe(fs, rec.records, point, state.landed), fs


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
    reference = written_files(rec.records)
    seen: dict[str, tuple[set[int], list[str]]] = {}
    classes: dict[str, tuple[dict, int, str]] = {}
    points = set()
    for point, tree, what, _ in _states(rec, model, budget.per_point):
        points.add(point)
        report.states += 1
        sig = signature(tree)
        if sig not in seen:
            where = materialize(tree, str(tmp / f"a{len(seen)}"))
            seen[sig] = inspect(where, reference)
            shutil.rmtree(where)
        committed, problems = seen[sig]
        missing = required(rec.records, point) - committed
        if missing:
            problems = [*problems, f"steps {sorted(missing)} were promised durable but are gone"]
        report.violations += [f"{model}, {what}: {p}" for p in problems]
        classes.setdefault(signature(coarse(tree)), (tree, point, what))
    report.points, report.trees = len(points), len(seen)
    for n, (tree, point, what) in enumerate(spread(list(classes.values()), budget.opens)):
        where = materialize(tree, str(tmp / f"b{n}"))
        expected = EXPECTED[rec.meta.get("state", "plain")]
        listed, problems = await open_and_check(where, expected, LEASE_TTL)
        shutil.rmtree(where)
        missing = required(rec.records, point) - listed
        if missing:
            problems.append(f"steps {sorted(missing)} were promised durable but are not listed")
        report.opened += 1
        report.violations += [f"{model}, {what}, opened by a manager: {p}" for p in problems]
    return report
