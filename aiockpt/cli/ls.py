"""``aiockpt ls``: the committed checkpoints of a root, as a table or JSON lines."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from typing import Any, TextIO

from .._core import format as fmt
from ..retention import collectable_partials
from .args import Parser
from .common import Root, no_checkpoints, open_root, require_exists, scan
from .output import format_metrics, format_time, human_bytes, plural, table

#: The line of ``aiockpt --help`` that names the command.
HELP = "list committed checkpoints"
#: What ``aiockpt ls --help`` says it does.
DESCRIPTION = (
    "List the committed checkpoints of ROOT, one row each: step, commit time, size, the bytes "
    "it wrote and those it reads from earlier steps, and its metrics (one JSON object each "
    "with --json). Partial and retired step directories are counted on stderr, not listed. "
    "A root that exists without checkpoints is not an error; one that does not exist is."
)


def add_arguments(p: Parser) -> None:
    """The arguments of ``ls``."""
    p.add_argument("--json", action="store_true", help="one JSON object per checkpoint")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``aiockpt ls``: the committed checkpoints, as a table or JSON lines."""
    root = scan(open_root(args.root, args.storage_options), args.root, heads=True)
    if not root.committed:
        require_exists(root)  # a root that is not there is a typo; an empty one a fresh run
        print(no_checkpoints(root), file=sys.stderr)
        return 0
    out: TextIO = sys.stdout
    if args.json:
        for e in root.committed:
            m = e.manifest
            record: dict[str, Any] = {"step": e.step, "url": root.where(e.dirname)}
            if m is None:
                record["error"] = e.error
            else:
                record.update(
                    created_at=m.created_at,
                    nbytes=m.nbytes,
                    written_nbytes=m.stored_nbytes,
                    referenced_nbytes=m.referenced_nbytes,
                    metrics=m.metrics,
                )
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
        return 0
    rows = [["STEP", "COMMITTED", "SIZE", "WRITTEN", "REFERENCED", "METRICS"]]
    for e in root.committed:
        m = e.manifest
        if m is None:
            unreadable = "unreadable manifest (aiockpt verify says why)"
            rows.append([str(e.step), "?", "?", "?", "?", unreadable])
        else:
            rows.append(
                [
                    str(e.step),
                    format_time(m.created_at),
                    human_bytes(m.nbytes),
                    human_bytes(m.stored_nbytes),
                    human_bytes(m.referenced_nbytes),
                    format_metrics(m.metrics),
                ]
            )
    table(rows, out, right=(0, 2, 3, 4))
    print(ls_note(root), file=sys.stderr)
    return 0


def ls_note(root: Root) -> str:
    """What ``ls`` says below its table: the sizes, and the step directories it did not list
    (retired ones, kept for the bytes later steps read from them, and partial saves)."""
    manifests = [e.manifest for e in root.committed if e.manifest is not None]
    total = sum(m.nbytes for m in manifests)
    written = sum(m.stored_nbytes for m in manifests)
    note = f"{plural(len(root.committed), 'checkpoint')}, {human_bytes(total)}"
    if written != total:
        note += f" ({human_bytes(written)} written by them)"
    refs = {path.split("/", 1)[0] for m in manifests for path in m.referenced_files()}
    retired = [s for s in root.partials if fmt.step_dirname(s) in refs]
    partials = [s for s in root.partials if s not in retired]
    if retired:
        note += (
            f"; {plural(len(retired), 'retired step dir')} kept for the bytes later steps "
            f"read from them ({', '.join(map(str, retired))})"
        )
    if partials:
        note += (
            f"; {plural(len(partials), 'partial step dir')} not listed "
            f"({', '.join(map(str, partials))}; {partials_hint(root, partials)})"
        )
    return note


def partials_hint(root: Root, partials: list[int]) -> str:
    """The prune that removes ``partials``: plain ``prune`` removes those below the newest
    commit (dead saves); one above it may be a save still being written, which only
    ``--all-partials`` removes (see retention.collectable_partials)."""
    step_dirs = {e.step: True for e in root.committed} | dict.fromkeys(partials, False)
    dead = collectable_partials(step_dirs)
    alive = [s for s in partials if s not in dead]
    command = f"aiockpt prune {shlex.quote(root.url)}"
    parts = []
    if dead:
        parts.append(f"{command} removes {', '.join(map(str, dead)) if alive else them(dead)}")
    if alive:
        listed = ", ".join(map(str, alive))
        parts.append(
            f"{listed if dead else them(alive, subject=True)} {'is' if len(alive) == 1 else 'are'} "
            "above the newest commit and may be a save still being written: "
            f"{command} --all-partials removes {them(alive)}{' too' if dead else ''} when none is"
        )
    return "; ".join(parts)


def them(steps: list[int], *, subject: bool = False) -> str:
    """``it`` or ``them`` (``they``, as a ``subject``) for ``steps``."""
    if len(steps) == 1:
        return "it"
    return "they" if subject else "them"
